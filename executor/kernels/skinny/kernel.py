# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""The skinny GEMM's two Triton kernels: ``x @ W.T`` for few rows, with an input op fused in.

``_skinny_gemm_kernel`` (classic): each program owns ``BLOCK_N`` output columns and streams
their weight rows in ``BLOCK_K`` chunks, reducing on the CUDA cores in float32.
``_skinny_row_kernel``: one row on a persistent grid; each program computes its input row
once, keeps it in registers and loops over column blocks with the next block's weight load
in flight. The input op (constexpr ``INPUT_OP``: ``PLAIN``, ``SILU_MUL``, ``RMS_NORM``,
``ADD_RMS_NORM``) rounds exactly as ``executor.kernels.activation`` and ``.norm`` do, so
the GEMM sees the unfused path's input. ``REDUCE`` = ``SEND`` stores the output row as
this rank's share of the push all-reduce's next call (``all_reduce.push_send``).
Launchers live in ``ops.py``; the why of each design is in ``docs/kernels.md``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from executor.kernels.all_reduce import push_next_region, push_send
from executor.kernels.cache_policy import STREAM
from executor.kernels.pdl import pdl_enter

# The input op (constexpr ``INPUT_OP``): what the kernel computes from its input rows
# before the product. The RMSNorm ones round like executor.kernels.norm.
PLAIN, SILU_MUL, RMS_NORM, ADD_RMS_NORM = 0, 1, 2, 3
# Where the output goes (constexpr ``REDUCE``): stored, or SENT as this rank's share of the
# all-reduce that ``push_all_reduce_kernel`` (``SENT``) completes (``ops.SendLane``).
NO_REDUCE, SEND = 0, 1
SEND_ = tl.constexpr(SEND)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # (M, K) rows, unit column stride; (M, 2K) gate|up for SILU_MUL
    res_ptr,  # (M, K) residual in (ADD_RMS_NORM)
    nw_ptr,  # (K,) RMSNorm weight (RMS_NORM, ADD_RMS_NORM)
    w_ptr,  # (N, K) row-major, as nn.Linear stores it
    out_ptr,  # (M, N)
    res_out_ptr,  # (M, K) x + residual out (ADD_RMS_NORM; program 0 writes it)
    M, N, K,
    stride_xm, stride_rm, stride_wn, stride_om, stride_rom,
    inv_k,  # 1 / K, for the norm's mean
    eps,
    red_ptr,  # SEND: (WORLD,) int64, every rank's lane buffer; else unused
    ctl_ptr,  # SEND: the lane's counters
    rank,  # this rank (SEND)
    slot_elems,  # SEND: elements per region
    INPUT_OP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_PASS: tl.constexpr,  # RMSNorm input ops: sum the squares in the product's pass
    REDUCE: tl.constexpr,  # NO_REDUCE (store the output) or SEND (into every rank's lane)
    WORLD: tl.constexpr,  # ranks (SEND)
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # (BLOCK_M, 1)
    r_rows = res_ptr + offs_m.to(tl.int64)[:, None] * stride_rm
    # The first weight chunk depends on nothing the step writes: it is in flight before
    # the wait for the previous kernel (under PDL, while that kernel finishes) and during
    # the norm's first pass.
    w_first = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & (offs_k < K)[None, :],
                      other=0.0, eviction_policy=STREAM)
    pdl_enter(USE_PDL)
    ro_rows = res_out_ptr + offs_m.to(tl.int64)[:, None] * stride_rom
    writes = mask_m & (offs_m * 0 + pid == 0)  # program 0 writes the new residual
    if ONE_PASS and INPUT_OP >= 2:
        acc = _one_pass_norm_product(x_rows, r_rows, ro_rows, writes, nw_ptr, w_rows, out_ptr,
                                     w_first, offs_k, mask_m, mask_n, K, inv_k, eps, INPUT_OP,
                                     BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        rstd = tl.zeros((BLOCK_M, 1), dtype=tl.float32)
        if INPUT_OP >= 2:  # RMSNorm: a first pass over the rows for their sums of squares
            ssq = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + offs_k
                s32 = _residual_sum(x_rows, r_rows, ro_rows, writes, out_ptr, ks, mask_m,
                                    ks < K, INPUT_OP).to(tl.float32)
                ssq += tl.sum(s32 * s32, axis=1)
            rstd = tl.math.rsqrt(ssq * inv_k + eps)[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _accumulate(acc, w_first, _input_chunk(x_rows, r_rows, nw_ptr, out_ptr, offs_k,
                                                     mask_m, offs_k < K, rstd, K, INPUT_OP),
                        BLOCK_M)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            ks = k0 + offs_k
            mask_k = ks < K
            w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                        eviction_policy=STREAM)
            acc = _accumulate(acc, w, _input_chunk(x_rows, r_rows, nw_ptr, out_ptr, ks, mask_m,
                                                   mask_k, rstd, K, INPUT_OP), BLOCK_M)
    if REDUCE == SEND_:
        push_send(acc.to(out_ptr.dtype.element_ty), offs_m[:, None] * N + offs_n[None, :],
                     mask_m[:, None] & mask_n[None, :], red_ptr,
                     push_next_region(ctl_ptr, rank, slot_elems, WORLD), WORLD)
    else:
        dst = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _one_pass_norm_product(x_rows, r_rows, ro_rows, writes, nw_ptr, w_rows, out_ptr, w_first,
                           offs_k, mask_m, mask_n, K, inv_k, eps, INPUT_OP: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
    """``rms_norm(s) @ W.T`` as ``rstd * ((s * nw) @ W.T)``: the norm's scale is one
    number per row, so it can wait until the sum of squares, gathered in the same pass
    over the input as the product, is complete. Each program reads its input rows once
    (the two-pass input op reads them twice); the normalized input is never rounded to
    the activation dtype, so the product is the float32 one, not the norm kernel's
    rounded output times ``W``."""
    acc, ssq = _one_pass_chunk(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),
                               tl.zeros((BLOCK_M,), dtype=tl.float32), w_first, x_rows, r_rows,
                               ro_rows, nw_ptr, out_ptr, offs_k, mask_m, offs_k < K, writes,
                               INPUT_OP, BLOCK_M)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                    eviction_policy=STREAM)
        acc, ssq = _one_pass_chunk(acc, ssq, w, x_rows, r_rows, ro_rows, nw_ptr, out_ptr, ks,
                                   mask_m, mask_k, writes, INPUT_OP, BLOCK_M)
    return acc * tl.math.rsqrt(ssq * inv_k + eps)[:, None]


