# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""Neox-style (rotate-half) RoPE on q and k in one launch, optionally after a per-head
RMSNorm of each (Qwen3's ``q_norm`` / ``k_norm``).

Programs run over (token, block of heads), q's blocks then k's: a prefill's many tokens
keep all of a kind's heads in one block, a decode step's few split them so that enough
programs run. A head's arithmetic is the same in any block (its norm's sum of squares is
exact, in float64), so the split never changes a bit. q and k may be strided views of the
fused QKV output; the results are new contiguous tensors.

Numerics follow Hugging Face's ``q * cos + rotate_half(q) * sin`` in the activation dtype
exactly: cos and sin are read from the float32 tables and rounded to the activation
dtype, and each product and the sum are rounded to it, as the torch ops do. The optional
per-head norm has RMSNorm's semantics (float32, rounded before the weight multiply), or
with ``offset_norm`` Gemma's (times ``1 + weight`` in float32, rounded once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor.kernels import pdl
from executor.kernels.pdl import pdl_launch_then_wait

# Launch options. No FMA contraction: each product must be rounded to the activation dtype
# before the add, as the torch ops do (with contraction on, some outputs differ from
# torch by an ulp; with it off they are bit-identical). A memory-bound kernel loses
# nothing by it.
LAUNCH_OPTIONS: dict[str, bool] = {"enable_fp_fusion": False}


@triton.jit
def _norm_rope_heads(
    x_ptr, out_ptr, w_ptr,
    t, h0, num_heads,
    stride_xt, stride_xh, stride_ot, stride_oh,
    c, s,  # (1, BLOCK_HALF) float32, already rounded to the activation dtype
    eps,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    OFFSET_NORM: tl.constexpr = False,
):
    act_ty = out_ptr.dtype.element_ty
    offs_h = h0 + tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (offs_h < num_heads) & (offs_d < HALF)
    src = x_ptr + t * stride_xt + offs_h * stride_xh + offs_d
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_H, BLOCK_HALF)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        # The sum of squares in float64, where it is exact for any usual head (a square
        # of a 16-bit float has at most 22 significant bits): the order of the sum, which
        # the head block's layout sets, then changes nothing, so any split of the heads
        # over programs gives the same bits.
        x1d, x2d = x1.to(tl.float64), x2.to(tl.float64)
        ssq = (tl.sum(x1d * x1d, axis=1) + tl.sum(x2d * x2d, axis=1)).to(tl.float32)
        var = ssq / (2 * HALF)
        rstd = tl.math.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
        if OFFSET_NORM:  # Gemma: normalize(x) * (1 + w) in float32, one rounding
            x1 = (x1 * rstd * (1.0 + w1)).to(act_ty).to(tl.float32)
            x2 = (x2 * rstd * (1.0 + w2)).to(act_ty).to(tl.float32)
        else:
            x1 = ((x1 * rstd).to(act_ty).to(tl.float32) * w1).to(act_ty).to(tl.float32)
            x2 = ((x2 * rstd).to(act_ty).to(tl.float32) * w2).to(act_ty).to(tl.float32)
    # x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1); the casts between the
    # ops round like the torch ops do (and keep the compiler from contracting into FMAs).
    o1 = (x1 * c).to(act_ty).to(tl.float32) - (x2 * s).to(act_ty).to(tl.float32)
    o2 = (x2 * c).to(act_ty).to(tl.float32) + (x1 * s).to(act_ty).to(tl.float32)
    dst = out_ptr + t * stride_ot + offs_h * stride_oh + offs_d
    tl.store(dst, o1.to(act_ty), mask=mask)
    tl.store(dst + HALF, o2.to(act_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr,  # (T, heads, head_dim), (T, kv_heads, head_dim): unit dim stride
    q_out_ptr, k_out_ptr,  # contiguous, same shapes
    pos_ptr,  # (T,) integer positions
    cos_ptr, sin_ptr,  # (max_positions, head_dim) float32; the two halves are equal
    qw_ptr, kw_ptr,  # (head_dim,) per-head norm weights (read only if HAS_NORM)
    num_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_cos,
    eps,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
    OFFSET_NORM: tl.constexpr = False,
):
    # The attention after it may launch now: what it loads before its own wait (the step's
    # metadata; at decode also its first block of cached K/V), none of it written by the
    # qkv projection before this kernel, loads while that GEMM finishes.
    pdl_launch_then_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)  # q's head blocks first, then k's
    q_blocks = tl.cdiv(num_heads, BLOCK_HQ)
    act_ty = q_out_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    dmask = offs_d < HALF
    c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=dmask, other=0.0)
    s = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=dmask, other=0.0)
    c = c.to(act_ty).to(tl.float32)
    s = s.to(act_ty).to(tl.float32)
    if hb < q_blocks:
        _norm_rope_heads(q_ptr, q_out_ptr, qw_ptr, t, hb * BLOCK_HQ, num_heads, stride_qt,
                         stride_qh, num_heads * 2 * HALF, 2 * HALF, c, s, eps,
                         HALF, HAS_NORM, BLOCK_HQ, BLOCK_HALF, OFFSET_NORM)
    else:
        _norm_rope_heads(k_ptr, k_out_ptr, kw_ptr, t, (hb - q_blocks) * BLOCK_HK, num_kv_heads,
                         stride_kt, stride_kh, num_kv_heads * 2 * HALF, 2 * HALF, c, s, eps,
                         HALF, HAS_NORM, BLOCK_HK, BLOCK_HALF, OFFSET_NORM)


