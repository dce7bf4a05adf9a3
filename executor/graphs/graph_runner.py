"""``GraphRunner``: one phase's CUDA graphs, one per bucket, over a capture backend.

The runner owns the buckets, the static input buffers, padding and output slicing; the
capture backend (composition, chosen by the graph mode) owns the graphs. Two things vary,
each decided once at construction, never per step:

| phase   | logits                         | attention (from the capture backend)       |
|---------|--------------------------------|--------------------------------------------|
| decode  | in the graph, every padded row | ``full``: inside the graph, static metadata |
| prefill | after the graph, sampled rows  | ``breakable``: eager between segments      |

Inside-graph attention uses the attention backend's three graph hooks (static buffers,
dummy metadata at capture, in-place refresh before replay). Eager attention gets the real
batch's metadata through a ``BatchScope`` bound around the replay.

A step's batch reaches the graphs one of two ways. The executor packs a batch it will
replay straight for its bucket (``layout``: padded, in the fixed ``transfer`` buffer), and
the bucket's captured prologue copies it into the static inputs, the request-slot table
and (Triton decode) the static attention rows: one graph launch. Any other batch (tests,
tools) is copied in from the host with ``GraphInputs.fill`` and ``refresh_metadata``.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from executor.api import BucketCapture, Phase, PhaseCapture
from executor.attention.base import SCOPED, AttentionBackend, AttentionMetadata
from executor.forward_batch import ForwardBatch, GraphLayout, dummy_batch
from executor.graphs.backends import CaptureBackend
from executor.graphs.breakable import BatchScope
from executor.graphs.dispatch import RunnerState
from executor.model.llama import CausalLM


@dataclass
class GraphInputs:
    """Static token inputs the graphs read, sized for the largest bucket. Two tensors,
    not views of one: a compiled forward (``tc_piecewise``) must not see its inputs
    alias each other."""

    input_ids: torch.Tensor  # (max_tokens,) int64
    positions: torch.Tensor  # (max_tokens,) int64

    @staticmethod
    def allocate(max_tokens: int, device: torch.device) -> GraphInputs:
        return GraphInputs(torch.zeros(max_tokens, dtype=torch.int64, device=device),
                           torch.zeros(max_tokens, dtype=torch.int64, device=device))

    def fill(self, batch: ForwardBatch, bucket: int) -> None:
        """Copy the batch in; padded tokens ``T..bucket`` are token 0 at position 0."""
        t = batch.num_tokens
        self.input_ids[:t].copy_(batch.input_ids, non_blocking=True)
        self.positions[:t].copy_(batch.positions, non_blocking=True)
        if bucket > t:
            self.input_ids[t:bucket].zero_()
            self.positions[t:bucket].zero_()


class ReplayTimer:
    """CUDA events around replays, read later without adding a host sync to the step."""

    def __init__(self, device: torch.device, maxlen: int = 4096) -> None:
        self.pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque(maxlen=maxlen)
        # Replays run on the device's default stream; resolving the current stream on every
        # record costs more host time than the record itself.
        self._stream = torch.cuda.current_stream(device)

    @contextmanager
    def time(self) -> Iterator[None]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self._stream)
        yield
        end.record(self._stream)
        self.pending.append((start, end))

    def drain(self) -> list[float]:
        """Seconds of every finished replay since the last drain (unfinished ones stay)."""
        out = []
        while self.pending and self.pending[0][1].query():
            start, end = self.pending.popleft()
            out.append(start.elapsed_time(end) / 1e3)
        return out


@contextmanager
def frozen_gc() -> Iterator[None]:
    """Python GC frozen during capture (no collection pauses mid-capture), collected after."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.collect()


