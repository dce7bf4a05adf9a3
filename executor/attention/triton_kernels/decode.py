# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""Split-KV paged decode attention: one new query token per sequence.

Grid ``(batch, kv_heads, num_splits)``: a program owns one KV head and the query heads of
its group (GQA: each cached K/V row read once per group, both matmuls on tensor cores).
``num_splits`` is fixed on the host per batch size (``num_kv_splits``) and the lengths are
read on the device, so one launch is captured once and replayed for any lengths. A
sequence's ``seq_len - 1`` cached tokens are cut into ``num_splits`` chunks (multiples of
``SPLIT_ALIGN``). The new token's K/V arrive in registers: split 0 stores them at
``out_cache_loc`` and seeds its softmax with them; with ``rope`` tables q and the new k
arrive unrotated and are rotated in the kernel. A padded graph row (``seq_len`` 1,
``out_cache_loc`` 0) reads no table entry and writes only the reserved location 0. Each
split writes its partial output and log2-sum-exp to fp32 scratch and
``_decode_reduce_kernel`` merges them (not launched with one split). Design notes:
docs/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor.attention.triton_kernels.scores import scaled_scores, score_scales
from executor.kernels import pdl
from executor.kernels.pdl import pdl_launch_then_wait

# Chunks are a multiple of this many tokens: a program does at least this much work.
SPLIT_ALIGN = 32
# Bounds the reduction's tile and the fp32 scratch.
MAX_SPLITS = 64
BLOCK_N = 64  # cached tokens per inner iteration
# Query heads of a group are padded to this many rows (tl.dot needs M >= 16).
MIN_BLOCK_H = 16
# Pipelining depth of the split kernel's block loop from this batch size on (else 2):
# a third stage pays off for large batches and costs small ones, whose splits are a
# block or two long.
DEEP_PIPELINE_FROM_BATCH = 8


def split_stages(batch: int) -> int:
    """``num_stages`` of the split kernel for a launch of ``batch`` rows."""
    return 3 if batch >= DEEP_PIPELINE_FROM_BATCH else 2


# Programs wanted per SM: enough in flight to hide the gather latency of short splits
# (more, with finer alignment, won only at long contexts; docs/kernels.md).
PROGRAMS_PER_SM = 2


