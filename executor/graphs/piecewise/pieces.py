"""One CUDA graph per compiled piece per shape, and the mode that tells pieces what to do.

The split graph calls ``GraphedPiece`` modules in place of its compiled pieces. What a call
does depends on ``GraphMode``, which ``PiecewiseCompileBackend`` (its one owner) sets for
exactly one capture or replay at a time:

* ``run``: call the compiled piece (first calls compile; shapes never captured run here);
* ``capture``: capture the piece into a new ``torch.cuda.CUDAGraph`` for the mode's shape,
  in the backend's shared memory pool, and return the outputs the capture produced;
* ``replay``: copy inputs whose address moved into the captured static inputs, replay,
  and return the captured outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from executor.graphs.backends import weak_view

Mode = Literal["run", "capture", "replay"]


@dataclass
class GraphMode:
    """What ``GraphedPiece`` calls do now (see module doc). One owner: the backend."""

    kind: Mode = "run"
    shape: int = 0
    pool: Any = None
    # Storage addresses of outputs of pieces captured so far in the current capture.
    produced: set[int] = field(default_factory=set)

    @contextmanager
    def active(self, kind: Mode, shape: int) -> Iterator[None]:
        if self.kind != "run":
            raise RuntimeError(f"tc_piecewise {kind} of shape {shape} inside a {self.kind} "
                               f"of shape {self.shape}: one at a time")
        self.kind, self.shape = kind, shape
        try:
            yield
        finally:
            self.kind, self.shape = "run", 0
            self.produced.clear()


def _map_tensors(out: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (tuple, list)):
        return type(out)(_map_tensors(o, fn) for o in out)
    return out


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    num_args: int
    # Per tensor argument: (index, captured data_ptr, the tensor to copy a moved input
    # into, or None where moving is a bug: an output of an earlier piece graph).
    tensors: tuple[tuple[int, int, torch.Tensor | None], ...]
    # Per other argument (ints, SymInt values): (index, captured value).
    scalars: tuple[tuple[int, Any], ...]
    outputs: Any  # weak views of the outputs, same structure as the piece returns


class GraphedPiece(nn.Module):
    """A compiled piece in the split graph: runs, captures or replays (see ``GraphMode``).

    Static inputs. A piece's tensor inputs are parameters and the runner's static id/position
    buffers (stable), outputs of the previous piece's graph (stable: a graph writes its outputs
    to the same pool addresses every replay) and attention outputs (``OpAttention.out``,
    stable by construction). So at replay an input is copied only when its ``data_ptr``
    differs from capture; an output of an earlier piece graph that moved is a bug and raises.

    Memory. Capture keeps only non-owning references to piece outputs (``weak_view``): once
    the forward that captured them drops its own references, their pool blocks become free
    for later captures (other pieces, smaller shapes). That is safe because replay runs the
    pieces in capture order and a tensor's lifetime in replay is its lifetime in capture:
    a block is only reused after its last reader ran. It is what keeps the pool about the
    size of one forward's activations instead of one per shape.
    NOTE: outputs returned by a replay point into the shared pool: valid until the next
    replay of any shape (the ``CaptureBackend`` contract).
    """

    def __init__(self, index: int, fn: Callable[..., Any], mode: GraphMode) -> None:
        super().__init__()
        self.index, self.fn, self.mode = index, fn, mode
        self.graphs: dict[int, _Captured] = {}

    def forward(self, *args: Any) -> Any:
        kind = self.mode.kind
        if kind == "run":
            return self.fn(*args)
        if kind == "capture":
            return self._capture(self.mode.shape, args)
        return self._replay(self.mode.shape, args)

    def _capture(self, shape: int, args: tuple[Any, ...]) -> Any:
        produced = self.mode.produced
        tensors: list[tuple[int, int, torch.Tensor | None]] = []
        scalars: list[tuple[int, Any]] = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                moved_is_bug = a.untyped_storage().data_ptr() in produced
                tensors.append((i, a.data_ptr(), None if moved_is_bug else a))
            else:
                scalars.append((i, a))
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.mode.pool)
        try:
            out = self.fn(*args)
        finally:
            graph.capture_end()
        _map_tensors(out, lambda t: produced.add(t.untyped_storage().data_ptr()))
        self.graphs[shape] = _Captured(graph, len(args), tuple(tensors), tuple(scalars),
                                       _map_tensors(out, weak_view))
        return out  # owning references: capture-time lifetimes must be the real ones

    def _replay(self, shape: int, args: tuple[Any, ...]) -> Any:
        cap = self.graphs.get(shape)
        if cap is None:
            raise RuntimeError(f"piece {self.index} has no graph for shape {shape} "
                               "(recompiled after capture?)")
        if len(args) != cap.num_args:
            raise RuntimeError(f"piece {self.index}: {len(args)} arguments, captured with "
                               f"{cap.num_args} (shape {shape})")
        for i, key in cap.scalars:
            if args[i] != key:
                raise RuntimeError(f"piece {self.index}: argument {args[i]!r} != {key!r} "
                                   f"captured for shape {shape}")
        for i, ptr, static in cap.tensors:
            a = args[i]
            if a.data_ptr() != ptr:
                if static is None:
                    raise RuntimeError(f"piece {self.index}: an input produced by an earlier "
                                       f"piece graph moved (shape {shape})")
                static.copy_(a)
        cap.graph.replay()
        return cap.outputs

    def drop(self, shape: int | None = None) -> None:
        """Forget one shape's graph, or all of them."""
        if shape is None:
            self.graphs.clear()
        else:
            self.graphs.pop(shape, None)
