"""Capture backends: how a callable is captured for one static shape and replayed.

A backend knows nothing about models, phases or batches. The contract:

* ``capture(shape, fn)`` runs ``fn`` under capture and returns its static output tensor;
  ``fn`` must read its inputs from static buffers the caller refreshes before replay.
* ``replay(shape)`` re-runs the captured work and returns the same static output tensor.
  NOTE: the output's memory is reused by the next replay of *any* shape of this backend
  (they share one pool), so the caller must copy or consume it before replaying again.
* ``has(shape)``; ``release()`` drops every graph and the pool.

All graphs of one backend share one memory pool. Callers capture the largest shape first:
its intermediate buffers are the biggest, and smaller shapes then fit inside the blocks the
pool already holds instead of growing it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from executor.attention.base import AttentionBackend

if TYPE_CHECKING:
    from executor.graphs.breakable import BatchScope

CapturedFn = Callable[[], torch.Tensor]
# forward(input_ids (T,), positions (T,), meta) -> logits or hidden states (T, ...)
ForwardFn = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


class CaptureBackend(Protocol):
    name: str
    #: True when attention is captured inside the graphs (it needs static metadata);
    #: False when it runs eagerly between graph pieces.
    attention_in_graph: bool
    #: True when the graphs run the runner's whole forward, so it can end by writing into
    #: a runner-owned output buffer that every bucket shares; False when the forward is
    #: compiled into pieces that return their own output.
    whole_forward_in_graph: bool

    def wrap_attention(self, attn: AttentionBackend, scope: BatchScope, max_tokens: int
                       ) -> AttentionBackend:
        """The attention backend the model should call under this capture backend."""
        ...

    def prepare_forward(self, forward: ForwardFn) -> ForwardFn:
        """Return the callable that captures and replays will run (a backend that compiles
        returns the compiled one); called once per runner."""
        ...

    def capture(self, shape: int, fn: CapturedFn) -> torch.Tensor: ...

    def replay(self, shape: int) -> torch.Tensor: ...

    def has(self, shape: int) -> bool: ...

    def captured(self) -> tuple[int, ...]: ...

    def release(self) -> None: ...


class FullGraphBackend:
    """One ``torch.cuda.CUDAGraph`` per shape (decode: the whole forward plus logits)."""

    name = "full"
    attention_in_graph = True
    whole_forward_in_graph = True

    def wrap_attention(self, attn: AttentionBackend, scope: BatchScope, max_tokens: int
                       ) -> AttentionBackend:
        return attn  # captured inside the graph through its static-metadata hooks

    def prepare_forward(self, forward: ForwardFn) -> ForwardFn:
        return forward

    def __init__(self, device: torch.device, warmup_runs: int = 2) -> None:
        self.device = device
        self.warmup_runs = warmup_runs
        self._pool: Any = None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._stream: torch.cuda.Stream | None = None

    def capture(self, shape: int, fn: CapturedFn) -> torch.Tensor:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        # Warm-up runs on the capture stream: JIT compilation, cuBLAS workspaces and the
        # allocator's first blocks happen here, not inside the graph.
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for _ in range(self.warmup_runs):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
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
        self._pool = None
