# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""Paged attention for packed variable-length extends (prefill, chunked prefill, mixed).

Sequence ``b`` brings ``extend_lens[b]`` new tokens at ``extend_start[b]`` of the packed
tensors, after a cached prefix of ``prefix_lens[b]`` tokens. New query ``i`` sees the
whole prefix (read from the pool through the request-slot table) and new keys ``0..i``
(read from the packed K/V, which the caller has also stored in the pool).

``extend_attention``: grid ``(ceil(max_extend_len / BLOCK_M), batch, heads)``, the last
query blocks first; the grid uses a host-side maximum, so it runs eagerly.
``extend_attention_fixed_grid`` (prefill graph mode ``fixed_grid``): grid
``(ceil(T / BLOCK_M), heads)`` over the packed tokens, each program finding on the device
which sequences its block belongs to, so a graph bucket's token count fixes the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor.attention.triton_kernels.scores import scaled_scores, score_scales
from executor.kernels.fast_launch import FastLauncher, cdiv, next_power_of_2
from executor.kernels.pdl import pdl_enter

# Tiles picked by a sweep (BLOCK_M 64/128, BLOCK_N 32/64, 4/8 warps, 2/3 stages) as best
# or near-best from short to long prefills, chunked prefills and decode-like rows;
# BLOCK_M 128 lost everywhere but tiny prefills.
BLOCK_M = 64  # new queries per program; a multiple of BLOCK_N
BLOCK_N = 64  # keys per inner iteration
NUM_WARPS = 4
NUM_STAGES = 3
# Heads wider than this (Gemma's 256) launch with 8 warps and 2 stages: a 64 x 256 float32
# accumulator and three stages of 64 x 256 K and V tiles would not fit 4 warps' registers
# and shared memory. Untuned (no sweep yet at that width).
WIDE_HEAD_DIM = 128


