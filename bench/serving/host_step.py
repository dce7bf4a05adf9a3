"""The host work of one decode step, without a device: ``python -m bench.serving.host_step``.

A Decode of ``--batch`` items on the ``tiny`` model with the forward replaced by zeros of
the logits' shape (``bench.serving.stand_in``), so only the Python and torch-CPU work
around it is timed: request conversion (``convert.decode_items``), the executor's step
(validate, allocate, pack, sample, complete) and the response (``convert.step_response``,
item messages and packed). Medians over calls, microseconds per step, printed as JSON. This
is the part of a step that a GPU cannot hide at large batches; compare figures within one
run on one machine. ``--graphs``: decode steps take a graph replay's host path, as on a
GPU (``StandInGraphs``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from bench.serving.stand_in import StandInExecutor
from executor.api import PrefillItem
from executor.config import CacheConfig, ExecutorConfig
from service import convert
from service.config import RequestLimits
from service.gen.model_executor.v1 import executor_pb2 as pb


def _median_us(fn: Callable[[], object], calls: int, rounds: int = 5) -> float:
    """The median of every call's own time (on a shared host, a call that lost its CPU
    moves only itself, not a round's mean)."""
    out = []
    clock = time.perf_counter
    for _ in range(rounds * calls):
        start = clock()
        fn()
        out.append(clock() - start)
    return statistics.median(out) * 1e6


def measure(batch: int, calls: int, graphs: bool = False) -> dict[str, float]:
    # The forward stubbed to zeros of the logits' shape, a device that takes no time.
    ex = StandInExecutor(ExecutorConfig(cache=CacheConfig(kv_tokens=batch * 1024,
                                                          max_sequences=batch,
                                                          max_context=2048),
                                        max_decode_batch=batch), {batch: 0.0},
                         graphs=graphs)
    ids = [f"seq-{i}" for i in range(batch)]
    ex.prefill([PrefillItem(s, [1, 2, 3, 4]) for s in ids])
    limits = RequestLimits.from_executor(ex.config)
    request = pb.DecodeRequest(items=[pb.DecodeItem(seq_id=s, use_last_sampled=True)
                                      for s in ids])
    items = convert.decode_items(request, limits)

    def decode() -> object:
        if ex.kv.get(ids[0]).length > 900:  # type: ignore[union-attr]
            for s in ids:
                ex.truncate(s, 4)
            ex.prefill([PrefillItem(s, [5]) for s in ids])
        return ex.decode(items)

    result = decode()
    for _ in range(50):
        decode()

    def step() -> None:
        res = ex.decode(convert.decode_items(request, limits)) \
            if ex.kv.get(ids[0]).length <= 900 else decode()  # type: ignore[union-attr]
        convert.step_response(res, 0, 0, pb.DecodeResponse).SerializeToString()  # type: ignore[arg-type]

    return {
        "convert_request_us": _median_us(lambda: convert.decode_items(request, limits), calls),
        "executor_decode_us": _median_us(decode, calls),
        "response_items_us": _median_us(lambda: convert.step_response(
            result, 0, 0, pb.DecodeResponse).SerializeToString(), calls),  # type: ignore[arg-type]
        "response_packed_us": _median_us(lambda: convert.step_response(
            result, 0, 0, pb.DecodeResponse, True).SerializeToString(), calls),  # type: ignore[arg-type]
        "whole_step_us": _median_us(step, calls),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--graphs", action="store_true",
                    help="decode steps take a graph replay's host path (as on a GPU)")
    a = ap.parse_args(argv)
    print(json.dumps({"batch": a.batch, "graphs": a.graphs, **{
        k: round(v, 1) for k, v in measure(a.batch, a.calls, a.graphs).items()}}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
