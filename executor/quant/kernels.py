# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""Triton kernels of the FP8 projections.

``_w8a16_kernel``: ``x @ dequantize(W).T`` with ``x`` in bf16/fp16 and ``W`` read in FP8,
converted in registers (exactly: every e4m3 value is a bf16 value) and scaled per output
row or per 128x128 block. Each program owns ``BLOCK_N`` output columns of ``BLOCK_M`` rows
and streams its weight rows in ``BLOCK_K`` chunks; ``USE_DOT`` takes the tensor cores
(``tl.dot``, at least 16 rows), else the CUDA cores reduce in float32 as the bf16 skinny
GEMM does, with its input ops fused in (``INPUT_OP``: RMSNorm, residual-add + RMSNorm,
SiLU-and-mul, rounded as the unfused kernels round). Block scales multiply each 128-column
block's partial sums (a tensor-core chunk lies in one block; a wider CUDA-core chunk sums
per block first); row scales multiply the final sums. No split-K: the result is
deterministic. ``GLU`` (CUDA cores, and the row kernel in ``row_kernel.py``): the gated
epilogue of a fused gate|up weight (``_weight_rows``, ``_silu_mul_sums``): output column
``j`` of ``N`` is ``silu(gate_j) * up_j`` of weight rows ``j`` and ``j + N``, each sum
rounded as the plain GEMM stores it, then as ``silu_and_mul`` rounds.
``_act_quant_kernel``: rows to e4m3 with a per-row (dynamic) or one static scale, for
``torch._scaled_mm``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from executor.kernels.pdl import pdl_enter
from executor.kernels.skinny.kernel import _input_chunk, _residual_sum

# (constexpr: a jitted function reads only constexpr globals)
FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1e-12)


