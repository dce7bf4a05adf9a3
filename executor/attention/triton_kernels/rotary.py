# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""Neox-style RoPE applied inside the attention kernels, as they load q and k.

The attention kernels of the Triton backend rotate q and the new k themselves when the
backend has the model's RoPE tables (``AttentionBackend.bind_rope``), so the decoder runs
no separate RoPE kernel: one launch fewer per layer. A token's position is implied by the
batch metadata (new token ``i`` of a sequence with ``prefix`` cached tokens sits at
``prefix + i``), so no positions tensor is read.

Numerics equal ``executor.kernels.rope`` (and Hugging Face's ``q * cos + rotate_half(q) *
sin`` in the activation dtype): cos/sin rounded to the activation dtype, each product
rounded, then the sum rounded. A row is rotated from two loads of it, the row itself and
its partner ``x[(d + half) % head_dim]``, so the rotation is element-wise on the tile the
kernel already has (no split into halves, no reshuffle of registers).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_partner(offs_d, HALF: tl.constexpr):
    """For each lane ``d`` of a head vector: the lane ``rotate_half`` reads, and the sign
    it takes (``-x[d + half]`` in the first half, ``x[d - half]`` in the second)."""
    first = offs_d < HALF
    partner = tl.where(first, offs_d + HALF, offs_d - HALF)
    sign = tl.where(first, -1.0, 1.0)
    return partner, sign


@triton.jit
def rope_tables(cos_ptr, sin_ptr, pos, stride_cos, offs_d, mask, act_ty):
    """cos and sin at ``pos`` (any shape, broadcast against ``offs_d`` by the caller's
    indexing), float32 values rounded to the activation dtype as the torch ops do."""
    row = pos.to(tl.int64) * stride_cos
    c = tl.load(cos_ptr + row + offs_d, mask=mask, other=0.0)
    s = tl.load(sin_ptr + row + offs_d, mask=mask, other=0.0)
    return c.to(act_ty).to(tl.float32), s.to(act_ty).to(tl.float32)


@triton.jit
def rope_apply(x, x_partner, c, s, sign):
    """``x * cos + rotate_half(x) * sin`` in ``x``'s dtype; ``x_partner`` is ``x`` loaded
    at the partner lanes (``rope_partner``), ``c``/``s`` from ``rope_tables``."""
    act_ty = x.dtype
    a = (x.to(tl.float32) * c).to(act_ty).to(tl.float32)
    b = (x_partner.to(tl.float32) * s).to(act_ty).to(tl.float32)
    return (a + b * sign).to(act_ty)