@triton.jit
def _one_pass_chunk(acc, ssq, w, x_rows, r_rows, ro_rows, nw_ptr, out_ptr, ks, mask_m, mask_k,
                    writes, INPUT_OP: tl.constexpr, BLOCK_M: tl.constexpr):
    """One input chunk of ``_one_pass_norm_product``: its squares into ``ssq``, its
    weighted (not yet normalized) columns times ``w`` into ``acc``."""
    s32 = _residual_sum(x_rows, r_rows, ro_rows, writes, out_ptr, ks, mask_m, mask_k,
                        INPUT_OP).to(tl.float32)
    nw = tl.load(nw_ptr + ks, mask=mask_k, other=0.0).to(tl.float32)
    return _accumulate(acc, w, s32 * nw[None, :], BLOCK_M), ssq + tl.sum(s32 * s32, axis=1)


@triton.jit
def _residual_sum(x_rows, r_rows, ro_rows, writes, out_ptr, ks, mask_m, mask_k,
                  INPUT_OP: tl.constexpr, STORE: tl.constexpr = True):
    """Columns ``ks`` of the norm's input in the activation dtype: ``x``, or with a
    residual (ADD_RMS_NORM) ``x + residual`` rounded once (as HF does), which the ``writes``
    rows store as the new residual when ``STORE``."""
    x_mask = mask_m[:, None] & mask_k[None, :]
    s = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)
    if INPUT_OP == 3:
        r = tl.load(r_rows + ks[None, :], mask=x_mask, other=0.0)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
        if STORE:
            tl.store(ro_rows + ks[None, :], s, mask=writes[:, None] & mask_k[None, :])
    return s


