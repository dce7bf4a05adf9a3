"""``PiecewiseCompileBackend`` (graph mode ``tc_piecewise``): torch.compile split at
attention, one CUDA graph per compiled piece per shape, attention eager between them.

The class docstring walks how a forward becomes graphs.
"""

from __future__ import annotations

import itertools
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule

from executor.attention.base import AttentionBackend
from executor.graphs.backends import BatchScope, CapturedFn, CaptureStream, ForwardFn
from executor.graphs.piecewise.cache import CompileCache, compile_key
from executor.graphs.piecewise.compile import (
    COMPILERS,
    CompilerName,
    CompileStats,
    compile_pieces,
)
from executor.graphs.piecewise.custom_op import ATTENTION_BINDING, OpAttention, direct_call
from executor.graphs.piecewise.pieces import GraphedPiece, GraphMode
from executor.graphs.piecewise.split import SplitGraph, readable, split_at_attention


@dataclass
class _DirectCall:
    """A captured call of the split graph: its module and arguments (parameters, static
    buffers, ints: all outlive the capture), and its output while being checked."""

    module: GraphModule
    args: tuple[Any, ...]
    output: Any = None

    def returns(self, out: torch.Tensor) -> bool:
        """Whether the compiled forward returned exactly the graph's single output."""
        return (isinstance(self.output, (tuple, list)) and len(self.output) == 1
                and self.output[0] is out)

    def without_output(self) -> _DirectCall:
        return _DirectCall(self.module, self.args)  # no reference to capture-time outputs


_code_ids = itertools.count()


def _own_code(forward: ForwardFn) -> ForwardFn:
    """``forward`` behind a trampoline with a code object of its own.

    Dynamo keeps compiled entries (and counts recompiles against its limit) per code
    object; a runner's forward is a method shared by every runner, so without this every
    backend in a process (tests create many) would pile entries onto one code object.
    """

    def trampoline(ids: torch.Tensor, pos: torch.Tensor, meta: Any) -> torch.Tensor:
        return forward(ids, pos, meta)

    code = trampoline.__code__.replace(co_name=f"tc_piecewise_forward_{next(_code_ids)}")
    fn = types.FunctionType(code, trampoline.__globals__, code.co_name, None,
                            trampoline.__closure__)
    return fn  # type: ignore[no-any-return]


def _fx_cache_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