#: Programs a launch aims for: below it (few tokens) the heads split into narrower blocks.
MIN_PROGRAMS = 128


def heads_per_program(num_tokens: int, num_heads: int, num_kv_heads: int) -> int:
    """The widest power-of-two head block (at most the most heads of q or k) that still
    gives ``MIN_PROGRAMS`` programs, down to one head: a decode step's one token is
    ``heads + kv_heads`` programs, a prefill's tokens keep all of a kind's heads in one."""
    block = triton.next_power_of_2(max(num_heads, num_kv_heads))
    while block > 1 and num_tokens * (triton.cdiv(num_heads, block)
                                      + triton.cdiv(num_kv_heads, block)) < MIN_PROGRAMS:
        block //= 2
    return block


def _launch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
            eps: float, offset_norm: bool = False, head_block: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch; ``head_block`` overrides ``heads_per_program`` (tests)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and k.dtype == q.dtype
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "head_dim must be contiguous"
    assert head_dim % 2 == 0, "rotate-half RoPE needs an even head_dim"
    assert positions.shape == (num_tokens,), (positions.shape, num_tokens)
    assert cos.shape == sin.shape and cos.stride() == sin.stride() and cos.shape[1] == head_dim
    assert cos.dtype == sin.dtype == torch.float32 and cos.stride(-1) == 1
    has_norm = q_weight is not None
    assert has_norm == (k_weight is not None), "q and k norms come together"
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    block = head_block or heads_per_program(num_tokens, num_heads, num_kv_heads)
    block_hq = min(triton.next_power_of_2(num_heads), block)
    block_hk = min(triton.next_power_of_2(num_kv_heads), block)
    block_half = triton.next_power_of_2(half)
    elems = block_hq * block_half * 2
    head_blocks = triton.cdiv(num_heads, block_hq) + triton.cdiv(num_kv_heads, block_hk)
    _rope_kernel[(num_tokens, head_blocks)](
        q, k, q_out, k_out, positions, cos, sin,
        q_weight if q_weight is not None else cos,  # dummies, never read without norms
        k_weight if k_weight is not None else cos,
        num_heads, num_kv_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0),
        eps,
        HALF=half,
        HAS_NORM=has_norm,
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        BLOCK_HALF=block_half,
        OFFSET_NORM=offset_norm and has_norm,
        num_warps=min(max(elems // 512, 1), 8),
        **LAUNCH_OPTIONS,
        **pdl.options(),
    )
    return q_out, k_out


@torch.library.custom_op("model_executor::rope_qk", mutates_args=())
def _rope_op(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
             eps: float, offset_norm: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(q, k, positions, cos, sin, q_weight, k_weight, eps, offset_norm)


@_rope_op.register_fake
def _rope_fake(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
               eps: float, offset_norm: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)


def rope_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, q_weight: torch.Tensor | None = None,
            k_weight: torch.Tensor | None = None, eps: float = 0.0, offset_norm: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated ``(q, k)`` as new contiguous tensors ``(T, heads, head_dim)`` and
    ``(T, kv_heads, head_dim)``; with ``q_weight``/``k_weight``, each head is RMS-normed
    (``eps``) first (``offset_norm``: Gemma's ``1 + weight`` norm). ``positions`` must
    index rows of ``cos``/``sin`` (not checked)."""
    if torch.compiler.is_compiling():
        q_out, k_out = torch.ops.model_executor.rope_qk(q, k, positions, cos, sin, q_weight,
                                                       k_weight, eps, offset_norm)
        return q_out, k_out
    return _launch(q, k, positions, cos, sin, q_weight, k_weight, eps, offset_norm)