@triton.jit
def _input_chunk(x_rows, r_rows, nw_ptr, out_ptr, ks, mask_m, mask_k, rstd, K,
                 INPUT_OP: tl.constexpr):
    """The input columns ``ks`` of every row, after the input op, in float32."""
    act_ty = out_ptr.dtype.element_ty
    x_mask = mask_m[:, None] & mask_k[None, :]
    if INPUT_OP == 1:  # silu(gate) * up, rounded like executor.kernels.activation
        g = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0).to(tl.float32)
        u = tl.load(x_rows + K + ks[None, :], mask=x_mask, other=0.0).to(tl.float32)
        act = tl.div_rn(g, 1.0 + tl.exp(-g)).to(act_ty).to(tl.float32)
        x = (act * u).to(act_ty).to(tl.float32)  # (BLOCK_M, BLOCK_K)
    elif INPUT_OP >= 2:  # weight * normalize(x [+ residual]), rounded like the norm kernel
        s = _residual_sum(x_rows, r_rows, r_rows, mask_m, out_ptr, ks, mask_m, mask_k,
                          INPUT_OP, STORE=False)  # (the first pass stored it)
        nw = tl.load(nw_ptr + ks, mask=mask_k, other=0.0).to(tl.float32)
        y = (s.to(tl.float32) * rstd).to(act_ty).to(tl.float32)
        x = (y * nw[None, :]).to(act_ty).to(tl.float32)
    else:
        x = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _accumulate(acc, w, x, BLOCK_M: tl.constexpr):
    """``acc += x @ w.T`` for one chunk, on the CUDA cores in float32."""
    if BLOCK_M == 1:
        acc += tl.sum(w.to(tl.float32) * x, axis=1)[None, :]
    else:
        acc += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _row_input(x_ptr, res_ptr, nw_ptr, res_out_ptr, offs_k, mask_k, K, inv_k, eps, pid,
               act_ty: tl.constexpr, INPUT_OP: tl.constexpr):
    """The input op's row (``BLOCK_K``,) in the activation dtype, rounded exactly as
    ``executor.kernels.activation`` and ``.norm`` round (the row kernels here and in
    ``executor.quant.row_kernel``). ADD_RMS_NORM: program 0 stores ``x + residual``."""
    if INPUT_OP == 1:  # silu(gate) * up
        g = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        a = tl.div_rn(g, 1.0 + tl.exp(-g)).to(act_ty).to(tl.float32)
        x = (a * u).to(act_ty)
    elif INPUT_OP >= 2:  # weight * normalize(x [+ residual])
        s = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0)
        if INPUT_OP == 3:
            r = tl.load(res_ptr + offs_k, mask=mask_k, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(act_ty)
            tl.store(res_out_ptr + offs_k, s, mask=mask_k & (offs_k * 0 + pid == 0))
        s32 = s.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(s32 * s32, axis=0) * inv_k + eps)
        nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        x = ((s32 * rstd).to(act_ty).to(tl.float32) * nw).to(act_ty)
    else:
        x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0)
    return x


@triton.jit
def _skinny_row_kernel(
    x_ptr,  # (1, K) row; (1, 2K) gate|up for SILU_MUL
    res_ptr,  # (1, K) residual in (ADD_RMS_NORM)
    nw_ptr,  # (K,) RMSNorm weight (RMS_NORM, ADD_RMS_NORM)
    w_ptr,  # (N, K) row-major
    out_ptr,  # (1, N)
    res_out_ptr,  # (1, K) x + residual out (ADD_RMS_NORM; program 0 writes it)
    N, K, stride_wn,
    inv_k, eps,
    red_ptr,  # SEND: (WORLD,) int64, every rank's lane buffer; else unused
    ctl_ptr,  # SEND: the lane's counters
    rank,
    slot_elems,  # SEND: elements per region
    INPUT_OP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= K: the whole input row
    REDUCE: tl.constexpr,  # NO_REDUCE or SEND
    WORLD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One row, a persistent grid (``RowTile``): each program computes the input op's
    row once and keeps it in registers, then takes column blocks ``pid``,
    ``pid + programs``, ... with the next block's weight load issued before the current
    block is reduced, so its weight stream has no gaps. The input op rounds exactly as the
    classic kernel's two-pass one (and the norm and SiLU kernels) do."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    offs_b = tl.arange(0, BLOCK_N)
    offs_n = pid * BLOCK_N + offs_b
    # The first block's weight depends on nothing the step writes: in flight before the
    # PDL wait, while the previous kernel finishes.
    w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                mask=(offs_n < N)[:, None] & mask_k[None, :], other=0.0, eviction_policy=STREAM)
    pdl_enter(USE_PDL)
    act_ty = out_ptr.dtype.element_ty
    x = _row_input(x_ptr, res_ptr, nw_ptr, res_out_ptr, offs_k, mask_k, K, inv_k, eps, pid,
                   act_ty, INPUT_OP).to(tl.float32)
    region = 0
    if REDUCE == SEND_:  # (the lane's counter: written by the all-reduce, after the wait)
        region = push_next_region(ctl_ptr, rank, slot_elems, WORLD)
    block = pid
    while block < tl.cdiv(N, BLOCK_N):
        offs_n = block * BLOCK_N + offs_b
        block += programs
        offs_next = block * BLOCK_N + offs_b  # past N: masked, nothing read
        w_next = tl.load(w_ptr + offs_next.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                         mask=(offs_next < N)[:, None] & mask_k[None, :], other=0.0,
                         eviction_policy=STREAM)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1).to(act_ty)
        if REDUCE == SEND_:
            push_send(acc, offs_n, offs_n < N, red_ptr, region, WORLD)
        else:
            tl.store(out_ptr + offs_n, acc, mask=offs_n < N)
        w = w_next