class GraphRunner:
    def __init__(self, phase: Phase, model: CausalLM, attn: AttentionBackend,
                 backend: CaptureBackend, buckets: tuple[int, ...], max_context: int,
                 device: torch.device) -> None:
        self.phase, self.model, self.attn, self.backend = phase, model, attn, backend
        self.buckets, self.max_context, self.device = buckets, max_context, device
        self.logits_in_graph = phase == "decode"
        self.inputs = GraphInputs.allocate(max(buckets), device)
        self.scope = BatchScope()
        self.attention_in_graph = backend.attention_in_graph
        self.model_attn = backend.wrap_attention(attn, self.scope, max(buckets))
        self._forward = backend.prepare_forward(self._model_forward)
        self._meta: dict[int, AttentionMetadata] = {}
        self._static_meta_ready = False
        self.failed: dict[int, str] = {}
        self._state: RunnerState | None = None
        # Every bucket's graph writes its result (decode: float32 logits; prefill: hidden
        # states) into rows of this one buffer, so each graph's own output goes back to
        # the shared pool after capture instead of staying alive per bucket (the decode
        # logits of 35 buckets up to batch 256 alone held 1.5 GiB). Allocated at the first
        # capture, when the backend's graphs run the whole forward.
        self._out: torch.Tensor | None = None
        self.timer = ReplayTimer(device)
        # Batches packed for a bucket (``GraphLayout``) land in ``transfer``; per bucket, a
        # captured prologue moves them into the graphs' inputs (``_capture_prologue``).
        largest = max(buckets)
        self.transfer = torch.zeros(GraphLayout.max_packed_size(largest), dtype=torch.int64,
                                    device=device)
        self._layouts = {b: GraphLayout(b, attn.table.scratch_index, self.transfer)
                         for b in buckets}
        self._prologues: dict[int, torch.cuda.CUDAGraph] = {}
        # Buckets whose prologue also refreshes the static attention rows (decode, full).
        self._rows_in_prologue: set[int] = set()
        self._prologue_pool: Any = None  # a graph pool handle, made at the first capture
        self._prologue_stream: torch.cuda.Stream | None = None
        # Test hook: called with each bucket before it is captured (fault injection).
        self.before_capture: Callable[[int], None] | None = None

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

        if force:
            self.release()
        self.failed.clear()
        self._state = None
        start = time.perf_counter()
        # Largest first: the shared pool is sized by the biggest bucket, and each smaller
        # one is captured into blocks the pool already holds instead of growing it.
        todo = [b for b in sorted(self.buckets, reverse=True) if not self.backend.has(b)]
        results = []
        bar = tqdm(todo, desc=f"capture {self.phase} ({self.backend.name})", unit="bucket",
                   disable=not progress)
        # Graph memory is what the graphs hold: their static buffers (attention metadata,
        # the shared output) and, per bucket, the free-memory drop of the capture alone
        # (a private pool's segments are its own, so they show in free memory).
        # Each bucket warms up before its first reading, so kernels loaded at their first
        # use, library workspaces and warm-up activations are not counted (a first
        # capture in a process would otherwise report a few hundred MiB that are not the
        # graphs'). frozen_gc collects garbage first, so no dropped object is freed
        # meanwhile. After: warm-up activations stay cached for the capture stream alone;
        # empty_cache gives them back (it does not touch the graphs' pool).
        with frozen_gc():
            torch.cuda.empty_cache()
            # Allocated bytes, not free memory: the caching allocator may carve these
            # buffers out of a segment it already holds.
            allocated_before = torch.cuda.memory_allocated(self.device)
            self._allocate_static_buffers()
            static_bytes = torch.cuda.memory_allocated(self.device) - allocated_before
            with torch.inference_mode():
                for bucket in bar:
                    results.append(self._capture_one(bucket))
                    free = torch.cuda.mem_get_info(self.device)[0]
                    bar.set_postfix(size=bucket, free_gib=f"{free / 2**30:.1f}")
        bar.close()
        self._state = None
        torch.cuda.empty_cache()
        used = static_bytes + sum(r.memory_bytes for r in results)
        return PhaseCapture(self.phase, self.backend.name,
                            tuple(sorted(results, key=lambda r: r.size)),
                            (time.perf_counter() - start) * 1e3, used)

    def _capture_one(self, bucket: int) -> BucketCapture:
        t0 = time.perf_counter()
        try:
            if self.before_capture is not None:
                self.before_capture(bucket)
            self.inputs.input_ids[:bucket].zero_()
            self.inputs.positions[:bucket].zero_()
            with self._capture_forward(bucket) as fn:
                self.backend.warm_up(bucket, fn)
                free_before = self._free_memory()
                self.backend.capture(bucket, fn)
                free_after = self._free_memory()
            self._capture_prologue(bucket)
        except Exception as exc:  # one bucket failing must not stop the others
            self.failed[bucket] = f"{type(exc).__name__}: {exc}"
            torch.cuda.synchronize(self.device)
            return BucketCapture(bucket, (time.perf_counter() - t0) * 1e3, False,
                                 self.failed[bucket])
        used = max(0, free_before - free_after)
        return BucketCapture(bucket, (time.perf_counter() - t0) * 1e3, True, "", used)

    def _capture_prologue(self, bucket: int) -> None:
        """Capture the copies that take a batch packed for ``bucket`` from ``transfer``
        into the graphs: token ids and positions into the static inputs, the new KV
        locations into the request-slot table (padding rows write its scratch cell) and,
        where the attention backend allows (``static_decode_rows``), the decode rows into
        its static metadata. One graph launch instead of four to six host-issued ops.

        It first runs once uncaptured (kernels load at first use) on a padded empty batch,
        which writes only the scratch cell and padding values."""
        b, x = bucket, self.transfer
        rows = (self.attn.static_decode_rows(self._meta[bucket])
                if self.attention_in_graph else None)

        def body() -> None:
            self.inputs.input_ids[:b].copy_(x[:b])
            self.inputs.positions[:b].copy_(x[b : 2 * b])
            self.attn.table.write_device(x[2 * b : 3 * b], x[3 * b : 4 * b])
            if rows is not None:
                rows.copy_(x[3 * b : 6 * b].view(3, b))

        # Device-side fills only: no host-to-device copy (a pinned staging block) here.
        self._layouts[bucket].fill_padding()
        if self._prologue_pool is None:
            self._prologue_pool = torch.cuda.graph_pool_handle()
        if self._prologue_stream is None:
            self._prologue_stream = torch.cuda.Stream(self.device)
        stream = self._prologue_stream
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            body()
            graph.capture_begin(pool=self._prologue_pool)
            try:
                body()
            finally:
                graph.capture_end()
        current.wait_stream(stream)
        self._prologues[bucket] = graph
        if rows is not None:
            self._rows_in_prologue.add(bucket)

    def _free_memory(self) -> int:
        """Free device memory once cached blocks are given back: between two readings,
        what a capture keeps (its pool segments, the graphs), not what the eager ops
        between breakable segments left cached (they reuse it, and it is given back)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]

    @contextmanager
    def _capture_forward(self, bucket: int) -> Iterator[Callable[[], torch.Tensor]]:
        """The forward to warm up and capture for ``bucket``, with its attention inputs:
        static metadata (kept for replay once captured) or a dummy batch bound to the
        scope (attention reads the scope, not an argument: the forward gets ``SCOPED``,
        so one compiled function serves every bucket)."""
        if self.attention_in_graph:
            meta = self.attn.capture_metadata(self.phase, bucket, bucket)
            yield self._forward_fn(bucket, meta)
            self._meta[bucket] = meta
        else:
            dummy = dummy_batch(self.phase, bucket, self.max_context, self.device)
            with self.scope.bind(self.attn.build_metadata(dummy), bucket):
                yield self._forward_fn(bucket, SCOPED)

    def _allocate_static_buffers(self) -> None:
        """Buffers every bucket's graphs share, made at the first capture: attention's
        static metadata (when captured inside the graphs) and the shared output."""
        largest = max(self.buckets)
        if self.attention_in_graph and not self._static_meta_ready:
            self.attn.init_graph_buffers(largest, largest)
            self._static_meta_ready = True
        if self.backend.whole_forward_in_graph and self._out is None:
            self._out = self._allocate_output(largest)

    def _allocate_output(self, rows: int) -> torch.Tensor:
        spec = self.model.spec
        if self.logits_in_graph:
            return torch.empty(rows, spec.vocab_size, dtype=torch.float32, device=self.device)
        dtype = self.model.embed_tokens.weight.dtype
        return torch.empty(rows, spec.hidden_size, dtype=dtype, device=self.device)

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

    def _forward_fn(self, bucket: int, meta: AttentionMetadata) -> Callable[[], torch.Tensor]:
        ids, pos = self.inputs.input_ids[:bucket], self.inputs.positions[:bucket]
        return lambda: self._forward(ids, pos, meta)

    # -- replay --------------------------------------------------------------------------
    def layout(self, bucket: int) -> GraphLayout:
        return self._layouts[bucket]

    def replay(self, batch: ForwardBatch, bucket: int) -> torch.Tensor:
        """Run ``batch`` padded to ``bucket``; float32 logits of ``batch.logits_indices``,
        valid until the next replay of this runner.

        A batch packed for ``bucket`` (``layout``) is taken in by the bucket's prologue;
        any other batch is copied in from the host (its table entries already
        published by whoever built it)."""
        staged = batch.bucket is not None
        if staged and (batch.bucket != bucket
                       or batch.input_ids.data_ptr() != self.transfer.data_ptr()
                       or bucket not in self._prologues):
            raise ValueError(f"batch packed for bucket {batch.bucket} of another runner or "
                             f"an uncaptured bucket, replayed at bucket {bucket}")
        if not staged:
            self.inputs.fill(batch, bucket)
        with self.timer.time():
            if staged:
                self._prologues[bucket].replay()
            if self.attention_in_graph:
                if not (staged and bucket in self._rows_in_prologue):
                    self.attn.refresh_metadata(self._meta[bucket], batch)
                out = self.backend.replay(bucket)
            else:
                with self.scope.bind(self.attn.build_metadata(batch), batch.num_tokens):
                    out = self.backend.replay(bucket)
        if self.logits_in_graph:  # decode: logits_indices are rows 0..B-1
            return out[: batch.batch_size]
        return self.model.compute_logits(out[batch.logits_indices])

    @property
    def runs_uncaptured(self) -> bool:
        # Only a compiling backend's forward serves any shape: breakable's attention buffers
        # are sized for the largest bucket, and a full graph's forward is the eager model.
        return self.backend.name == "tc_piecewise" and not self.logits_in_graph

    def run_uncaptured(self, batch: ForwardBatch) -> torch.Tensor:
        with self.scope.bind(self.attn.build_metadata(batch), batch.num_tokens):
            hidden = self._forward(batch.input_ids, batch.positions, SCOPED)
        return self.model.compute_logits(hidden[batch.logits_indices])

    def captured_sizes(self) -> tuple[int, ...]:
        return self.backend.captured()

    def drain_replay_seconds(self) -> list[float]:
        return self.timer.drain()

    def release(self) -> None:
        self.backend.release()
        self._prologues.clear()
        self._rows_in_prologue.clear()
        self._prologue_pool = None  # as the backends do: a recapture gets a fresh pool
        self._meta.clear()
        self._state = None
