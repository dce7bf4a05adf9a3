"""Compile the pieces of a split graph with the selected compiler.

``eager`` keeps each piece's ``GraphModule`` as is (Python calling ATen ops): no compile
time, and still one CUDA graph per piece. ``inductor`` compiles each piece with
``torch._inductor.compile_fx.compile_fx`` against fake example inputs: Dynamo's example
inputs, made fake in the fake mode Dynamo hands its backend (so the token dimension is
the traced symbol), are propagated through the split graph in order, so every piece is
compiled for its own inputs' fake shapes and strides, including attention outputs
(from the op's fake impl).
Identical pieces (the middle decoder layers) hit Inductor's FX graph cache after the first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch.fx import GraphModule, Interpreter

from executor.graphs.piecewise.split import SplitGraph

CompilerName = Literal["eager", "inductor"]
COMPILERS: tuple[CompilerName, ...] = ("eager", "inductor")


@dataclass
class CompileStats:
    """What compiling cost and whether the disk cache served it (cold vs warm start)."""

    compiler: str
    cache_key: str
    cache_dir: str | None
    artifacts_loaded: bool = False  # a saved bundle was found and hot-loaded
    artifacts_saved: bool = False
    compilations: int = 0  # Dynamo graphs compiled: 1 expected (more means recompiles)
    attention_ops: int = 0
    pieces: int = 0  # compiled pieces of the last compilation
    compile_s: float = 0.0  # split + piece compilation, all compilations
    first_call_s: float = 0.0  # first forward: Dynamo trace + compile + one run
    fx_cache_hits: int = 0  # Inductor FX-graph cache, during our compilations
    fx_cache_misses: int = 0

    @property
    def cache_hit(self) -> bool:
        """Every Inductor-compiled piece came from the cache (warm start)."""
        return self.fx_cache_hits > 0 and self.fx_cache_misses == 0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cache_hit": self.cache_hit}


def compile_pieces(split: SplitGraph, example_inputs: list[Any], compiler: CompilerName
                   ) -> dict[str, Callable[..., Any]]:
    """The compiled callable of each graph piece, by submodule name."""
    graph_pieces = {s.name for s in split.pieces}
    if compiler == "eager":
        return {name: split.submodule(name) for name in graph_pieces}
    if compiler != "inductor":
        raise ValueError(f"unknown compiler {compiler!r}; valid: {', '.join(COMPILERS)}")
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import compile_fx

    compiled: dict[str, Callable[..., Any]] = {}

    class _Propagate(Interpreter):
        """Runs the split graph on fake inputs; compiles each piece with the fake
        arguments it receives (its outputs come from running it uncompiled)."""

        def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
            out = super().call_module(target, args, kwargs)
            if target in graph_pieces:
                piece = split.submodule(target)
                assert isinstance(piece, GraphModule)
                fn = compile_fx(piece, list(args))
                assert callable(fn), f"compile_fx returned {type(fn).__name__}"
                compiled[target] = fn
            return out

    # The fake mode Dynamo hands its backend (shared shape env): converting the real
    # example inputs with it gives the symbolic token dimension Dynamo traced with.
    fake_mode = detect_fake_mode()
    assert fake_mode is not None, "compile_pieces runs inside a torch.compile backend"
    fakes = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x
             for x in example_inputs]
    with fake_mode:
        _Propagate(split.module).run(*fakes)
    return compiled
