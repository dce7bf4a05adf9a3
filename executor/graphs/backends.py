"""Capture backends: how a callable is captured for one static shape and replayed.

``CaptureBackend`` states the contract; ``FullGraphBackend`` captures one whole CUDA
graph per shape, ``FixedGridGraphBackend`` the same with attention on a grid fixed by the
bucket. All graphs of one backend share one memory pool, and callers capture the largest
shape first, so smaller shapes fit inside the blocks the pool already holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from executor.attention.base import AttentionBackend, AttentionMetadata

CapturedFn = Callable[[], torch.Tensor]
# forward(input_ids (T,), positions (T,), meta) -> logits or hidden states (T, ...)
ForwardFn = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


def weak_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep that memory allocated.

    Graph code holds these to read or write, at every replay, a tensor that lived only
    during capture: its pool block is free for later captures once the capturing code
    drops its own references, and replay, running in capture order, reaches the block
    before anything captured later reuses it."""
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device,
                                                          storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        alias, t.storage_offset(), t.size(), t.stride())


class CaptureStream:
    """The side stream a backend warms up and captures on, and the memory pool its graphs
    share; both made at first use, the pool dropped by ``reset``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: Any = None
        self._stream: torch.cuda.Stream | None = None

    @contextmanager
    def active(self) -> Iterator[torch.cuda.Stream]:
        """Make the side stream current (ordered after, then before, the current one)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        try:
            with torch.cuda.stream(self._stream):
                yield self._stream
        finally:
            current.wait_stream(self._stream)

    def warm_up(self, fn: CapturedFn, runs: int) -> None:
        with self.active():
            for _ in range(runs):
                fn()

    def reset(self) -> None:
        self.pool = None


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


class CaptureBackend(Protocol):
    """A backend knows nothing about models, phases or batches. The contract:

    * ``warm_up(shape, fn)`` runs ``fn`` uncaptured where capture will run it, as often as the
      backend needs: compilation, lazily loaded kernels, library workspaces and first
      allocations happen there, so the memory a capture then takes is the graph's own.
    * ``capture(shape, fn)`` runs ``fn`` under capture (after ``warm_up``) and returns its
      static output tensor; ``fn`` must read its inputs from static buffers the caller
      refreshes before replay.
    * ``replay(shape)`` re-runs the captured work and returns the same static output tensor.
      NOTE: the output's memory is reused by the next replay of *any* shape of this backend
      (they share one pool), so the caller must copy or consume it before replaying again.
    * ``has(shape)``; ``release()`` drops every graph and the pool.

    All graphs of one backend share one memory pool. Callers capture the largest shape first:
    its intermediate buffers are the biggest, and smaller shapes then fit inside the blocks the
    pool already holds instead of growing it.
    """

    name: str
    #: True when attention is captured inside the graphs (it needs static metadata);
    #: False when it runs eagerly between graph pieces.
    attention_in_graph: bool
    #: True when the callable captured is the runner's own forward (whole, or broken
    #: into segments at attention), so it can end by writing into a runner-owned output
    #: buffer every bucket shares; False when the forward is compiled into pieces that
    #: return their own output.
    captures_runner_forward: bool
    #: True when the prepared forward (``prepare_forward``) also serves, compiled without
    #: graphs, a shape no graph was captured for, and beats the plain eager model there (compiled
    #: pieces); False when it is only meant for the captured shapes.
    serves_compiled_shapes: bool

    def wrap_attention(self, attn: AttentionBackend, scope: BatchScope, max_tokens: int
                       ) -> AttentionBackend:
        """The attention backend the model should call under this capture backend."""
        ...

    def prepare_forward(self, forward: ForwardFn) -> ForwardFn:
        """Return the callable that captures and replays will run (a backend that compiles
        returns the compiled one); called once per runner."""
        ...

    def warm_up(self, shape: int, fn: CapturedFn) -> None: ...

    def capture(self, shape: int, fn: CapturedFn) -> torch.Tensor: ...

    def replay(self, shape: int) -> torch.Tensor: ...

    def has(self, shape: int) -> bool: ...

    def captured(self) -> tuple[int, ...]: ...

    def release(self) -> None: ...


class FullGraphBackend:
    """One ``torch.cuda.CUDAGraph`` per shape (decode: the whole forward plus logits)."""

    name = "full"
    attention_in_graph = True
    captures_runner_forward = True
    serves_compiled_shapes = False

    def wrap_attention(self, attn: AttentionBackend, scope: BatchScope, max_tokens: int
                       ) -> AttentionBackend:
        return attn  # captured inside the graph through its static-metadata hooks

    def prepare_forward(self, forward: ForwardFn) -> ForwardFn:
        return forward

    def __init__(self, device: torch.device, warmup_runs: int = 2) -> None:
        self.device = device
        self.warmup_runs = warmup_runs
        self.streams = CaptureStream(device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def sibling(self) -> FullGraphBackend:
        """Another set of graphs over the same shapes, captured on this backend's stream
        into its pool (a variant of a bucket's forward: ``GraphRunner``'s context tiers).
        Its graphs replay one at a time with this one's, as all of a pool's must; release
        both together (either's ``release`` drops the shared pool)."""
        twin = FullGraphBackend(self.device, self.warmup_runs)
        twin.streams = self.streams
        return twin

    def warm_up(self, shape: int, fn: CapturedFn) -> None:
        self.streams.warm_up(fn, self.warmup_runs)

    def capture(self, shape: int, fn: CapturedFn) -> torch.Tensor:
        graph = torch.cuda.CUDAGraph()
        with self.streams.active() as stream, \
                torch.cuda.graph(graph, pool=self.streams.pool, stream=stream):
            out = fn()
        self._graphs[shape] = graph
        self._outputs[shape] = out
        return out

    def replay(self, shape: int) -> torch.Tensor:
        self._graphs[shape].replay()
        return self._outputs[shape]

    def has(self, shape: int) -> bool:
        return shape in self._graphs

    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def release(self) -> None:
        self._graphs.clear()
        self._outputs.clear()
        self.streams.reset()


class FixedGridGraphBackend(FullGraphBackend):
    """Prefill graph mode ``fixed_grid``: the whole prefill forward of a token bucket as
    one graph, attention included, launched with a grid fixed by the bucket's token count
    and reading the batch's sequences from static buffers (an attention backend that can
    capture prefill: triton's ``extend_attention_fixed_grid``). No eager launch between
    layers, unlike ``breakable``; prefill batches longer than the largest bucket run
    eagerly."""

    name = "fixed_grid"