def num_kv_splits(batch_size: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits per sequence for a decode launch of ``batch_size`` rows.

    Depends on the batch size (fixed per graph bucket) and a bound on the lengths, never
    on the lengths themselves: enough splits that ``batch * kv_heads * splits`` fills the
    GPU about ``PROGRAMS_PER_SM`` times over, but no more than a ``max_context``-token
    sequence has ``SPLIT_ALIGN`` chunks (the backend's context tiers pass a bound below
    the table's max context).
    """
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, batch_size * num_kv_heads)
    useful = triton.cdiv(max(max_context - 1, 1), SPLIT_ALIGN)
    return max(1, min(wanted, useful, MAX_SPLITS))


@triton.jit
def _split_size(cached, num_splits, ALIGN: tl.constexpr):
    # ceil(cached / num_splits) rounded up to a multiple of ALIGN (ALIGN when cached == 0).
    per_split = (cached + num_splits - 1) // num_splits
    return tl.maximum((per_split + ALIGN - 1) // ALIGN * ALIGN, ALIGN)


# Runtime ints that vary by bucket or model but do not help codegen are not specialized,
# so one compiled kernel serves every batch bucket of a model.
@triton.jit(do_not_specialize=["window", "group", "num_splits", "stride_lse_b",
                               "stride_lse_h"])
def _decode_split_kernel(
    q_ptr,  # (B, heads, head_dim): one new query per sequence
    k_new_ptr, v_new_ptr,  # (B, kv_heads, head_dim): the new token's K/V
    k_pool_ptr, v_pool_ptr,  # (locations + 1, kv_heads, head_dim), same strides
    table_ptr,  # (max_sequences, max_context) int32 locations
    req_idx_ptr, seq_lens_ptr, out_loc_ptr,  # (B,) int64 each
    mid_o_ptr,  # (B, heads, num_splits, head_dim) fp32, normalized partial outputs
    mid_lse_ptr,  # (B, heads, num_splits) fp32, log2-sum-exp of each split
    out_ptr,  # (B, heads, head_dim): written only when WRITE_OUT
    cos_ptr, sin_ptr,  # (max_positions, head_dim) float32 RoPE tables, read when ROPE
    stride_cos,
    sm_scale_log2,  # softmax scale * log2(e) (scale / cap with SOFTCAP): base 2 scores
    cap_log2,  # SOFTCAP: the cap * log2(e) (unread otherwise)
    window,  # SLIDING: keys at positions > p - window are visible to the query at p
    group,  # query heads per KV head
    num_splits,  # the grid's third axis
    stride_q_t, stride_q_h,
    stride_kn_t, stride_kn_h,
    stride_vn_t, stride_vn_h,
    stride_pool_n, stride_pool_h,
    stride_table,
    stride_mid_b, stride_mid_h, stride_mid_s,
    stride_lse_b, stride_lse_h,
    stride_out_t, stride_out_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
    WRITE_OUT: tl.constexpr,  # one split: write the final output, no reduction follows
    ROPE: tl.constexpr,  # rotate q and the new k here (they arrive unrotated)
    SLIDING: tl.constexpr,  # read only the last ``window`` positions (the new one included)
    SOFTCAP: tl.constexpr,  # scores are cap * tanh(scale * q.k / cap)
    USE_PDL: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # Before the wait (PDL): what no kernel of this step writes. The lengths, slots and
    # table arrive by copies that finish before the step's first kernel; the cached K/V
    # rows (positions < seq_len - 1) were written by earlier steps. So the first block's
    # gather is in flight while the previous kernel finishes (where RoPE runs apart, its
    # kernel lets this one launch before its own wait: the gather overlaps qkv then too).
    cached = tl.load(seq_lens_ptr + b).to(tl.int32) - 1  # pool positions 0 .. cached - 1
    # The splits share the visible cached positions lo .. cached - 1 (lo = 0 without a
    # window; the query at position ``cached`` sees keys > cached - window).
    lo = _window_start(cached, window, SLIDING)
    chunk = _split_size(cached - lo, num_splits, SPLIT_ALIGN)
    start = lo + split * chunk
    end = tl.minimum(start + chunk, cached)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < group
    heads = kvh * group + offs_h  # (BLOCK_H,) query heads of this KV head
    lse_ptrs = mid_lse_ptr + b * stride_lse_b + heads * stride_lse_h + split
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    table_row = table_ptr + tl.load(req_idx_ptr + b).to(tl.int64) * stride_table
    head_off = kvh * stride_pool_h + offs_d[None, :]
    first_n = start + tl.arange(0, BLOCK_N)
    first_mask = first_n < end  # all false for an idle split: nothing is read
    k_first, v_first = _gather_kv(k_pool_ptr, v_pool_ptr, table_row, first_n, first_mask,
                                  mask_d, head_off, stride_pool_n)
    # q and the new token's K/V come from the previous kernel; the merge (and through its
    # own early launch o_proj) may launch now, o_proj's first weight block loading while
    # the attention and the kernels before it finish
    pdl_launch_then_wait(USE_PDL)

    # Split 0 always runs (it owns the new token); a later split only if it has tokens.
    if (split == 0) | (start < cached):
        mask_hd = mask_h[:, None] & mask_d[None, :]
        pool_dtype = k_pool_ptr.dtype.element_ty

        # (BLOCK_H, BLOCK_D)
        q_rows = q_ptr + b * stride_q_t + heads[:, None] * stride_q_h
        q = tl.load(q_rows + offs_d[None, :], mask=mask_hd, other=0.0)
        k_row = k_new_ptr + b * stride_kn_t + kvh * stride_kn_h
        k_new = tl.load(k_row + offs_d, mask=mask_d, other=0.0)
        if ROPE:
            # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): each element's
            # partner is half a head away; both halves of a table row are equal.
            half = HEAD_DIM // 2
            partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
            sign = tl.where(offs_d < half, -1.0, 1.0)
            cs_row = cached.to(tl.int64) * stride_cos  # the new token's position
            c = tl.load(cos_ptr + cs_row + offs_d, mask=mask_d, other=0.0)
            s = tl.load(sin_ptr + cs_row + offs_d, mask=mask_d, other=0.0)
            q = _rotate_half_rope(q, tl.load(q_rows + partner[None, :], mask=mask_hd,
                                              other=0.0), c[None, :], s[None, :], sign[None, :])
            k_new = _rotate_half_rope(k_new, tl.load(k_row + partner, mask=mask_d, other=0.0),
                                      c, s, sign)
        # Rounded through the pool dtype exactly as a pool read would be.
        k_new = k_new.to(pool_dtype)
        v_new = tl.load(v_new_ptr + b * stride_vn_t + kvh * stride_vn_h + offs_d,
                        mask=mask_d, other=0.0).to(pool_dtype)
        is_first = split == 0
        if is_first:
            # Fused store: each (sequence, KV head) writes its new row once, from split 0.
            loc = tl.load(out_loc_ptr + b).to(tl.int64)
            dst = loc * stride_pool_n + kvh * stride_pool_h + offs_d
            tl.store(k_pool_ptr + dst, k_new, mask=mask_d)
            tl.store(v_pool_ptr + dst, v_new, mask=mask_d)

        # Online-softmax state, seeded by the new token in split 0 and empty elsewhere.
        qk_new = scaled_scores(tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1),
                         sm_scale_log2, cap_log2, SOFTCAP)
        m_i = tl.where(is_first, qk_new, float("-inf"))  # (BLOCK_H,)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32) + tl.where(is_first, 1.0, 0.0)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32) + tl.where(
            is_first, v_new.to(tl.float32), 0.0)[None, :]  # (BLOCK_H, BLOCK_D)

        # Every block holds at least one valid token, so m_i is finite after it.
        if start < end:
            m_i, l_i, acc = _attend_block(q, k_first, v_first, first_mask, m_i, l_i, acc,
                                          sm_scale_log2, cap_log2, SOFTCAP)
        for n0 in range(start + BLOCK_N, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            k, v = _gather_kv(k_pool_ptr, v_pool_ptr, table_row, offs_n, mask_n, mask_d,
                              head_off, stride_pool_n)
            m_i, l_i, acc = _attend_block(q, k, v, mask_n, m_i, l_i, acc, sm_scale_log2,
                                          cap_log2, SOFTCAP)

        if WRITE_OUT:
            o_ptrs = out_ptr + b * stride_out_t + heads[:, None] * stride_out_h + offs_d[None, :]
            tl.store(o_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask_hd)
        else:
            mid_base = b * stride_mid_b + heads * stride_mid_h + split * stride_mid_s
            tl.store(mid_o_ptr + mid_base[:, None] + offs_d[None, :], acc / l_i[:, None],
                     mask=mask_hd)
            tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=mask_h)
    else:
        if not WRITE_OUT:
            # An idle split: weight 0 in the reduction, which then needs no lengths.
            tl.store(lse_ptrs, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=mask_h)


@triton.jit
def _gather_kv(k_pool_ptr, v_pool_ptr, table_row, offs_n, mask_n, mask_d, head_off,
               stride_pool_n):
    """The (BLOCK_N, BLOCK_D) K and V rows of positions ``offs_n`` (masked), gathered
    through the table row; V is issued with K so both are in flight."""
    locs = tl.load(table_row + offs_n, mask=mask_n, other=0).to(tl.int64)
    rows = locs[:, None] * stride_pool_n + head_off
    mask_nd = mask_n[:, None] & mask_d[None, :]
    k = tl.load(k_pool_ptr + rows, mask=mask_nd, other=0.0)
    v = tl.load(v_pool_ptr + rows, mask=mask_nd, other=0.0)
    return k, v


@triton.jit
def _window_start(cached, window, SLIDING: tl.constexpr):
    """The first cached position the query at position ``cached`` sees: 0, or with a
    window the first of ``(cached - window, cached]``."""
    if SLIDING:
        return tl.maximum(cached - window + 1, 0)
    return cached * 0


@triton.jit
def _attend_block(q, k, v, mask_n, m_i, l_i, acc, sm_scale_log2, cap_log2,
                  SOFTCAP: tl.constexpr):
    """One block of the online softmax: the state after attending to ``k``/``v``."""
    qk = scaled_scores(tl.dot(q, tl.trans(k.to(q.dtype))), sm_scale_log2, cap_log2,
                 SOFTCAP)  # (BLOCK_H, BLOCK_N)
    qk = tl.where(mask_n[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc


@triton.jit
def _rotate_half_rope(x, partner, c, s, sign):
    """``x * cos + sign * partner * sin`` in ``x``'s dtype, each product and the sum
    rounded to it (cos and sin first), as ``executor.kernels.rope`` and the torch ops do."""
    act = x.dtype
    c = c.to(act).to(tl.float32)
    s = s.to(act).to(tl.float32)
    a = (x.to(tl.float32) * c).to(act).to(tl.float32)
    b = (partner.to(tl.float32) * sign * s).to(act).to(tl.float32)
    return (a + b).to(act)


@triton.jit(do_not_specialize=["window", "num_splits", "stride_lse_b", "stride_lse_h"])
def _decode_reduce_kernel(
    mid_o_ptr,  # (B, heads, num_splits, head_dim) fp32
    mid_lse_ptr,  # (B, heads, num_splits) fp32, -inf for idle splits
    out_ptr,  # (B, heads, head_dim)
    seq_lens_ptr,  # (B,) int64, including the new token
    window,  # SLIDING: as the split kernel's
    num_splits,
    stride_mid_b, stride_mid_h, stride_mid_s,
    stride_lse_b, stride_lse_h,
    stride_out_t, stride_out_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_splits
    SPLIT_ALIGN: tl.constexpr,
    SLIDING: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program per (sequence, query head): a log-sum-exp weighted mean of the splits.
    b = tl.program_id(0)
    h = tl.program_id(1)
    # Before the wait (PDL): the lengths arrive before the step's first kernel. Only the
    # splits that held tokens are read (the split kernel's rule: split 0, and those that
    # start before the end): at a short context most of the scratch is never loaded.
    cached = tl.load(seq_lens_ptr + b).to(tl.int32) - 1
    cached -= _window_start(cached, window, SLIDING)  # the positions the splits share
    chunk = _split_size(cached, num_splits, SPLIT_ALIGN)
    ran_splits = tl.minimum(tl.maximum((cached + chunk - 1) // chunk, 1), num_splits)
    # o_proj may launch now: its first weight block loads while the splits run.
    pdl_launch_then_wait(USE_PDL)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < ran_splits
    lse = tl.load(mid_lse_ptr + b * stride_lse_b + h * stride_lse_h + offs_s, mask=mask_s,
                  other=float("-inf"))  # (BLOCK_S,); split 0 always ran, so max is finite
    o_ptrs = (mid_o_ptr + b * stride_mid_b + h * stride_mid_h + offs_s[:, None] * stride_mid_s
              + offs_d[None, :])
    mid = tl.load(o_ptrs, mask=mask_s[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    ran = lse > float("-inf")
    weight = tl.where(ran, tl.exp2(lse - tl.max(lse, axis=0)), 0.0)
    # An idle split's partial output was never written: drop it (it may hold NaN).
    mid = tl.where(ran[:, None], mid, 0.0)
    out = tl.sum(mid * weight[:, None], axis=0) / tl.sum(weight, axis=0)  # (BLOCK_D,)
    tl.store(out_ptr + b * stride_out_t + h * stride_out_h + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def decode_attention(
    q: torch.Tensor,  # (B, heads, head_dim)
    k_new: torch.Tensor,  # (B, kv_heads, head_dim)
    v_new: torch.Tensor,  # (B, kv_heads, head_dim)
    k_pool: torch.Tensor,  # (locations + 1, kv_heads, head_dim)
    v_pool: torch.Tensor,  # (locations + 1, kv_heads, head_dim)
    table: torch.Tensor,  # (max_sequences, max_context) int32
    slots: torch.Tensor,  # (B,) int64
    seq_lens: torch.Tensor,  # (B,) int64, including the new token
    out_cache_loc: torch.Tensor,  # (B,) int64
    out: torch.Tensor,  # (B, heads, head_dim), written
    mid_o: torch.Tensor | None,  # (B, heads, num_splits, head_dim) fp32 scratch
    mid_lse: torch.Tensor | None,  # (B, heads, num_splits) fp32 scratch
    sm_scale: float,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin (positions, head_dim)
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Store the new K/V at ``out_cache_loc`` and attend each query to its whole sequence
    (``window`` > 0: to its last ``window`` positions, its own included, as Hugging Face's
    sliding window; older K/V are never read). ``softcap`` > 0 caps the scores at
    ``softcap * tanh(score / softcap)`` before the softmax (Gemma 2).

    The split count is ``mid_o.shape[2]``; without scratch (``None``) it is 1. The launch
    shape depends on ``B`` and the split count only, so it may be captured in a CUDA
    graph: lengths, slots and locations are read on the device. With ``rope`` (float32
    tables, ``RotaryEmbedding.cos`` / ``.sin``), ``q`` and ``k_new`` are unrotated and
    rotated here at position ``seq_len - 1``; the pool receives the rotated key.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1
    assert q.stride(-1) == k_new.stride(-1) == v_new.stride(-1) == out.stride(-1) == 1
    if mid_o is None or mid_lse is None:
        # One split: the split kernel writes ``out``; the scratch pointers are never used.
        num_splits = 1
        mid_o = mid_lse = out
    else:
        num_splits = mid_o.shape[2]
        assert mid_lse.shape[2] == num_splits
        assert mid_o.stride(-1) == 1 and mid_lse.stride(-1) == 1
    block_d = triton.next_power_of_2(head_dim)
    scale_log2, cap_log2 = score_scales(sm_scale, softcap)
    if rope is not None:
        cos, sin = rope
        assert cos.shape == sin.shape and cos.shape[1] == head_dim and head_dim % 2 == 0
        assert cos.stride() == sin.stride() and cos.stride(1) == 1
        assert cos.dtype == sin.dtype == torch.float32
    else:
        cos = sin = out  # never read
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_new, v_new, k_pool, v_pool, table, slots, seq_lens, out_cache_loc,
        mid_o, mid_lse, out,
        cos, sin, cos.stride(0),
        scale_log2, cap_log2, window, group, num_splits,
        q.stride(0), q.stride(1),
        k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1),
        k_pool.stride(0), k_pool.stride(1),
        table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=max(MIN_BLOCK_H, triton.next_power_of_2(group)),
        BLOCK_N=BLOCK_N,
        SPLIT_ALIGN=SPLIT_ALIGN,
        WRITE_OUT=num_splits == 1,
        ROPE=rope is not None,
        SLIDING=window > 0,
        SOFTCAP=softcap > 0,
        num_warps=4,
        num_stages=split_stages(batch),
        **pdl.options(),
    )
    if num_splits == 1:
        return
    block_s = max(16, triton.next_power_of_2(num_splits))  # few variants across buckets
    _decode_reduce_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, seq_lens, window, num_splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=block_s,
        SPLIT_ALIGN=SPLIT_ALIGN,
        SLIDING=window > 0,
        # Few short splits reduce fastest with 2 warps, more or wider ones with 4.
        num_warps=2 if head_dim <= 64 and block_s <= 16 else 4,
        **pdl.options(),
    )
