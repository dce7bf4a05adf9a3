# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""The pieces the decode-path kernels share (``decode.py``'s two launches and
``decode_persistent.py``'s one): a routed pair's routing and its block of gate_up
activations, and one chunk of down's products. Every caller composes them in the same
order, so the one launch and the two give the same bits. The grouped gate_up kernel
(``fused.py``) takes its scale pointers from here too.
"""

from __future__ import annotations

import triton
import triton.language as tl

from executor.kernels.cache_policy import STREAM
from executor.kernels.moe.route import topk_rows


@triton.jit
def _route_pair(logits_ptr, weights_ptr, ids_ptr, pair, pid_n, num_experts, stride_l,
                TOP_K: tl.constexpr, E_POW2: tl.constexpr, K_POW2: tl.constexpr,
                RENORMALIZE: tl.constexpr, ROUND_TO_ACT: tl.constexpr,
                ROUTE_ROWS: tl.constexpr):
    """``(expert, weights, ids)``: the expert of routed pair ``pair`` (int64) and its
    token's routing, ``(ROUTE_ROWS, K_POW2)`` copies; the first column block of slot 0
    stores the routing."""
    t = pair // TOP_K
    j = pair % TOP_K
    # the token's row once a warp (ROUTE_ROWS = num_warps copies, the same bits in each):
    # where the row loads vectorize (its stride a multiple of 16, as 128 experts' is),
    # Triton gives each warp a copy, and each pick's reduction stays inside a warp (no
    # shared-memory round and barrier; the routing precedes the first weight load)
    rows = t + tl.zeros((ROUTE_ROWS,), dtype=tl.int32)
    top_w, top_i = topk_rows(logits_ptr, rows, t + 1, num_experts, stride_l,
                             TOP_K, E_POW2, K_POW2, RENORMALIZE, ROUND_TO_ACT)  # (R, K_POW2)
    slots = tl.arange(0, K_POW2)[None, :]
    expert = tl.max(tl.sum(tl.where(slots == j, top_i, 0), axis=1), axis=0)
    # an id past the experts (a padded column's, for a row of NaN logits) reads the last
    # expert rather than past the end
    expert = tl.minimum(expert, num_experts - 1).to(tl.int64)
    if (j == 0) & (pid_n == 0):  # one program per token stores its routing (each copy
        # writes the same values)
        routed = tl.broadcast_to(t.to(tl.int64) * TOP_K + slots, (ROUTE_ROWS, K_POW2))
        stored = tl.broadcast_to(slots < TOP_K, (ROUTE_ROWS, K_POW2))
        tl.store(weights_ptr + routed, top_w, mask=stored)
        tl.store(ids_ptr + routed, top_i, mask=stored)
    return expert, top_w, top_i


@triton.jit
def _gate_up_pair(x_ptr, nw_ptr, w_ptr, s_ptr, act_ptr, expert, pair, pid_n, n_cols, k_dim,
                  stride_x, stride_we, stride_wn, stride_se, stride_sr, inv_k, eps,
                  TOP_K: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_ROW: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_SCALES: tl.constexpr,
                  SB: tl.constexpr, STAGES: tl.constexpr):
    """Column block ``pid_n`` of routed pair ``pair``'s activations (its token's input
    through ``expert``'s gate and up rows, SiLU-and-mul), stored at ``act_ptr``."""
    t = pair // TOP_K
    act_ty = act_ptr.dtype.element_ty
    x_row = x_ptr + t.to(tl.int64) * stride_x
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    ks = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    u_ptrs = g_ptrs + n_cols * stride_wn
    sg_ptrs, su_ptrs = gate_up_scale_ptrs(s_ptr, expert, stride_se, stride_sr, cols, n_cols,
                                          W_SCALES, SB)
    gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if STAGES == 0:
        # the next chunk's weights are loaded before this chunk's products (two chunks in
        # flight per program: the loop is not pipelined for us, there being no dot); the
        # first chunk is in flight during the norm's pass over the row
        w_mask = col_ok[:, None] & (ks < k_dim)[None, :]
        g_w = tl.load(g_ptrs, mask=w_mask, other=0.0, eviction_policy=STREAM)
        u_w = tl.load(u_ptrs, mask=w_mask, other=0.0, eviction_policy=STREAM)
        rstd = _row_rstd(x_row, k_dim, inv_k, eps, HAS_NORM, BLOCK_ROW)
        for k in range(0, k_dim, BLOCK_K):
            w_mask = col_ok[:, None] & (ks + k + BLOCK_K < k_dim)[None, :]
            g_next = tl.load(g_ptrs + k + BLOCK_K, mask=w_mask, other=0.0,
                             eviction_policy=STREAM)
            u_next = tl.load(u_ptrs + k + BLOCK_K, mask=w_mask, other=0.0,
                             eviction_policy=STREAM)
            gate, up = _gate_up_chunk(gate, up, g_w, u_w, k, ks, k_dim, x_row, nw_ptr, rstd,
                                      act_ptr, sg_ptrs, su_ptrs, col_ok, HAS_NORM, W_SCALES,
                                      SB, BLOCK_N, BLOCK_K)
            g_w, u_w = g_next, u_next
    else:  # Triton's pipelined loop: STAGES chunks in flight through shared memory (FP8
        # chunks are half the bytes, so registers alone hold few in flight)
        rstd = _row_rstd(x_row, k_dim, inv_k, eps, HAS_NORM, BLOCK_ROW)
        for k in tl.range(0, k_dim, BLOCK_K, num_stages=STAGES):
            w_mask = col_ok[:, None] & (ks + k < k_dim)[None, :]
            g_w = tl.load(g_ptrs + k, mask=w_mask, other=0.0, eviction_policy=STREAM)
            u_w = tl.load(u_ptrs + k, mask=w_mask, other=0.0, eviction_policy=STREAM)
            gate, up = _gate_up_chunk(gate, up, g_w, u_w, k, ks, k_dim, x_row, nw_ptr, rstd,
                                      act_ptr, sg_ptrs, su_ptrs, col_ok, HAS_NORM, W_SCALES,
                                      SB, BLOCK_N, BLOCK_K)
    g = tl.sum(gate, axis=1)
    u = tl.sum(up, axis=1)
    if W_SCALES == 1:  # each row's sum times its scale, before the rounding
        g = g * tl.load(sg_ptrs, mask=col_ok, other=0.0)
        u = u * tl.load(su_ptrs, mask=col_ok, other=0.0)
    g = g.to(act_ty).to(tl.float32)
    u = u.to(act_ty).to(tl.float32)
    act = tl.div_rn(g, 1.0 + tl.exp(-g)).to(act_ty).to(tl.float32) * u
    tl.store(act_ptr + pair.to(tl.int64) * n_cols + cols, act.to(act_ty), mask=col_ok)


