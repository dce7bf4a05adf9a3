"""``GraphRunner``: one phase's CUDA graphs, one per bucket, over a capture backend.

The runner owns the buckets, the static inputs and output, and the capture loop; the
capture backend (composition, chosen by the graph mode) owns the graphs, the prologue
(``prologue.py``) takes each step's packed batch into them, and ``accounting.py`` measures
their memory and time. Two things vary, each decided once at construction, never per step:

| phase   | logits                         | attention (from the capture backend)       |
|---------|--------------------------------|--------------------------------------------|
| decode  | in the graph, every padded row | ``full``: inside the graph, static metadata |
| prefill | after the graph, sampled rows  | ``breakable``: eager between segments;     |
|         |                                | ``fixed_grid``: inside, static metadata    |

Inside-graph attention uses the attention backend's graph hooks (static buffers, dummy
metadata at capture, a refresh before replay: captured in the prologue where the backend
allows it). Eager attention gets the real batch's metadata through a ``BatchScope`` bound
around the replay.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from executor.api import BucketCapture, Phase, PhaseCapture
from executor.attention.base import SCOPED, AttentionBackend, AttentionMetadata
from executor.forward_batch import ForwardBatch, dummy_batch
from executor.graphs.accounting import CaptureMemory, ReplayTimer
from executor.graphs.backends import BatchScope, CaptureBackend
from executor.graphs.dispatch import RunnerState
from executor.graphs.prologue import GraphInputs, Prologue
from executor.kv.pool import ReqToTokenTable
from executor.model.base import CausalModel
from executor.packing import GraphLayout


class GraphRunner:
    def __init__(self, phase: Phase, model: CausalModel, attn: AttentionBackend,
                 backend: CaptureBackend, buckets: tuple[int, ...], max_context: int,
                 table: ReqToTokenTable, device: torch.device,
                 last_tokens: torch.Tensor | None = None) -> None:
        self.phase, self.model, self.attn, self.backend = phase, model, attn, backend
        self.buckets, self.max_context, self.device = buckets, max_context, device
        self.logits_in_graph = phase == "decode"
        self.attention_in_graph = backend.attention_in_graph
        self.inputs = GraphInputs.allocate(max(buckets), device)
        self.prologue = Prologue(phase, buckets, self.inputs, table, device, last_tokens)
        self.scope = BatchScope()
        self.model_attn = backend.wrap_attention(attn, self.scope, max(buckets))
        self._forward = backend.prepare_forward(self._model_forward)
        self._meta: dict[int, AttentionMetadata] = {}  # static metadata per bucket
        self._static_meta_ready = False
        # Every bucket's graph writes its result (decode: logits; prefill: hidden states,
        # both in the activation dtype) into rows of this one buffer, so each graph's own
        # output goes back to the shared pool after capture instead of staying alive per
        # bucket (the float32 decode logits of 35 buckets up to batch 256 alone held
        # 1.5 GiB). Allocated at the first capture, for backends whose captured callable
        # is the runner's forward.
        self._out: torch.Tensor | None = None
        self.failed: dict[int, str] = {}
        self._state: RunnerState | None = None
        self.memory = CaptureMemory(device)
        self.timer = ReplayTimer(device)
        # Test hook: called with each bucket before it is captured (fault injection).
        self.before_capture: Callable[[int], None] | None = None
        # Tensor parallelism: True only if every rank captured the bucket (a collective;
        # every rank captures the same buckets in the same order). None: one process.
        self.agree: Callable[[bool], bool] | None = None

    def state(self) -> RunnerState:
        # Asked at every step; it changes only when capturing or releasing.
        if self._state is None:
            self._state = RunnerState(cuda=True, enabled=True, buckets=self.buckets,
                                      captured=frozenset(self.backend.captured()),
                                      failed=frozenset(self.failed))
        return self._state

    # -- capture -------------------------------------------------------------------------
    def capture_all(self, force: bool = False, progress: bool = True) -> PhaseCapture:
        """Capture every bucket not yet captured, largest first. A failing bucket is
        reported and skipped; the others stay usable."""
        from tqdm import tqdm

        if self.agree is not None and not force:
            force = ranks_differ([self.backend.has(b) for b in self.buckets], self.agree)
        if force:
            self.release()
        self.failed.clear()
        self._state = None
        start = time.perf_counter()
        # Largest first: the shared pool is sized by the biggest bucket, and each smaller
        # one is captured into blocks the pool already holds instead of growing it.
        todo = [b for b in sorted(self.buckets, reverse=True) if not self.backend.has(b)]
        bar = tqdm(todo, desc=f"capture {self.phase} ({self.backend.name})", unit="bucket",
                   disable=not progress)
        with self.memory.session(), torch.inference_mode():
            static_bytes = self.memory.allocated_by(self._allocate_static_buffers)
            results = []
            for bucket in bar:
                result = self._capture_one(bucket)
                if self.agree is not None and not self.agree(result.ok) and result.ok:
                    # Replaying it here alone would hang the ranks that have no graph.
                    self.failed[bucket] = "capture failed on another tensor-parallel rank"
                    result = BucketCapture(bucket, result.capture_ms, False,
                                           self.failed[bucket], result.memory_bytes)
                results.append(result)
                free = torch.cuda.mem_get_info(self.device)[0]
                bar.set_postfix(size=bucket, free_gib=f"{free / 2**30:.1f}")
        bar.close()
        self._state = None
        used = static_bytes + sum(r.memory_bytes for r in results)
        return PhaseCapture(self.phase, self.backend.name,
                            tuple(sorted(results, key=lambda r: r.size)),
                            (time.perf_counter() - start) * 1e3, used)

    def _capture_one(self, bucket: int) -> BucketCapture:
        """Warm up, then capture while measuring, then capture the prologue."""
        t0 = time.perf_counter()
        try:
            if self.before_capture is not None:
                self.before_capture(bucket)
            self.inputs.input_ids[:bucket].zero_()
            self.inputs.positions[:bucket].zero_()
            with self._capture_forward(bucket) as fn:
                self.backend.warm_up(bucket, fn)
                used = self.memory.held_by(lambda: self.backend.capture(bucket, fn))
            rows = self.attn.static_decode_rows(self._meta[bucket]) \
                if self.attention_in_graph else None
            self.prologue.capture(bucket, rows)
        except Exception as exc:  # one bucket failing must not stop the others
            self.failed[bucket] = f"{type(exc).__name__}: {exc}"
            torch.cuda.synchronize(self.device)
            return BucketCapture(bucket, (time.perf_counter() - t0) * 1e3, False,
                                 self.failed[bucket])
        return BucketCapture(bucket, (time.perf_counter() - t0) * 1e3, True, "", used)

    @contextmanager
    def _capture_forward(self, bucket: int) -> Iterator[Callable[[], torch.Tensor]]:
        """The forward to warm up and capture for ``bucket``, with its attention inputs:
        static metadata (kept for replay once captured) or a dummy batch bound to the
        scope (attention reads the scope, not an argument: the forward gets ``SCOPED``,
        so one compiled function serves every bucket)."""
        ids, pos = self.inputs.input_ids[:bucket], self.inputs.positions[:bucket]
        if self.attention_in_graph:
            meta = self.attn.capture_metadata(self.phase, bucket, bucket)
            yield lambda: self._forward(ids, pos, meta)
            self._meta[bucket] = meta
        else:
            dummy = dummy_batch(self.phase, bucket, self.max_context, self.device)
            with self.scope.bind(self.attn.build_metadata(dummy), bucket):
                yield lambda: self._forward(ids, pos, SCOPED)

    def _allocate_static_buffers(self) -> None:
        """Buffers every bucket's graphs share, made at the first capture: attention's
        static metadata (when captured inside the graphs) and the shared output."""
        largest = max(self.buckets)
        if self.attention_in_graph and not self._static_meta_ready:
            self.attn.init_graph_buffers(largest, largest, self.phase)
            self._static_meta_ready = True
        if self.backend.captures_runner_forward and self._out is None:
            width = self.model.spec.vocab_size if self.logits_in_graph \
                else self.model.spec.hidden_size
            # Logits too stay in the activation dtype (``compute_logits``): half the
            # bytes of float32, and no cast kernel in every decode step.
            self._out = torch.empty(largest, width, dtype=self.model.hidden_dtype,
                                    device=self.device)

    def _model_forward(self, ids: torch.Tensor, pos: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(ids, pos, self.model_attn, meta)  # (T, hidden)
        if self.logits_in_graph:
            return self.model.compute_logits(hidden, out=self._out)
        if self._out is None:
            return hidden
        dst = self._out[: hidden.shape[0]]
        dst.copy_(hidden)
        return dst

    # -- replay --------------------------------------------------------------------------
    def layout(self, bucket: int) -> GraphLayout:
        return self.prologue.layouts[bucket]

    def replay(self, batch: ForwardBatch, bucket: int) -> torch.Tensor:
        """Run ``batch``, packed for ``bucket`` (``layout``); logits of
        ``batch.logits_indices`` in the activation dtype (``compute_logits``), valid until
        the next replay of this runner."""
        with self.timer.time():
            rows_refreshed = self.prologue.replay(batch, bucket)
            if not self.attention_in_graph:
                with self.scope.bind(self.attn.build_metadata(batch), batch.num_tokens):
                    out = self.backend.replay(bucket)
            else:
                if not rows_refreshed:
                    self.attn.refresh_metadata(self._meta[bucket], batch)
                out = self.backend.replay(bucket)
        if self.logits_in_graph:  # decode: logits_indices are rows 0..B-1
            return out[: batch.batch_size]
        return self.model.compute_logits(out[batch.logits_indices])

    @property
    def runs_uncaptured(self) -> bool:
        return self.backend.serves_uncaptured_shapes

    def run_uncaptured(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits as ``replay`` gives them (a new tensor, no graph)."""
        with self.scope.bind(self.attn.build_metadata(batch), batch.num_tokens):
            hidden = self._forward(batch.input_ids, batch.positions, SCOPED)
        return self.model.compute_logits(hidden[batch.logits_indices])

    def captured_sizes(self) -> tuple[int, ...]:
        return self.backend.captured()

    def drain_replay_seconds(self) -> list[float]:
        return self.timer.drain()

    def release(self) -> None:
        self.backend.release()
        self.prologue.release()
        self._meta.clear()
        self._state = None


def ranks_differ(captured: list[bool], agree: Callable[[bool], bool]) -> bool:
    """True, on every rank, if some bucket is captured on some ranks only (one failed
    there earlier): then all ranks must start over together, or their captures (and the
    collectives inside) would no longer pair up. ``captured``: this rank's, per bucket;
    ``agree``: the all-ranks AND (a collective). NOTE: every rank makes the same number of
    ``agree`` calls (a list, never a short-circuit)."""
    everywhere = [agree(c) for c in captured]
    return not agree(captured == everywhere)
