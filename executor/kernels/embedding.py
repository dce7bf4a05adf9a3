# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""The token embedding's lookup in one launch, whole or a tensor-parallel rank's share.

Under tensor parallelism each rank holds rows ``[start, start + rows)`` of the embedding
and looks up only the ids that fall there, zeros for the others, before the ranks sum
(``executor.model.vocab_parallel.VocabParallelEmbedding``). In torch ops that is eight
element-wise kernels at batch 1 (shift, two compares, and, clamp, gather, cast, multiply);
here it is one, launched with PDL. Rows are copied bit for bit; an id outside the shard
gives +0.0 where the torch ops give a signed zero, which sums the same.

The whole table (``token_embedding``, one GPU) is the same kernel at ``start`` 0, in place
of ATen's gather: one PDL launch, a program per token and 1,024 columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor.kernels.fast_launch import FastLauncher
from executor.kernels.pdl import pdl_enter

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
):
    pdl_enter(USE_PDL)  # the ids come from the step's prologue
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


def _launch(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    assert ids.dim() == 1 and weight.dim() == 2 and weight.is_contiguous()
    rows, hidden = weight.shape
    out = weight.new_empty((ids.shape[0], hidden))
    if ids.shape[0]:
        # (the key: what the JIT specializes on besides pointer alignment, the integers)
        _LAUNCHER.launch((ids.shape[0], triton.cdiv(hidden, BLOCK), 1),
                         (weight.dtype, start, rows, hidden),
                         (ids.contiguous(), weight, out, start, rows, hidden),
                         {"BLOCK": BLOCK})
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
    against the vocabulary; one past it would read zeros). Outside a Dynamo trace only: a
    compiled forward keeps ``nn.Embedding``."""
    return _launch(ids, weight, 0)
