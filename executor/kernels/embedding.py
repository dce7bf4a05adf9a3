# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""The token embedding's lookup in one launch, whole or a tensor-parallel rank's share.

Under tensor parallelism each rank holds rows ``[start, start + rows)`` of the embedding
and looks up only the ids that fall there, zeros for the others, before the ranks sum
(``executor.model.vocab_parallel.VocabParallelEmbedding``). In torch ops that is eight
element-wise kernels at batch 1 (shift, two compares, and, clamp, gather, cast, multiply);
here it is one, launched with PDL. Rows are copied bit for bit; an id outside the shard
gives +0.0 where the torch ops give a signed zero, which sums the same.

The whole table (``token_embedding``, one GPU) is the same kernel at ``start`` 0. It is the
first kernel of a forward, and it lets its successor launch before its own wait: the first
layer's projection, whose pre-wait part reads weights only, loads its first weight blocks
while the lookup runs (ATen's gather is no PDL kernel: that projection began only after it
had ended).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor.kernels.fast_launch import FastLauncher
from executor.kernels.pdl import pdl_enter, pdl_launch_then_wait

#: Columns per program.
BLOCK = 1024


@triton.jit
def _shard_embedding_kernel(
    ids_ptr,  # (T,) int64 token ids over the whole vocabulary
    weight_ptr,  # (rows, hidden) this rank's rows, contiguous
    out_ptr,  # (T, hidden) written
    start,  # the first id of this rank's rows
    rows,
    hidden,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_FIRST: tl.constexpr = False,  # let the successor launch before the wait
):
    # the ids come from the step's prologue
    if LAUNCH_FIRST:
        pdl_launch_then_wait(USE_PDL)
    else:
        pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    local = tl.load(ids_ptr + t) - start
    inside = (local >= 0) & (local < rows)
    row = tl.where(inside, local, 0).to(tl.int64)
    keep = mask & (offs * 0 + inside.to(tl.int32) > 0)  # (a vector mask: the interpreter)
    values = tl.load(weight_ptr + row * hidden + offs, mask=keep, other=0.0)
    tl.store(out_ptr + t * hidden + offs, values, mask=mask)


_LAUNCHER = FastLauncher(_shard_embedding_kernel, pdl=True, num_warps=4)


def _launch(ids: torch.Tensor, weight: torch.Tensor, start: int, first: bool = False
            ) -> torch.Tensor:
    assert ids.dim() == 1 and weight.dim() == 2 and weight.is_contiguous()
    rows, hidden = weight.shape
    out = weight.new_empty((ids.shape[0], hidden))
    if ids.shape[0]:
        # (the key: what the JIT specializes on besides pointer alignment, the integers)
        _LAUNCHER.launch((ids.shape[0], triton.cdiv(hidden, BLOCK), 1),
                         (weight.dtype, first, start, rows, hidden),
                         (ids.contiguous(), weight, out, start, rows, hidden),
                         {"BLOCK": BLOCK, "LAUNCH_FIRST": first})
    return out


@torch.library.custom_op("model_executor::shard_embedding", mutates_args=())
def _shard_embedding_op(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    return _launch(ids, weight, start)


@_shard_embedding_op.register_fake
def _shard_embedding_fake(ids: torch.Tensor, weight: torch.Tensor, start: int
                          ) -> torch.Tensor:
    return weight.new_empty((ids.shape[0], weight.shape[1]))


def shard_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """``(T, hidden)``: row ``ids[t] - start`` of ``weight`` where that is one of its rows,
    else zeros."""
    if torch.compiler.is_compiling():
        return torch.ops.model_executor.shard_embedding(ids, weight, start)  # type: ignore[no-any-return]
    return _launch(ids, weight, start)


def token_embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``(T, hidden)``: row ``ids[t]`` of the whole table ``weight`` (ids already checked
    against the vocabulary; one past it would read zeros), its successor launched early
    (the module's docstring). Outside a Dynamo trace only: a compiled forward keeps
    ``nn.Embedding``."""
    return _launch(ids, weight, 0, first=True)
