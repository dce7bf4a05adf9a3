"""A stand-in device: the real server and executor host path on CPU, the GPU simulated.

``python -m bench.serving.stand_in --span-ms 1:1.27,64:1.63 -- serve --model tiny --device cpu``

What the host and the RPC boundary leave of the GPU's time can be studied without a GPU.
``StandInExecutor`` is the real ``Executor`` (tiny model, CPU) with two changes: the
forward returns zeros of the logits' shape at once, and every launched step gets a
``VirtualEvent`` instead of a CUDA event. The events model one in-order device queue: a
step launched at ``t`` runs from ``max(t, end of the step before)`` for its span (the span
given for the smallest batch at least its size, times its ``num_steps``), and waiting for
the event sleeps (the GIL free, as in ``torch.cuda.Event.synchronize``). It does not model
the host cost of launching real kernels: ``--launch-host-us`` adds a busy wait holding the
GIL to every launch, as those CUDA calls do. With ``graphs``, decode steps take the host
path of a graph replay (``StandInGraphs``: packed for a bucket, no eager table write), as
a GPU serves them. Compare variants within one run on one machine
(``bench.serving.session_latency --stand-in-span-ms``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import torch

from executor.api import Phase
from executor.config import ExecutorConfig
from executor.executor import Executor
from executor.forward_batch import ForwardBatch
from executor.graphs.buckets import default_decode_buckets
from executor.graphs.dispatch import RunnerState
from executor.packing import GraphLayout
from executor.steps import PendingStep


class VirtualEvent:
    """A device event that fires at ``ready_at`` (``time.perf_counter`` seconds)."""

    def __init__(self, ready_at: float) -> None:
        self.ready_at = ready_at

    def query(self) -> bool:
        return time.perf_counter() >= self.ready_at

    def synchronize(self) -> None:
        while (left := self.ready_at - time.perf_counter()) > 0:
            time.sleep(left)


def parse_spans(text: str) -> dict[int, float]:
    """``"1:1.27,64:1.63"`` -> {batch: span in seconds}."""
    spans = {}
    for part in text.split(","):
        batch, ms = part.split(":")
        spans[int(batch)] = float(ms) / 1e3
    return dict(sorted(spans.items()))


class StandInGraphs:
    """A decode graph runner on the host: every bucket counts as captured, a batch is
    packed for its bucket into a fixed buffer (``GraphLayout``, host memory), and a replay
    returns zero logits from a fixed output, as a captured graph leaves them (the token
    masks, the table write, the rows' argmax and its store as their last sampled tokens
    happen "inside the graph": not on the host; the argmax of zeros is 0, and so is every
    slot's last token here)."""

    controls_in_graph = True
    stores_greedy = True
    runs_compiled = False

    def __init__(self, buckets: tuple[int, ...], vocab: int, table_scratch: int) -> None:
        self.buckets = buckets
        transfer = torch.zeros(GraphLayout.max_packed_size(max(buckets)), dtype=torch.int64)
        self.layouts = {b: GraphLayout(b, table_scratch, transfer, "decode") for b in buckets}
        self._out = torch.zeros(max(buckets), vocab)
        self._greedy = torch.zeros(max(buckets), dtype=torch.int64)  # the argmax of zeros
        self._state = RunnerState(cuda=True, enabled=True, buckets=buckets,
                                  captured=frozenset(buckets), failed=frozenset())

    def state(self) -> RunnerState:
        return self._state

    def layout(self, bucket: int) -> GraphLayout:
        return self.layouts[bucket]

    def replay(self, batch: ForwardBatch, bucket: int, want_hidden: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._out[: batch.batch_size], None

    def greedy(self, batch_size: int) -> torch.Tensor:
        return self._greedy[:batch_size]

    def drain_replay_seconds(self) -> list[float]:
        return []

    def captured_sizes(self) -> tuple[int, ...]:
        return self.buckets


class StandInExecutor(Executor):
    """``Executor`` whose device is an in-order queue of steps; a step of ``n`` sequences
    takes the span of the smallest batch in ``spans`` at least ``n`` (else the largest).
    ``graphs``: decode steps take a graph replay's host path (``StandInGraphs``)."""

    def __init__(self, config: ExecutorConfig, spans: dict[int, float],
                 launch_host_s: float = 0.0, graphs: bool = False) -> None:
        super().__init__(config)
        if graphs:  # (the forward shares this dict)
            self.runners["decode"] = StandInGraphs(  # type: ignore[assignment]
                default_decode_buckets(config.decode_batch_limit),
                self.model_info.vocab_size, self.table.scratch_index)
        self.spans = spans
        self.launch_host_s = launch_host_s  # extra host time per launch, GIL held
        self.device_free_at = 0.0
        vocab = self.model_info.vocab_size
        # Instance attributes shadow the forward's methods: no model work on the host.
        self.forward.forward_logits = (  # type: ignore[method-assign]
            lambda batch: torch.zeros(int(batch.logits_indices.numel()), vocab))
        self.forward.forward_only = lambda batch: None  # type: ignore[method-assign]
        pend = self.pools.pend
        self.pools.pend = lambda step: self._on_device(pend(step))  # type: ignore[method-assign]

    def startup_phases(self) -> tuple[Phase, ...]:
        return ()  # nothing to capture

    def span_s(self, sequences: int) -> float:
        fits = [s for b, s in self.spans.items() if b >= sequences]
        return fits[0] if fits else list(self.spans.values())[-1]

    def _on_device(self, step: PendingStep) -> PendingStep:
        """A launched step queued on the simulated device (after the real pools' pend)."""
        if self.launch_host_s > 0:  # a busy wait: CUDA API calls hold the GIL too
            until = time.perf_counter() + self.launch_host_s
            while time.perf_counter() < until:
                pass
        start = max(time.perf_counter(), self.device_free_at)
        self.device_free_at = start + self.span_s(len(step.seq_ids)) * max(1, len(step.samples))
        step.done = VirtualEvent(self.device_free_at)  # type: ignore[assignment]
        return step


def main(argv: list[str] | None = None) -> int:
    """``--span-ms`` then ``--`` and the ``model-executor serve`` flags (CPU only)."""
    args = list(sys.argv[1:] if argv is None else argv)
    split = args.index("--") if "--" in args else len(args)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--span-ms", required=True, help="BATCH:MS,... e.g. 1:1.27,64:1.63")
    ap.add_argument("--launch-host-us", type=float, default=0.0,
                    help="extra host time per launch, GIL held (real launches' CUDA calls)")
    ap.add_argument("--graphs", action="store_true",
                    help="decode steps take a graph replay's host path (StandInGraphs)")
    own = ap.parse_args(args[:split])
    from service.cli import build_configs, build_parser
    from service.logs import configure_logging
    from service.server import ExecutorServer, run_until_signal

    serve = build_parser().parse_args(args[split + 1:])
    executor_config, server_config = build_configs(serve)
    if executor_config.is_cuda:
        raise SystemExit("the stand-in device runs on --device cpu")
    configure_logging(serve.log_format, serve.log_level or "WARNING")  # type: ignore[arg-type]

    async def run() -> int:
        def factory() -> Any:
            return StandInExecutor(executor_config, parse_spans(own.span_ms),
                                   own.launch_host_us / 1e6, own.graphs)

        server = ExecutorServer(executor_config, server_config, executor_factory=factory)
        await server.start()
        print(f"stand-in serving on port {server.port}", flush=True)
        ok = await run_until_signal(server, asyncio.Event())
        await server.stop()
        return 0 if ok else 1

    return asyncio.run(run())


if __name__ == "__main__":
    raise SystemExit(main())
