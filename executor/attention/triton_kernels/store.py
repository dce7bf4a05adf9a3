# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""Fused store of one layer's new K and V rows into the paged KV pool (page size 1)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor.kernels import pdl
from executor.kernels.pdl import pdl_enter


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr,  # (T, kv_heads, head_dim), any token/head strides
    k_pool_ptr, v_pool_ptr,  # (locations + 1, kv_heads, head_dim), same strides
    loc_ptr,  # (T,) int64 destination location of each token
    num_kv_heads,
    stride_k_t, stride_k_h,
    stride_v_t, stride_v_h,
    stride_pool_n, stride_pool_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    # One program per token writes every KV head of it, for K and V together.
    t = tl.program_id(0).to(tl.int64)
    loc = tl.load(loc_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + t * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
    dst = loc * stride_pool_n + offs_h[:, None] * stride_pool_h + offs_d[None, :]
    tl.store(k_pool_ptr + dst, k.to(k_pool_ptr.dtype.element_ty), mask=mask)
    tl.store(v_pool_ptr + dst, v.to(v_pool_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k_pool: torch.Tensor,  # (locations + 1, kv_heads, head_dim)
    v_pool: torch.Tensor,  # (locations + 1, kv_heads, head_dim)
    loc: torch.Tensor,  # (T,) int64
    k: torch.Tensor,  # (T, kv_heads, head_dim)
    v: torch.Tensor,  # (T, kv_heads, head_dim)
) -> None:
    """``k_pool[loc] = k`` and ``v_pool[loc] = v`` in one launch (cast to the pool dtype)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim must be contiguous"
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_pool, v_pool, loc,
        num_kv_heads,
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        k_pool.stride(0), k_pool.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 2048 else 2,
        **pdl.options(),
    )