class PiecewiseCompileBackend:
    """How a forward becomes graphs:

    1. ``wrap_attention`` gives the model ``OpAttention``: attention is the opaque custom op
       ``model_executor::attention``, reading the batch the runner binds to its ``BatchScope``.
    2. ``prepare_forward`` returns the forward compiled by ``torch.compile(fullgraph=True)``
       with this backend's Dynamo backend: the FX graph is split at every attention op
       (``split.py``), the pieces between are compiled (``eager`` or ``inductor``,
       ``compile.py``) and installed as ``GraphedPiece`` modules (``pieces.py``); attention
       submodules call the op's impl directly (``custom_op.direct_call``). The token
       dimension is marked dynamic, so one compilation serves every bucket.
    3. ``warm_up(shape, fn)`` runs ``fn`` (compiling at the first call), then
       ``capture(shape, fn)`` runs it once in capture mode: each piece
       captures one ``torch.cuda.CUDAGraph`` for ``shape`` (one pool for all pieces and shapes)
       while attention runs eagerly between them. ``replay(shape)`` runs the same split graph
       in replay mode (skipping Dynamo's guards, see ``replay``): pieces replay their graphs,
       attention runs eagerly on the real batch.

    The compiled forward called outside ``capture``/``replay`` runs the compiled pieces
    without graphs, for any shape: on CPU (no graphs at all) and for the runner's eager
    fallback on shapes never captured. Call it as ``forward(ids, positions, SCOPED)`` with the
    batch bound to the scope, like capture and replay.
    """

    name = "tc_piecewise"
    #: Attention runs eagerly between piece graphs; it needs no static metadata.
    attention_in_graph = False
    #: The compiled forward returns its last piece's output: no shared output buffer.
    captures_runner_forward = False
    #: The compiled pieces run a shape no graph was captured for, faster than eager.
    serves_compiled_shapes = True

    def __init__(self, device: torch.device, compiler: CompilerName = "eager",
                 cache_dir: Path | None = None, cache_key: str = "",
                 debug_dir: Path | None = None, warmup_runs: int = 1) -> None:
        if compiler not in COMPILERS:
            raise ValueError(f"unknown tc_piecewise compiler {compiler!r}; valid: "
                             f"{', '.join(COMPILERS)}")
        self.device, self.compiler, self.warmup_runs = device, compiler, warmup_runs
        self.debug_dir = debug_dir
        key = compile_key(cache_key, compiler, device)
        # Only Inductor output is worth caching (eager pieces are the traced graphs).
        self.cache = CompileCache(cache_dir if compiler == "inductor" else None, key)
        self.stats = CompileStats(compiler, key, None if self.cache.dir is None
                                  else str(self.cache.dir))
        self.mode = GraphMode()
        self.attn: OpAttention | None = None
        self.pieces: list[GraphedPiece] = []  # of every compilation, in call order
        self.split: SplitGraph | None = None  # the last compilation's split graph
        self._fns: dict[int, CapturedFn] = {}
        self.streams = CaptureStream(device)
        self._compiled_in_call = False
        self._traced_inference: bool | None = None  # kind of the first forward's inputs
        # Per captured shape: the split graph and the exact arguments Dynamo called it with
        # during capture (see ``replay``); shapes whose output mapping is not 1:1 are absent.
        self._direct: dict[int, _DirectCall] = {}
        self._recording: _DirectCall | None = None

    # -- capture backend contract: model side ----------------------------------------------
    def wrap_attention(self, attn: AttentionBackend, scope: BatchScope, max_tokens: int
                       ) -> AttentionBackend:
        """The attention the model calls under this backend: the opaque custom op."""
        if self.attn is not None:
            raise RuntimeError("a tc_piecewise backend serves one runner (one attention)")
        self.attn = OpAttention(attn, scope, max_tokens)
        return self.attn

    def prepare_forward(self, forward: ForwardFn) -> ForwardFn:
        """The compiled ``forward`` (see module doc); compiles on its first call."""
        if self.attn is None:
            raise RuntimeError("wrap_attention must come before prepare_forward")
        attn = self.attn
        compiled = torch.compile(_own_code(forward), backend=self._compile_graph,
                                 fullgraph=True)  # type: ignore[arg-type]
        if self.cache.enabled:
            self.stats.artifacts_loaded = self.cache.load()

        def compiled_forward(ids: torch.Tensor, pos: torch.Tensor, meta: Any) -> torch.Tensor:
            ids, pos = self._like_traced(ids), self._like_traced(pos)
            if ids.shape[0] >= 2:  # a size-1 dim cannot be dynamic: it specializes once
                torch._dynamo.mark_dynamic(ids, 0)
                torch._dynamo.mark_dynamic(pos, 0)
            if self.mode.kind == "replay":  # hot path: nothing compiles here
                with ATTENTION_BINDING.bind(attn):
                    out: torch.Tensor = compiled(ids, pos, meta)
                return out
            start = time.perf_counter()
            self._compiled_in_call = False
            with self.cache.inductor_dir(), ATTENTION_BINDING.bind(attn):
                out = compiled(ids, pos, meta)
            if self._compiled_in_call:
                if self.stats.compilations == 1:
                    self.stats.first_call_s = time.perf_counter() - start
                if self.cache.enabled and (self.stats.fx_cache_misses > 0
                                           or not self.stats.artifacts_loaded):
                    self.stats.artifacts_saved = self.cache.save()
            return out

        return compiled_forward

    def _like_traced(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the kind of tensor the graph was traced with, so Dynamo's guards pass.

        The runner's static buffers are ordinary tensors at storage offset 0; a batch's own
        tensors (the eager fallback) are views into one packed transfer and, made under
        ``inference_mode``, inference tensors. Either difference fails a guard and would
        recompile, so such inputs are copied (fallback path only: the static buffers of
        capture and replay always match).
        """
        if self._traced_inference is None:
            self._traced_inference = x.is_inference()
        if x.storage_offset() == 0 and x.is_inference() == self._traced_inference:
            return x
        with torch.inference_mode(self._traced_inference):
            return x.clone()

    # -- the Dynamo backend -----------------------------------------------------------------
    def _compile_graph(self, gm: GraphModule, example_inputs: list[Any]
                       ) -> Callable[..., Any]:
        start = time.perf_counter()
        hits0, misses0 = _fx_cache_counts()
        split = split_at_attention(gm)
        if self.debug_dir is not None:
            self._dump(gm, split)
        compiled = compile_pieces(split, example_inputs, self.compiler)
        # The split graph's code calls ``self.submod_k(...)``. Each callable goes into the
        # module's instance dict, which attribute lookup finds before ``_modules``: the
        # call skips nn.Module.__call__. ``_modules`` keeps the modules for inspection.
        for sub in split.pieces:
            piece = GraphedPiece(sub.index, compiled[sub.name], self.mode)
            split.module._modules[sub.name] = piece
            split.module.__dict__[sub.name] = piece.forward
            self.pieces.append(piece)
        for sub in split.attention:
            gm_attn = split.submodule(sub.name)
            direct = direct_call(gm_attn) if isinstance(gm_attn, GraphModule) else None
            if direct is not None:
                split.module.__dict__[sub.name] = direct
        hits1, misses1 = _fx_cache_counts()
        self.split = split
        s = self.stats
        s.compilations += 1
        s.attention_ops, s.pieces = len(split.attention), len(split.pieces)
        s.compile_s += time.perf_counter() - start
        s.fx_cache_hits += hits1 - hits0
        s.fx_cache_misses += misses1 - misses0
        self._compiled_in_call = True
        module = split.module

        def entry(*args: Any) -> Any:
            out = module(*args)
            if self.mode.kind == "capture":
                self._recording = _DirectCall(module, args, out)
            return out

        return entry  # type: ignore[return-value]

    def _dump(self, gm: GraphModule, split: SplitGraph) -> None:
        """Readable Python of the Dynamo graph, the split graph and every submodule."""
        assert self.debug_dir is not None
        out = self.debug_dir / f"compile_{self.stats.compilations + 1}"
        out.mkdir(parents=True, exist_ok=True)
        (out / "dynamo_graph.py").write_text(readable(gm))
        (out / "split_graph.py").write_text(readable(split.module))
        for order, sub in enumerate(split.submodules):
            text = readable(split.submodule(sub.name))
            (out / f"{order:03d}_{sub.kind}_{sub.index}.py").write_text(text)

    # -- capture backend contract: graphs -----------------------------------------------------
    def warm_up(self, shape: int, fn: CapturedFn) -> None:
        """Run mode on the capture stream: the first call compiles; Triton autotuning,
        cuBLAS workspaces and first allocations happen here, not inside a graph."""
        self._require_cuda()
        self.streams.warm_up(fn, self.warmup_runs)

    def capture(self, shape: int, fn: CapturedFn) -> torch.Tensor:
        self._require_cuda()
        with self.streams.active():
            self.mode.pool = self.streams.pool
            self._recording = None
            try:
                with self.mode.active("capture", shape):
                    out = fn()
                if not any(shape in p.graphs for p in self.pieces):
                    raise RuntimeError("no compiled piece ran during capture")
            except BaseException:
                for p in self.pieces:
                    p.drop(shape)
                raise
            finally:
                call, self._recording = self._recording, None
        self._fns[shape] = fn
        if call is not None and call.returns(out):
            self._direct[shape] = call.without_output()
        return out

    def _require_cuda(self) -> None:
        if self.device.type != "cuda":
            raise RuntimeError(f"tc_piecewise captures CUDA graphs; on {self.device.type} "
                               "call the compiled forward directly")

    def replay(self, shape: int) -> torch.Tensor:
        """Replay ``shape``: pieces replay their graphs, attention runs eagerly between.

        Fast path: call the split graph directly with the arguments Dynamo passed it
        during capture (parameters, the runner's static id/position views, the token
        count), skipping Dynamo's guard evaluation (about as costly as a small piece).
        That is the same call the guards approved at capture: by contract a replay runs
        the captured ``fn`` on the same static buffers. Otherwise ``fn`` runs again.
        """
        direct = self._direct.get(shape)
        with self.mode.active("replay", shape):
            if direct is None:
                return self._fns[shape]()
            assert self.attn is not None
            with ATTENTION_BINDING.bind(self.attn):
                out: torch.Tensor = direct.module(*direct.args)[0]
            return out

    def has(self, shape: int) -> bool:
        return shape in self._fns

    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._fns))

    def direct_replays(self) -> tuple[int, ...]:
        """Captured shapes whose replay skips Dynamo (see ``replay``)."""
        return tuple(sorted(self._direct))

    def release(self) -> None:
        """Drop every graph and the pool; the compiled pieces stay (recapture is cheap)."""
        for p in self.pieces:
            p.drop()
        self._fns.clear()
        self._direct.clear()
        self.mode.pool = None
        self.streams.reset()