@triton.jit
def _online_softmax_step(qk, v, m_i, l_i, acc, SAFE: tl.constexpr = False):
    # One block of scores (BLOCK_M, BLOCK_N), in base 2 and already masked with -inf,
    # folded into the running max ``m_i``, sum ``l_i`` and unnormalized output ``acc``.
    # Each row must already have seen a finite score (m_i finite or one in this block),
    # unless SAFE: a row with none so far keeps l_i = 0, acc = 0 (a sliding window's
    # rows may see no key of a block that others in the tile see).
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    # SAFE: offset by 0 where the max is still -inf (the max itself stays -inf).
    if SAFE:  # noqa: SIM108 (a compile-time branch)
        m_off = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_off = m_new
    alpha = tl.exp2(m_i - m_off)
    p = tl.exp2(qk - m_off[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


# The per-batch metadata pointers are views at batch-dependent offsets of one packed
# transfer: not specialized on alignment, so no batch shape ever compiles a new variant.
@triton.jit(do_not_specialize=["window", "group", "req_idx_ptr", "prefix_lens_ptr",
                               "extend_lens_ptr", "extend_start_ptr", "loc_ptr"])
def _extend_kernel(
    q_ptr,  # (T, heads, head_dim) packed new queries
    k_ptr, v_ptr,  # (T, kv_heads, head_dim) packed new keys/values
    out_ptr,  # (T, heads, head_dim)
    k_pool_ptr, v_pool_ptr,  # (locations + 1, kv_heads, head_dim), same strides
    table_ptr,  # (max_sequences, max_context) int32 locations
    req_idx_ptr, prefix_lens_ptr, extend_lens_ptr, extend_start_ptr,  # (B,) int64 each
    loc_ptr,  # (T,) int64 pool location of each new token (read only when STORE_KV)
    sm_scale_log2,  # softmax scale * log2(e) (scale / cap with SOFTCAP)
    cap_log2,  # SOFTCAP: the cap * log2(e)
    window,  # SLIDING: the query at position p sees keys at positions > p - window
    group,  # query heads per KV head
    stride_q_t, stride_q_h,
    stride_k_t, stride_k_h,
    stride_v_t, stride_v_h,
    stride_o_t, stride_o_h,
    stride_pool_n, stride_pool_h,
    stride_table,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STORE_KV: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    # The longest causal rows (the last query blocks) start first, so the short ones fill
    # the tail (a small gain on long prefills, none on short ones).
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    m0 = pid_m * BLOCK_M
    num_new = tl.load(extend_lens_ptr + b).to(tl.int32)
    if m0 < num_new:
        _extend_rows(h, m0, num_new, tl.load(prefix_lens_ptr + b).to(tl.int32),
                     tl.load(extend_start_ptr + b).to(tl.int64), tl.load(req_idx_ptr + b),
                     q_ptr, k_ptr, v_ptr, out_ptr, k_pool_ptr, v_pool_ptr, table_ptr, loc_ptr,
                     sm_scale_log2, cap_log2, window, group, stride_q_t, stride_q_h,
                     stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_o_t, stride_o_h,
                     stride_pool_n, stride_pool_h, stride_table, HEAD_DIM, BLOCK_D, BLOCK_M,
                     BLOCK_N, STORE_KV, SLIDING, SOFTCAP)


@triton.jit(do_not_specialize=["window", "group", "num_seqs"])
def _extend_fixed_grid_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, k_pool_ptr, v_pool_ptr, table_ptr,
    req_idx_ptr, prefix_lens_ptr, extend_lens_ptr, extend_start_ptr,  # (num_seqs,) each
    loc_ptr,  # (T,) int64
    sm_scale_log2,
    cap_log2,
    window,
    group,
    num_seqs,  # sequence rows; rows past the batch's have extend_lens 0 (padding)
    stride_q_t, stride_q_h,
    stride_k_t, stride_k_h,
    stride_v_t, stride_v_h,
    stride_o_t, stride_o_h,
    stride_pool_n, stride_pool_h,
    stride_table,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_seqs
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid ``(ceil(T / BLOCK_M), heads)`` over the *packed* tokens, fixed by ``T`` alone: a
    program takes packed tokens ``[t0, t0 + BLOCK_M)`` of one head and, for each sequence
    those tokens belong to (in packed order), that sequence's rows of the block. The
    sequences are found on the device from the metadata rows, so nothing in the launch
    depends on the batch: it can be captured in a CUDA graph per token bucket."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    t0 = pid * BLOCK_M
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_seqs
    # Before the wait (PDL): the metadata rows are copied in before the step's first kernel.
    lens = tl.load(extend_lens_ptr + offs_s, mask=mask_s, other=0)
    starts = tl.load(extend_start_ptr + offs_s, mask=mask_s, other=0)
    real = lens > 0
    # Packed in order: the sequences ending at or before t0 come first, then those that
    # start before the block's end.
    first = tl.sum((real & (starts + lens <= t0)).to(tl.int32), axis=0)
    last = tl.sum((real & (starts < t0 + BLOCK_M)).to(tl.int32), axis=0)
    pdl_enter(USE_PDL)
    # (The sequence's fields are loaded again, one round trip for all four: keeping all
    # rows in registers through the loop was slower on long prefills.)
    for b in range(first, last):
        start = tl.load(extend_start_ptr + b)
        m0 = (t0 - start).to(tl.int32)  # may be < 0: those rows are masked
        _extend_rows(h, m0, tl.load(extend_lens_ptr + b).to(tl.int32),
                     tl.load(prefix_lens_ptr + b).to(tl.int32), start,
                     tl.load(req_idx_ptr + b),
                     q_ptr, k_ptr, v_ptr, out_ptr, k_pool_ptr, v_pool_ptr, table_ptr, loc_ptr,
                     sm_scale_log2, cap_log2, window, group, stride_q_t, stride_q_h,
                     stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_o_t, stride_o_h,
                     stride_pool_n, stride_pool_h, stride_table, HEAD_DIM, BLOCK_D, BLOCK_M,
                     BLOCK_N, True, SLIDING, SOFTCAP)


@triton.jit
def _extend_rows(h, m0, num_new, prefix, start, slot, q_ptr, k_ptr, v_ptr, out_ptr, k_pool_ptr,
                 v_pool_ptr, table_ptr, loc_ptr, sm_scale_log2, cap_log2, window, group,
                 stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
                 stride_o_t, stride_o_h, stride_pool_n, stride_pool_h, stride_table,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, STORE_KV: tl.constexpr, SLIDING: tl.constexpr,
                 SOFTCAP: tl.constexpr):
    """New queries ``m0 .. m0 + BLOCK_M - 1`` of the sequence in request slot ``slot``
    (those in ``[0, num_new)``; ``m0`` need not be a multiple of anything, nor >= 0),
    whose ``num_new`` tokens start at packed row ``start`` after ``prefix`` cached ones;
    head ``h``: attend, store the output rows and (``STORE_KV``, first head of a KV head)
    the rows' new K/V. SLIDING: query ``i`` sees only keys ``j`` with
    ``j > i - window`` (new-token indices; the same for absolute positions), and blocks
    wholly before the tile's first row's window are skipped."""
    start = start.to(tl.int64)
    kvh = h // group
    pool_dtype = k_pool_ptr.dtype.element_ty

    offs_m = m0 + tl.arange(0, BLOCK_M)  # new-token index of each query row
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = (offs_m >= 0) & (offs_m < num_new)
    mask_d = offs_d < HEAD_DIM
    # (BLOCK_M, BLOCK_D)
    q = tl.load(q_ptr + (start + offs_m[:, None]) * stride_q_t + h * stride_q_h
                + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # 1) The cached prefix, visible to every new query: no causal mask.
    table_row = table_ptr + slot.to(tl.int64) * stride_table
    head_off = kvh * stride_pool_h + offs_d[None, :]
    # Absolute position of each query row: prefix + offs_m; with a window, the first
    # visible position of row i is prefix + i - window + 1.
    first_row = tl.maximum(m0, 0)
    if SLIDING:
        p_lo = tl.maximum(prefix + first_row - window + 1, 0) // BLOCK_N * BLOCK_N
        row_lo = prefix + offs_m - window + 1  # (BLOCK_M,)
    else:
        p_lo = 0
        row_lo = offs_m * 0
    for n0 in range(p_lo, prefix, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < prefix
        locs = tl.load(table_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        mask_nd = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_pool_ptr + locs[:, None] * stride_pool_n + head_off, mask=mask_nd,
                    other=0.0)  # (BLOCK_N, BLOCK_D)
        v = tl.load(v_pool_ptr + locs[:, None] * stride_pool_n + head_off, mask=mask_nd,
                    other=0.0)
        qk = scaled_scores(tl.dot(q, tl.trans(k.to(q.dtype))), sm_scale_log2, cap_log2,
                     SOFTCAP)  # (BLOCK_M, BLOCK_N)
        if SLIDING:
            visible = mask_n[None, :] & (offs_n[None, :] >= row_lo[:, None])
            qk = tl.where(visible, qk, float("-inf"))
        else:
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(qk, v.to(q.dtype), m_i, l_i, acc, SLIDING)

    # 2) The new tokens, from the packed K/V (rounded through the pool dtype so they
    # equal what a pool read returns). Key j is visible to query i iff j <= i. Keys of
    # whole blocks before the block's first query (j < lo <= m0) are visible to all its
    # rows: no mask.
    k_rows = k_ptr + kvh * stride_k_h + offs_d[None, :]
    v_rows = v_ptr + kvh * stride_v_h + offs_d[None, :]
    if SLIDING:
        # Every block is masked (the window's lower edge), from the block holding the
        # tile's first row's first visible new key.
        unmasked_end = 0
        lo = tl.maximum(first_row - window + 1, 0) // BLOCK_N * BLOCK_N
    else:
        lo = first_row // BLOCK_N * BLOCK_N
        unmasked_end = lo
    for n0 in range(0, unmasked_end, BLOCK_N):
        offs_n = start + n0 + tl.arange(0, BLOCK_N)
        k = tl.load(k_rows + offs_n[:, None] * stride_k_t, mask=mask_d[None, :],
                    other=0.0).to(pool_dtype)
        v = tl.load(v_rows + offs_n[:, None] * stride_v_t, mask=mask_d[None, :],
                    other=0.0).to(pool_dtype)
        qk = scaled_scores(tl.dot(q, tl.trans(k.to(q.dtype))), sm_scale_log2, cap_log2, SOFTCAP)
        m_i, l_i, acc = _online_softmax_step(qk, v.to(q.dtype), m_i, l_i, acc)
    # The diagonal blocks, masked. Key 0 (or a block above) is visible to every row, so
    # every m_i is finite once its first block is folded in (rows outside the sequence
    # see every key, so theirs are too; they are never stored). Not so with a window:
    # its softmax steps are SAFE.
    hi = tl.minimum(num_new, m0 + BLOCK_M)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < num_new
        mask_nd = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_rows + (start + offs_n[:, None]) * stride_k_t, mask=mask_nd,
                    other=0.0).to(pool_dtype)
        v = tl.load(v_rows + (start + offs_n[:, None]) * stride_v_t, mask=mask_nd,
                    other=0.0).to(pool_dtype)
        qk = scaled_scores(tl.dot(q, tl.trans(k.to(q.dtype))), sm_scale_log2, cap_log2, SOFTCAP)
        visible = ((offs_n[None, :] <= offs_m[:, None]) | ~mask_m[:, None]) & mask_n[None, :]
        if SLIDING:
            visible &= offs_n[None, :] > offs_m[:, None] - window
        qk = tl.where(visible, qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(qk, v.to(q.dtype), m_i, l_i, acc, SLIDING)

    if STORE_KV:  # noqa: SIM102 (compile-time; the inner test is a runtime one)
        # The first query head of each KV head also writes that head's new K/V rows of
        # this block to the pool: every new token is stored exactly once, by the same
        # launch. Nothing in this launch reads those locations (the prefix loop reads
        # older ones; the new keys come from the packed K/V), so there is no race.
        if h % group == 0:
            mask_md = mask_m[:, None] & mask_d[None, :]
            rows = start + offs_m[:, None]
            k_new = tl.load(k_rows + rows * stride_k_t, mask=mask_md, other=0.0)
            v_new = tl.load(v_rows + rows * stride_v_t, mask=mask_md, other=0.0)
            locs = tl.load(loc_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
            dst = locs[:, None] * stride_pool_n + head_off
            tl.store(k_pool_ptr + dst, k_new.to(pool_dtype), mask=mask_md)
            tl.store(v_pool_ptr + dst, v_new.to(pool_dtype), mask=mask_md)

    if SLIDING:  # rows outside the sequence may have seen no key: keep them finite
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(out_ptr + (start + offs_m[:, None]) * stride_o_t + h * stride_o_h
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])


def extend_attention(
    q: torch.Tensor,  # (T, heads, head_dim)
    k: torch.Tensor,  # (T, kv_heads, head_dim)
    v: torch.Tensor,  # (T, kv_heads, head_dim)
    out: torch.Tensor,  # (T, heads, head_dim), written
    k_pool: torch.Tensor,  # (locations + 1, kv_heads, head_dim)
    v_pool: torch.Tensor,  # (locations + 1, kv_heads, head_dim)
    table: torch.Tensor,  # (max_sequences, max_context) int32
    slots: torch.Tensor,  # (B,) int64
    prefix_lens: torch.Tensor,  # (B,) int64
    extend_lens: torch.Tensor,  # (B,) int64
    extend_start: torch.Tensor,  # (B,) int64
    max_extend_len: int,  # host-side max of extend_lens: sizes the grid
    sm_scale: float,
    out_cache_loc: torch.Tensor | None = None,  # (T,) int64
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Causal attention of packed new tokens over their cached prefix and each other
    (``window`` > 0: each query over its last ``window`` positions, its own included;
    ``softcap`` > 0: scores capped at ``softcap * tanh(score / softcap)``).

    Reads the prefix from the pool. With ``out_cache_loc``, the same launch also stores
    ``k``/``v`` at those locations (what ``store_kv`` does, without a second launch).
    """
    num_tokens, num_heads, head_dim = q.shape
    batch = slots.shape[0]
    if num_tokens == 0 or batch == 0:
        return
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == out.stride(-1) == 1
    assert BLOCK_M % BLOCK_N == 0, "the unmasked causal loop steps BLOCK_N up to a BLOCK_M edge"
    loc = out_cache_loc if out_cache_loc is not None else extend_start
    grid = (cdiv(max_extend_len, BLOCK_M), batch, num_heads)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               out.stride(0), out.stride(1), k_pool.stride(0), k_pool.stride(1),
               table.stride(0))
    pointers = (q, k, v, out, k_pool, v_pool, table, slots, prefix_lens,
                extend_lens, extend_start, loc)
    store = out_cache_loc is not None
    sliding, capped = window > 0, softcap > 0
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": next_power_of_2(head_dim),
                  "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "STORE_KV": store,
                  "SLIDING": sliding, "SOFTCAP": capped}
    # What the JIT specializes on besides pointer alignment (the launcher adds that):
    # dtypes, the integer arguments (strides; ``window`` and ``group`` are not
    # specialized) and the constexprs, which follow from head_dim and the flags.
    key = (tuple(t.dtype for t in pointers), strides, head_dim, store, sliding, capped)
    scale_log2, cap_log2 = score_scales(sm_scale, softcap)
    launcher = _WIDE_LAUNCHER if head_dim > WIDE_HEAD_DIM else _LAUNCHER
    launcher.launch(grid, key, (*pointers, scale_log2, cap_log2, window, group, *strides),
                    constexprs)


def extend_attention_fixed_grid(
    q: torch.Tensor,  # (T, heads, head_dim): T fixes the grid (a graph bucket's tokens)
    k: torch.Tensor,  # (T, kv_heads, head_dim)
    v: torch.Tensor,  # (T, kv_heads, head_dim)
    out: torch.Tensor,  # (T, heads, head_dim), written where a sequence has tokens
    k_pool: torch.Tensor,  # (locations + 1, kv_heads, head_dim)
    v_pool: torch.Tensor,  # (locations + 1, kv_heads, head_dim)
    table: torch.Tensor,  # (max_sequences, max_context) int32
    seq_rows: torch.Tensor,  # (5, S) int64: packing.SEQUENCE_FIELDS (seq_lens unread)
    out_cache_loc: torch.Tensor,  # (T,) int64
    sm_scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """``extend_attention`` (storing the new K/V too) with a launch that depends on ``T``
    and ``S`` only: the batch's sequences are rows of ``seq_rows`` in packed order, and
    rows after them have ``extend_lens`` 0. Tokens no sequence covers (a bucket's padding)
    are neither read as keys nor written. Results equal ``extend_attention``'s where a
    sequence starts at a multiple of ``BLOCK_M``; elsewhere the keys are folded in other
    blocks (float32 rounding)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_rows.shape[1]
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads and seq_rows.shape[0] == 5
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == out.stride(-1) == 1
    assert seq_rows.stride(1) == 1 and out_cache_loc.shape[0] >= num_tokens
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               out.stride(0), out.stride(1), k_pool.stride(0), k_pool.stride(1),
               table.stride(0))
    req, _, prefix, lens, start = seq_rows.unbind(0)  # packing.SEQUENCE_FIELDS
    pointers = (q, k, v, out, k_pool, v_pool, table, req, prefix, lens, start, out_cache_loc)
    block_s = max(16, next_power_of_2(num_seqs))
    sliding, capped = window > 0, softcap > 0
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": next_power_of_2(head_dim),
                  "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_S": block_s,
                  "SLIDING": sliding, "SOFTCAP": capped}
    key = (tuple(t.dtype for t in pointers), strides, head_dim, block_s, sliding, capped)
    scale_log2, cap_log2 = score_scales(sm_scale, softcap)
    launcher = _WIDE_FIXED_LAUNCHER if head_dim > WIDE_HEAD_DIM else _FIXED_LAUNCHER
    launcher.launch((cdiv(num_tokens, BLOCK_M), num_heads, 1), key,
                    (*pointers, scale_log2, cap_log2, window, group, num_seqs, *strides),
                    constexprs)


# One per process: the kernel is compiled per specialization, and every executor's
# launches share those compilations (as the JIT's own cache would).
_LAUNCHER = FastLauncher(_extend_kernel, pdl=True, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
_FIXED_LAUNCHER = FastLauncher(_extend_fixed_grid_kernel, pdl=True, num_warps=NUM_WARPS,
                               num_stages=NUM_STAGES)
_WIDE_LAUNCHER = FastLauncher(_extend_kernel, pdl=True, num_warps=8, num_stages=2)
_WIDE_FIXED_LAUNCHER = FastLauncher(_extend_fixed_grid_kernel, pdl=True, num_warps=8,
                                    num_stages=2)