@triton.jit
def _w8a16_kernel(
    x_ptr,  # (M, K) activations, unit column stride; (M, 2K) gate|up for SILU_MUL
    res_ptr,  # (M, K) residual in (ADD_RMS_NORM)
    nw_ptr,  # (K,) RMSNorm weight (RMS_NORM, ADD_RMS_NORM)
    w_ptr,  # (N, K) e4m3, row-major; (2N, K) gate|up rows for GLU
    s_ptr,  # BLOCK_SCALES: (ceil(rows/SBN), ceil(K/SBK)) float32; else (rows,) float32
    out_ptr,  # (M, N)
    res_out_ptr,  # (M, K) x + residual out (ADD_RMS_NORM; program 0 writes it)
    M, N, K,  # N: output columns (half the weight rows for GLU)
    stride_xm, stride_rm, stride_wn, stride_om, stride_rom, stride_sn,
    inv_k, eps,  # the norm's 1 / K and epsilon
    SBN: tl.constexpr,  # scale block rows (BLOCK_SCALES)
    SBK: tl.constexpr,  # scale block columns (BLOCK_SCALES); a multiple of BLOCK_K
    BLOCK_SCALES: tl.constexpr,
    INPUT_OP: tl.constexpr,  # the bf16 skinny GEMM's input ops (not with USE_DOT)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    GLU: tl.constexpr,  # silu(gate) * up of each column's two weight rows (not USE_DOT)
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    # The weight rows this program reads: its BLOCK_N columns' (GLU: their gate and up
    # rows, interleaved, 2 * BLOCK_N), and whether each one's column is inside N.
    BLOCK_R: tl.constexpr = 2 * BLOCK_N if GLU else BLOCK_N
    offs_n, mask_n = _weight_rows(tl.arange(0, BLOCK_R), pid_n, N, BLOCK_N, GLU)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_R, 1)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # (BLOCK_M, 1)
    r_rows = res_ptr + offs_m.to(tl.int64)[:, None] * stride_rm
    act_ty = out_ptr.dtype.element_ty
    rstd = tl.zeros((BLOCK_M, 1), dtype=tl.float32)
    if INPUT_OP >= 2:  # RMSNorm: a first pass over the rows for their sums of squares
        ro_rows = res_out_ptr + offs_m.to(tl.int64)[:, None] * stride_rom
        writes = mask_m & (offs_m * 0 + pid_n == 0)  # program 0 writes the new residual
        ssq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            s32 = _residual_sum(x_rows, r_rows, ro_rows, writes, out_ptr, ks, mask_m, ks < K,
                                INPUT_OP).to(tl.float32)
            ssq += tl.sum(s32 * s32, axis=1)
        rstd = tl.math.rsqrt(ssq * inv_k + eps)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if USE_DOT:
            x = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            part = tl.dot(x, tl.trans(w.to(act_ty)))  # (BLOCK_M, BLOCK_R), float32
        else:
            x32 = _input_chunk(x_rows, r_rows, nw_ptr, out_ptr, ks, mask_m, mask_k, rstd, K,
                               INPUT_OP)  # (BLOCK_M, BLOCK_K) float32
            if BLOCK_SCALES and BLOCK_K > SBK:  # a chunk of several block columns
                part = _block_scaled_sums(x32, w.to(tl.float32), s_ptr, offs_n, mask_n, k0,
                                          K, stride_sn, SBN, SBK, BLOCK_M, BLOCK_R, BLOCK_K)
            elif BLOCK_M == 1:
                part = tl.sum(w.to(tl.float32) * x32, axis=1)[None, :]
            else:
                part = tl.sum(x32[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if BLOCK_SCALES and BLOCK_K <= SBK:  # the chunk lies in one block column
            s = tl.load(s_ptr + (offs_n // SBN) * stride_sn + k0 // SBK, mask=mask_n,
                        other=0.0)
            acc += part * s[None, :]
        else:  # row scales at the end; several block columns: scaled above
            acc += part
    if not BLOCK_SCALES:
        acc *= tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dst = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + cols[None, :]
    if GLU:  # (BLOCK_M, BLOCK_N, 2): each column's gate and up sums
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        y = _silu_mul_sums(gate, up, act_ty)
    else:
        y = acc.to(act_ty)
    tl.store(dst, y, mask=mask_m[:, None] & (cols < N)[None, :])


@triton.jit
def _weight_rows(offs_r, block, N, BLOCK_N: tl.constexpr, GLU: tl.constexpr):
    """The weight rows of column block ``block`` (``offs_r``: ``arange`` of ``BLOCK_N``,
    ``2 * BLOCK_N`` for GLU) and whether each row's output column is inside ``N``. GLU:
    column ``j``'s gate row ``j`` and up row ``j + N``, interleaved (gate, up, gate, ...),
    so a block's sums pair up along a last dimension of 2 (``tl.split``). The sums of
    ``2 * BLOCK_N`` rows reduce as the plain kernel's of a ``2 * BLOCK_N`` tile do."""
    if GLU:
        cols = block * BLOCK_N + offs_r // 2
        rows = cols + (offs_r % 2) * N
    else:
        cols = block * BLOCK_N + offs_r
        rows = cols
    return rows, cols < N


@triton.jit
def _silu_mul_sums(gate, up, act_ty: tl.constexpr):
    """``silu(gate) * up`` of float32 GEMM sums: each sum rounded to the activation dtype
    as the plain GEMM stores it, then SiLU and the product rounded as
    ``executor.kernels.activation.silu_and_mul`` rounds them (its division ``div_rn``)."""
    g = gate.to(act_ty).to(tl.float32)
    u = up.to(act_ty).to(tl.float32)
    a = tl.div_rn(g, 1.0 + tl.exp(-g)).to(act_ty).to(tl.float32)
    return (a * u).to(act_ty)


@triton.jit
def _block_scaled_sums(x32, w32, s_ptr, offs_n, mask_n, k0, K, stride_sn, SBN: tl.constexpr,
                       SBK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """``x32 @ (w32 * scales).T`` for a chunk spanning ``BLOCK_K / SBK`` block columns:
    each block's products summed, times its scale, then summed (BLOCK_M, BLOCK_N)."""
    NB: tl.constexpr = BLOCK_K // SBK
    blocks = k0 // SBK + tl.arange(0, NB)
    s = tl.load(s_ptr + (offs_n // SBN)[:, None] * stride_sn + blocks[None, :],
                mask=mask_n[:, None] & (blocks < tl.cdiv(K, SBK))[None, :],
                other=0.0)  # (BLOCK_N, NB)
    if BLOCK_M == 1:
        per_block = tl.sum(tl.reshape(w32 * x32, (BLOCK_N, NB, SBK)), axis=2)
        return tl.sum(per_block * s, axis=1)[None, :]
    prod = x32[:, None, :] * w32[None, :, :]  # (BLOCK_M, BLOCK_N, BLOCK_K)
    per_block = tl.sum(tl.reshape(prod, (BLOCK_M, BLOCK_N, NB, SBK)), axis=3)
    return tl.sum(per_block * s[None, :, :], axis=2)


@triton.jit
def _act_quant_kernel(
    x_ptr,  # (M, K), unit column stride
    q_ptr,  # (M, K) e4m3 out
    s_ptr,  # (M, 1) float32 out: the scale each row was divided by
    static_ptr,  # STATIC: (1,) float32 scale for every row
    K, stride_x, stride_q,
    STATIC: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            v = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
        # (div_rn: correctly rounded, as torch divides; Triton's ``/`` may not be)
        scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        v = tl.load(x_ptr + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(v, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)