@triton.jit
def _row_rstd(x_row, k_dim, inv_k, eps, HAS_NORM: tl.constexpr, BLOCK_ROW: tl.constexpr):
    """With ``HAS_NORM`` the norm kernel's ``1 / rms`` of the row, its squares summed over
    the whole row at once; else 0 (unread)."""
    rstd = 0.0
    if HAS_NORM:
        offs = tl.arange(0, BLOCK_ROW)
        xr = tl.load(x_row + offs, mask=offs < k_dim, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xr * xr, axis=0) * inv_k + eps)
    return rstd


@triton.jit
def _gate_up_chunk(gate, up, g_w, u_w, k, ks, k_dim, x_row, nw_ptr, rstd, act_ptr, sg_ptrs,
                   su_ptrs, col_ok, HAS_NORM: tl.constexpr, W_SCALES: tl.constexpr,
                   SB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``gate`` and ``up`` plus one chunk's products: the input chunk at ``k`` (normed
    with ``HAS_NORM``) times the weight chunks ``g_w`` / ``u_w`` (BLOCK_N, BLOCK_K)."""
    act_ty = act_ptr.dtype.element_ty
    k_ok = ks + k < k_dim
    xk = tl.load(x_row + k + ks, mask=k_ok, other=0.0).to(tl.float32)
    if HAS_NORM:  # rounded before and after the weight multiply, as the norm kernel
        nw = tl.load(nw_ptr + k + ks, mask=k_ok, other=0.0).to(tl.float32)
        xk = ((xk * rstd).to(act_ty).to(tl.float32) * nw).to(act_ty).to(tl.float32)
    if W_SCALES == 2:  # the dequantized weight (as fp8.dequantize), then the product
        gate += _block_scaled(g_w, sg_ptrs, col_ok, k, k_dim, SB, BLOCK_N, BLOCK_K) * xk[None, :]
        up += _block_scaled(u_w, su_ptrs, col_ok, k, k_dim, SB, BLOCK_N, BLOCK_K) * xk[None, :]
    else:
        gate += g_w.to(tl.float32) * xk[None, :]
        up += u_w.to(tl.float32) * xk[None, :]
    return gate, up


@triton.jit
def _block_scaled(w, s_ptrs, s_ok, k, k_dim, SB: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """e4m3 ``w`` (BLOCK_N, BLOCK_K) at reduction offset ``k`` times its block scales (each
    row's block row at ``s_ptrs``), in float32: one scale a row while the chunk lies in one
    block column, else one a row and block column (the chunk split into its blocks)."""
    if BLOCK_K <= SB:
        s = tl.load(s_ptrs + k // SB, mask=s_ok, other=0.0)
        return w.to(tl.float32) * s[:, None]
    NB: tl.constexpr = BLOCK_K // SB
    blocks = k // SB + tl.arange(0, NB)
    s = tl.load(s_ptrs[:, None] + blocks[None, :],
                mask=s_ok[:, None] & (blocks < tl.cdiv(k_dim, SB))[None, :], other=0.0)
    w3 = tl.reshape(w.to(tl.float32), (BLOCK_N, NB, SB)) * s[:, :, None]
    return tl.reshape(w3, (BLOCK_N, BLOCK_K))


@triton.jit
def _down_chunk(acc, w, k, ks, k_dim, a_ptrs, slot_ok, s_ptrs, s_ok, W_SCALES: tl.constexpr,
                SB: tl.constexpr, K_POW2: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, A_CACHE: tl.constexpr):
    """``acc`` plus one chunk's products: the ``top_k`` activation chunks at ``k`` (loaded
    with cache modifier ``A_CACHE``) times their experts' weight chunks ``w`` (K_POW2,
    BLOCK_N, BLOCK_K)."""
    k_ok = (ks + k < k_dim)[None, None, :]
    a = tl.load(a_ptrs + k, mask=slot_ok[:, None, None] & k_ok, other=0.0,
                cache_modifier=A_CACHE)
    if W_SCALES == 2 and BLOCK_K <= SB:  # one scale a row of each expert
        s = tl.load(s_ptrs + k // SB, mask=s_ok, other=0.0)
        acc += (w.to(tl.float32) * s[:, :, None]) * a.to(tl.float32)
    elif W_SCALES == 2:  # the experts' rows as one (K_POW2 * BLOCK_N)-row tile
        rows: tl.constexpr = K_POW2 * BLOCK_N
        w2 = _block_scaled(tl.reshape(w, (rows, BLOCK_K)), tl.reshape(s_ptrs, (rows,)),
                           tl.reshape(s_ok, (rows,)), k, k_dim, SB, rows, BLOCK_K)
        acc += tl.reshape(w2, (K_POW2, BLOCK_N, BLOCK_K)) * a.to(tl.float32)
    else:
        acc += w.to(tl.float32) * a.to(tl.float32)
    return acc


@triton.jit
def _down_ptrs(w_ptr, act_ptr, experts, first_pair, slots, slot_ok, cols, ks, out_cols,
               red_dim, stride_we, stride_wn):
    """``(w_ptrs, a_ptrs, rows_ok, s_ok, col_ok)`` of down's chunks for output columns
    ``cols`` of the token whose ``slots`` pairs start at ``first_pair``: its experts'
    rows ``(K_POW2, BLOCK_N, BLOCK_K)`` and its pairs' activations ``(K_POW2, 1,
    BLOCK_K)`` at reduction offset 0 (``red_dim`` long)."""
    col_ok = cols < out_cols
    w_ptrs = (w_ptr + experts[:, None, None] * stride_we
              + cols[None, :, None].to(tl.int64) * stride_wn + ks[None, None, :])
    a_ptrs = act_ptr + (first_pair + slots)[:, None, None] * red_dim + ks[None, None, :]
    rows_ok = slot_ok[:, None, None] & col_ok[None, :, None]
    s_ok = slot_ok[:, None] & col_ok[None, :]
    return w_ptrs, a_ptrs, rows_ok, s_ok, col_ok


@triton.jit
def _down_stream(w, w_ptrs, a_ptrs, rows_ok, ks, red_dim, slot_ok, s_ptrs, s_ok,
                 W_SCALES: tl.constexpr, SB: tl.constexpr, K_POW2: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A_CACHE: tl.constexpr):
    """Down's float32 products summed over the reduction, ``w`` its first chunk (already
    loaded), the next chunk in flight in registers during each chunk's products."""
    acc = tl.zeros((K_POW2, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, red_dim, BLOCK_K):
        w_next = tl.load(w_ptrs + k + BLOCK_K,
                         mask=rows_ok & (ks + k + BLOCK_K < red_dim)[None, None, :],
                         other=0.0, eviction_policy=STREAM)
        acc = _down_chunk(acc, w, k, ks, red_dim, a_ptrs, slot_ok, s_ptrs, s_ok, W_SCALES,
                          SB, K_POW2, BLOCK_N, BLOCK_K, A_CACHE)
        w = w_next
    return acc


@triton.jit
def _down_store(acc, scale, s_ptrs, s_ok, out_row, cols, col_ok, W_SCALES: tl.constexpr):
    """Each expert's output (per-row scale with ``W_SCALES`` 1) rounded, weighed by its
    routing ``scale``, rounded, and the ``top_k`` summed in float32 into ``out_row``."""
    act_ty = out_row.dtype.element_ty
    y = tl.sum(acc, axis=2)  # (K_POW2, BLOCK_N)
    if W_SCALES == 1:
        y = y * tl.load(s_ptrs, mask=s_ok, other=0.0)
    y = y.to(act_ty).to(tl.float32) * scale[:, None]
    total = tl.sum(y.to(act_ty).to(tl.float32), axis=0)  # the empty slots add zeros
    tl.store(out_row + cols, total.to(act_ty), mask=col_ok)


@triton.jit
def gate_up_scale_ptrs(s_ptr, expert, stride_se, stride_sr, cols, n_cols,
                       W_SCALES: tl.constexpr, SB: tl.constexpr):
    """The scales of ``expert``'s gate rows ``cols`` and of the up rows ``n_cols`` below
    them: each row's block row (``scales.BLOCKS``; a reduction chunk lies in one block
    column), else each row's own (``scales.CHANNEL``; unread under ``scales.NONE``)."""
    if W_SCALES == 2:  # scales.BLOCKS
        sg_ptrs = s_ptr + expert * stride_se + (cols // SB) * stride_sr
        su_ptrs = s_ptr + expert * stride_se + ((cols + n_cols) // SB) * stride_sr
    else:
        sg_ptrs = s_ptr + expert * stride_se + cols
        su_ptrs = sg_ptrs + n_cols
    return sg_ptrs, su_ptrs
