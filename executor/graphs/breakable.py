"""Breakable CUDA graphs: a forward captured as graph segments split at graph-hostile ops.

During capture, a graph-hostile op (attention with per-batch metadata, anything that syncs
with the host) calls ``BreakableGraphBackend.graph_break``: the current segment's capture
ends, the op runs eagerly, and a new segment begins. Replay runs segment, eager op,
segment, ... with the eager ops reading the real batch's state. All segments of all shapes
share one memory pool. No compiler is involved.

Marking is explicit: ``BreakingAttention`` wraps an attention backend and is what the
runner passes to the model while capturing and replaying with this backend; the model
code never checks a flag. The per-batch state the eager ops read lives in ``BatchScope``,
owned by the runner, bound for exactly one replay at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from executor.attention.base import AttentionBackend, AttentionMetadata
from executor.graphs.backends import (
    BatchScope,
    CapturedFn,
    CaptureStream,
    ForwardFn,
    weak_view,
)

EagerOp = Callable[[], None]


@dataclass
class _Capture:
    """One shape's capture: segments and the eager ops between them (len(ops) + 1 graphs)."""

    segments: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    ops: list[EagerOp] = field(default_factory=list)
    current: torch.cuda.CUDAGraph | None = None


class BreakableGraphBackend:
    name = "breakable"
    #: Attention runs eagerly between segments, so it needs no static metadata buffers.
    attention_in_graph = False
    captures_runner_forward = True
    serves_compiled_shapes = False

    def wrap_attention(self, attn: AttentionBackend, scope: BatchScope, max_tokens: int
                       ) -> AttentionBackend:
        """The attention the model calls under this backend: marked graph-hostile."""
        return BreakingAttention(attn, self, scope)

    def prepare_forward(self, forward: ForwardFn) -> ForwardFn:
        return forward

    def __init__(self, device: torch.device, warmup_runs: int = 1) -> None:
        self.device = device
        self.warmup_runs = warmup_runs
        self.streams = CaptureStream(device)
        self._captures: dict[int, _Capture] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._active: _Capture | None = None

    # -- called by graph-hostile ops -----------------------------------------------------
    @property
    def capturing(self) -> bool:
        return self._active is not None

    def graph_break(self, op: EagerOp) -> None:
        """End the current segment, run ``op`` eagerly now and again at every replay
        between the same two segments, and begin the next segment. Only while capturing."""
        cap = self._active
        assert cap is not None and cap.current is not None, "graph_break outside capture"
        cap.current.capture_end()
        cap.segments.append(cap.current)
        op()
        cap.ops.append(op)
        cap.current = self._begin_segment()

    # -- capture backend contract ----------------------------------------------------------
    def warm_up(self, shape: int, fn: CapturedFn) -> None:
        self.streams.warm_up(fn, self.warmup_runs)  # not capturing: ops run inline

    def capture(self, shape: int, fn: CapturedFn) -> torch.Tensor:
        with self.streams.active():
            cap = _Capture()
            self._active = cap
            try:
                cap.current = self._begin_segment()
                out = fn()
                cap.current.capture_end()
                cap.segments.append(cap.current)
            finally:
                self._active = None
        self._captures[shape] = cap
        self._outputs[shape] = out
        return out

    def _begin_segment(self) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.streams.pool)
        return graph

    def replay(self, shape: int) -> torch.Tensor:
        cap = self._captures[shape]
        for segment, op in zip(cap.segments, cap.ops, strict=False):
            segment.replay()
            op()
        cap.segments[-1].replay()
        return self._outputs[shape]

    def has(self, shape: int) -> bool:
        return shape in self._captures

    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._captures))

    def segments(self, shape: int) -> int:
        return len(self._captures[shape].segments)

    def release(self) -> None:
        self._captures.clear()
        self._outputs.clear()
        self.streams.reset()


class _RowViews:
    """The op's tensors cut to the bound batch's real tokens, cut once per token count:
    every layer of a replay asks for the same count, and slicing costs host time."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.tensors = tensors
        self._rows: tuple[int, tuple[torch.Tensor, ...]] = (-1, ())

    def rows(self, n: int) -> tuple[torch.Tensor, ...]:
        if self._rows[0] != n:
            self._rows = (n, tuple(t[:n] for t in self.tensors))
        return self._rows[1]


class BreakingAttention(AttentionBackend):
    """Attention marked graph-hostile: under capture it breaks the graph and runs eagerly.

    The eager op reads q/k/v where the segment before it wrote them and writes its output
    into a tensor that segment allocated, for the segment after it to read: all in the
    graphs' shared pool, held through ``weak_view`` (no static copies, no extra kernels).
    Like the pieces of ``tc_piecewise``, that keeps the pool about one forward's
    activations: a layer's q/k/v/out blocks are reused by later layers and smaller
    buckets, which replay only after this op has run.
    """

    name = "breaking"

    def __init__(self, inner: AttentionBackend, graphs: BreakableGraphBackend, scope: BatchScope
                 ) -> None:
        super().__init__(inner.shape, inner.pool, inner.table)
        self.inner, self.graphs, self.scope = inner, graphs, scope

    def build_metadata(self, batch: Any) -> AttentionMetadata:
        return self.inner.build_metadata(batch)

    def fuses_rope(self, meta: AttentionMetadata) -> bool:
        """As the inner backend does for the bound batch: the model asks while its pieces
        are captured (or run uncaptured), and the eager attention between them then gets
        q and k as the model left them."""
        del meta
        bound = self.scope.meta
        return bound is not None and self.inner.fuses_rope(bound)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        """``meta`` is ignored: the batch bound to the scope (dummy while capturing, the
        real one while replaying) is what attention reads. Rows past its token count
        (bucket padding) neither store K/V nor attend; their output is left unwritten."""
        out = q.new_empty(q.shape)  # while capturing: a block of the graphs' pool
        if not self.graphs.capturing:
            self._attend(_RowViews((q, k, v, out)), layer_id)
            return out
        views = _RowViews(tuple(weak_view(t) for t in (q, k, v, out)))
        self.graphs.graph_break(lambda: self._attend(views, layer_id))
        return out

    def _attend(self, views: _RowViews, layer_id: int) -> None:
        bound = self.scope.meta
        assert bound is not None, "breakable attention without a bound batch"
        if self.inner.padded_rows_ok:  # the kernel finds the real rows from metadata
            q, k, v, out = views.tensors
        else:
            q, k, v, out = views.rows(self.scope.num_tokens)
        self.inner.forward_into(q, k, v, out, layer_id, bound)
