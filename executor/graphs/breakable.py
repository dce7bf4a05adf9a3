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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from executor.attention.base import AttentionBackend, AttentionMetadata
from executor.graphs.backends import CapturedFn, ForwardFn

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
    whole_forward_in_graph = True

    def wrap_attention(self, attn: AttentionBackend, scope: BatchScope, max_tokens: int
                       ) -> AttentionBackend:
        """The attention the model calls under this backend: marked graph-hostile."""
        s = attn.shape
        io = AttentionIO.allocate(max_tokens, s.num_heads, s.num_kv_heads, s.head_dim,
                                  attn.pool.dtype, self.device)
        return BreakingAttention(attn, self, scope, io)

    def prepare_forward(self, forward: ForwardFn) -> ForwardFn:
        return forward

    def __init__(self, device: torch.device, warmup_runs: int = 1) -> None:
        self.device = device
        self.warmup_runs = warmup_runs
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None
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
    def capture(self, shape: int, fn: CapturedFn) -> torch.Tensor:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for _ in range(self.warmup_runs):
                fn()  # not capturing: graph_break is not called, ops run inline
            cap = _Capture()
            self._active = cap
            try:
                cap.current = self._begin_segment()
                out = fn()
                cap.current.capture_end()
                cap.segments.append(cap.current)
            finally:
                self._active = None
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self._captures[shape] = cap
        self._outputs[shape] = out
        return out

    def _begin_segment(self) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool)
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
        self._pool = None


class BatchScope:
    """The real batch's attention metadata and token count, bound for one replay.

    One owner (the runner); binding refuses nesting and always clears.
    """

    def __init__(self) -> None:
        self.meta: AttentionMetadata | None = None
        self.num_tokens = 0

    @contextmanager
    def bind(self, meta: AttentionMetadata, num_tokens: int) -> Iterator[None]:
        if self.meta is not None:
            raise RuntimeError("nested BatchScope.bind: one replay at a time")
        self.meta, self.num_tokens = meta, num_tokens
        try:
            yield
        finally:
            self.meta, self.num_tokens = None, 0


@dataclass
class AttentionIO:
    """Static attention inputs and output ``(max_tokens, heads, head_dim)``, shared by every
    layer and every shape of a runner.

    The segment before layer ``i``'s attention copies q/k/v in; the eager op reads them and
    writes ``out``; the segment after consumes ``out`` before layer ``i + 1`` writes any of
    them again, so one set is enough. Copying q/k/v into static buffers (instead of keeping
    the segment's own tensors alive) lets the pool reuse those activations across layers,
    as a single graph would.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    _rows: tuple[int, tuple[torch.Tensor, ...]] = field(default=(-1, ()), init=False,
                                                        repr=False)

    def rows(self, n: int) -> tuple[torch.Tensor, ...]:
        """Views ``(q, k, v, out)[:n]``, made once per token count: every layer of a
        replay asks for the same ``n``, and slicing costs host time at each call."""
        if self._rows[0] != n:
            self._rows = (n, (self.q[:n], self.k[:n], self.v[:n], self.out[:n]))
        return self._rows[1]

    @staticmethod
    def allocate(max_tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> AttentionIO:
        def buf(h: int) -> torch.Tensor:
            return torch.zeros(max_tokens, h, head_dim, dtype=dtype, device=device)

        return AttentionIO(buf(heads), buf(kv_heads), buf(kv_heads), buf(heads))


class BreakingAttention(AttentionBackend):
    """Attention marked graph-hostile: under capture it breaks the graph and runs eagerly."""

    name = "breaking"

    def __init__(self, inner: AttentionBackend, graphs: BreakableGraphBackend, scope: BatchScope,
                 io: AttentionIO) -> None:
        super().__init__(inner.shape, inner.pool, inner.table)
        self.inner, self.graphs, self.scope, self.io = inner, graphs, scope, io

    def build_metadata(self, batch: Any) -> AttentionMetadata:
        return self.inner.build_metadata(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        """``meta`` is ignored: the batch bound to the scope (dummy while capturing, the
        real one while replaying) is what attention reads."""
        t = q.shape[0]
        io = self.io
        io.q[:t].copy_(q)
        io.k[:t].copy_(k)
        io.v[:t].copy_(v)

        def run() -> None:
            # Real tokens only: padded rows neither store K/V nor attend.
            bound = self.scope.meta
            assert bound is not None, "breakable attention without a bound batch"
            qs, ks, vs, out = io.rows(self.scope.num_tokens)
            self.inner.forward_into(qs, ks, vs, out, layer_id, bound)

        if self.graphs.capturing:
            self.graphs.graph_break(run)
        else:
            run()
        return io.out[:t]
