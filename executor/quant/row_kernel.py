# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""The FP8 persistent row kernel: ``x @ dequantize(W).T`` for one bf16/fp16 row.

The FP8 twin of the bf16 skinny GEMM's ``_skinny_row_kernel``: a persistent grid
(``Fp8RowTile``); each program computes its input row once (the input op fused, rounded as
the unfused kernels round) and keeps it in registers, then takes column blocks ``pid``,
``pid + programs``, ... keeping the e4m3 weight stream gapless: ``STAGES`` 0 issues the
next block's load into registers before the current block is reduced; ``STAGES`` >= 2
lets Triton's pipeliner keep that many blocks in flight through shared memory (more bytes
in flight per SM than registers hold). A block is ``BLOCK_N`` whole weight rows, read with
16-byte loads (16 e4m3 values), converted in registers (exactly: every e4m3 value is a
bf16 value), summed in float32 and scaled per output row, or per 128x128 block (each
block's partial sum times its scale). One rounding to the activation dtype at the end; no
split-K, so results are deterministic. ``GLU``: a block is ``BLOCK_N`` output columns of a
fused gate|up weight, their ``2 * BLOCK_N`` gate and up rows interleaved
(``kernels._weight_rows``), and each column stores ``silu(gate) * up``
(``kernels._silu_mul_sums``): the plain kernel's sums of a ``2 * BLOCK_N`` block, rounded
as it stores them, then as ``silu_and_mul`` rounds. ``LATE_TRIGGER`` (a plain input: o_proj,
and down_proj after the gated epilogue): the next kernel launches only after this grid's
main loop, so the persistent launch that follows (gate_up, the next layer's qkv) finds its
SMs free rather than parking part of its grid beside this one. ``HALF`` (sm_89 and later):
the row scaled by a power of two and the products formed and summed in f16 pairs, 16
columns at a time, before the float32 sums (``_half_pairs``, ``_chunk_sums``); fewer
instructions and registers than float32 products, within the FP8 paths' stated error.
"""

from __future__ import annotations

import triton
import triton.language as tl

from executor.kernels.cache_policy import STREAM
from executor.kernels.pdl import pdl_enter, pdl_trigger, pdl_wait
from executor.kernels.skinny.kernel import _row_input
from executor.quant.kernels import _silu_mul_sums, _weight_rows


@triton.jit
def _w8a16_row_kernel(
    x_ptr,  # (1, K) row; (1, 2K) gate|up for SILU_MUL
    res_ptr,  # (1, K) residual in (ADD_RMS_NORM)
    nw_ptr,  # (K,) RMSNorm weight (RMS_NORM, ADD_RMS_NORM)
    w_ptr,  # (N, K) e4m3, row-major; (2N, K) gate|up rows for GLU
    s_ptr,  # BLOCK_SCALES: (ceil(rows/SBN), ceil(K/SBK)) float32; else (rows,) float32
    out_ptr,  # (1, N)
    res_out_ptr,  # (1, K) x + residual out (ADD_RMS_NORM; program 0 writes it)
    N, K, stride_wn, stride_sn,  # N: output columns (half the weight rows for GLU)
    # (stride_wn: in bytes; HALF: in 4-byte words)
    inv_k, eps,  # the norm's 1 / K and epsilon
    SBN: tl.constexpr,  # scale block rows (BLOCK_SCALES)
    SBK: tl.constexpr,  # scale block columns (BLOCK_SCALES); a power of two <= BLOCK_K
    BLOCK_SCALES: tl.constexpr,
    INPUT_OP: tl.constexpr,  # PLAIN, SILU_MUL, RMS_NORM, ADD_RMS_NORM
    BLOCK_N: tl.constexpr,  # output columns per block
    BLOCK_K: tl.constexpr,  # >= K: the whole input row
    USE_PDL: tl.constexpr,
    STAGES: tl.constexpr,  # 0: next block prefetched in registers; >= 2: Triton's pipeline
    GLU: tl.constexpr,  # silu(gate) * up of each column's gate and up rows
    LATE_TRIGGER: tl.constexpr = False,  # the successor launches after the main loop
    HALF: tl.constexpr = False,  # products in f16 pairs (K a multiple of 16; sm_89+)
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    # The first block's weight and scales depend on nothing the step writes: in flight
    # before the PDL wait, while the previous kernel finishes.
    w, s = _load_block(w_ptr, s_ptr, pid, N, K, stride_wn, stride_sn, SBN, SBK, BLOCK_N,
                       BLOCK_K, BLOCK_SCALES, GLU, HALF)
    if LATE_TRIGGER:
        pdl_wait(USE_PDL)
    else:
        pdl_enter(USE_PDL)
    act_ty = out_ptr.dtype.element_ty
    x = _row_input(x_ptr, res_ptr, nw_ptr, res_out_ptr, offs_k, mask_k, K, inv_k, eps, pid,
                   act_ty, INPUT_OP)  # (BLOCK_K,) activation dtype
    if HALF:  # the row as each 16-column chunk's eight f16 pairs, and 1 / s
        x = _half_pairs(x, BLOCK_K)
    n_blocks = tl.cdiv(N, BLOCK_N)
    if STAGES == 0:  # the next block's load in registers before this block's sums
        block = pid
        while block < n_blocks:
            this = block
            block += programs
            w_next, s_next = _load_block(w_ptr, s_ptr, block, N, K, stride_wn, stride_sn,
                                         SBN, SBK, BLOCK_N, BLOCK_K, BLOCK_SCALES, GLU, HALF)
            _block_out(w, s, x, this, N, out_ptr, BLOCK_N, BLOCK_K, SBK, BLOCK_SCALES, GLU,
                       HALF)
            w = w_next
            s = s_next
        if LATE_TRIGGER:
            pdl_trigger(USE_PDL)
    else:  # the other blocks through shared memory, STAGES deep, then the first one
        # (its weight, loaded before the wait, waits in registers: the pipeline's first
        # loads go out as soon as the input row is ready)
        for block in tl.range(pid + programs, n_blocks, programs, num_stages=STAGES):
            w_b, s_b = _load_block(w_ptr, s_ptr, block, N, K, stride_wn, stride_sn, SBN, SBK,
                                   BLOCK_N, BLOCK_K, BLOCK_SCALES, GLU, HALF)
            _block_out(w_b, s_b, x, block, N, out_ptr, BLOCK_N, BLOCK_K, SBK, BLOCK_SCALES,
                       GLU, HALF)
        if LATE_TRIGGER:
            pdl_trigger(USE_PDL)
        _block_out(w, s, x, pid, N, out_ptr, BLOCK_N, BLOCK_K, SBK, BLOCK_SCALES, GLU,
                   HALF)


@triton.jit
def _block_out(w, s, x, block, N, out_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               SBK: tl.constexpr, BLOCK_SCALES: tl.constexpr, GLU: tl.constexpr,
               HALF: tl.constexpr):
    """Output columns of block ``block``: the float32 sums of ``w`` (BLOCK_R, BLOCK_K) e4m3
    times the row ``x``, scaled by ``s`` (per block column, or per row after the sums),
    rounded once to the activation dtype; GLU: the row pairs' ``silu(gate) * up``. HALF:
    ``w`` is (BLOCK_R, BLOCK_K // 4) words, ``x`` the ``_half_pairs`` of the row, and the
    products of each 16-column chunk are summed in f16 pairs first (``_chunk_sums``)."""
    BLOCK_R: tl.constexpr = 2 * BLOCK_N if GLU else BLOCK_N
    CHUNK: tl.constexpr = 16 if HALF else 1  # columns per partial sum in ``prod``
    if HALF:
        prod = _chunk_sums(w, x, BLOCK_R, BLOCK_K)  # (BLOCK_R, BLOCK_K // 16)
    else:
        prod = w.to(tl.float32) * x.to(tl.float32)[None, :]  # (BLOCK_R, BLOCK_K)
    if BLOCK_SCALES:  # each block column's sum times its scale
        per_block = tl.sum(tl.reshape(prod, (BLOCK_R, BLOCK_K // SBK, SBK // CHUNK)),
                           axis=2)
        acc = tl.sum(per_block * s, axis=1)
    else:
        acc = tl.sum(prod, axis=1) * s
    if HALF:
        acc = acc * x[8]  # 1 / s
    act_ty = out_ptr.dtype.element_ty
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    if GLU:  # (BLOCK_N, 2): each column's gate and up sums
        gate, up = tl.split(tl.reshape(acc, (BLOCK_N, 2)))
        y = _silu_mul_sums(gate, up, act_ty)
    else:
        y = acc.to(act_ty)
    tl.store(out_ptr + offs_n, y, mask=offs_n < N)


@triton.jit
def _load_block(w_ptr, s_ptr, block, N, K, stride_wn, stride_sn, SBN: tl.constexpr,
                SBK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_SCALES: tl.constexpr, GLU: tl.constexpr, HALF: tl.constexpr):
    """Column block ``block``'s weight rows, (BLOCK_R, BLOCK_K) e4m3 or (HALF) (BLOCK_R,
    BLOCK_K // 4) int32 words of four, and their scales (``_scales``); rows past ``N``
    masked, nothing read."""
    BLOCK_R: tl.constexpr = 2 * BLOCK_N if GLU else BLOCK_N
    rows, live = _weight_rows(tl.arange(0, BLOCK_R), block, N, BLOCK_N, GLU)
    if HALF:
        ptr = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        offs = tl.arange(0, BLOCK_K // 4)
        cols_ok = offs < K // 4
    else:
        ptr = w_ptr
        offs = tl.arange(0, BLOCK_K)
        cols_ok = offs < K
    w = tl.load(ptr + rows.to(tl.int64)[:, None] * stride_wn + offs[None, :],
                mask=live[:, None] & cols_ok[None, :], other=0.0, eviction_policy=STREAM)
    kb = tl.arange(0, BLOCK_K // SBK)  # the row's scale block columns (BLOCK_SCALES)
    return w, _scales(s_ptr, rows, live, kb, K, stride_sn, SBN, SBK, BLOCK_SCALES)


@triton.jit
def _scales(s_ptr, rows, live, kb, K, stride_sn, SBN: tl.constexpr, SBK: tl.constexpr,
            BLOCK_SCALES: tl.constexpr):
    """The scales of weight rows ``rows``: (BLOCK_R, BLOCK_K // SBK) block scales, or
    (BLOCK_R,) row scales; 0 where not ``live`` and past the row's last block column."""
    if BLOCK_SCALES:
        s = tl.load(s_ptr + (rows // SBN)[:, None] * stride_sn + kb[None, :],
                    mask=live[:, None] & (kb < tl.cdiv(K, SBK))[None, :], other=0.0)
    else:
        s = tl.load(s_ptr + rows, mask=live, other=0.0)
    return s


@triton.jit
def _half_pairs(x, BLOCK_K: tl.constexpr):
    """The row ``x`` (BLOCK_K,) as f16 pairs for ``_chunk_sums``: scaled by a power of two
    ``s`` that brings its largest magnitude into [8, 16) (exact: a bf16 or fp16 value times
    a power of two is an f16 value, subnormals aside), packed two to an int32, and dealt
    into the eight pairs of each 16-column chunk: ``p[j][g]`` holds elements ``16 g + 2 j``
    and ``16 g + 2 j + 1``. Returns ``(p0, ..., p7, 1 / s)``."""
    xf = x.to(tl.float32)
    amax = tl.max(tl.abs(xf), axis=0)
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of the largest
    # s = 2^(3 - (e - 127)), kept where it and 1 / s are normal float32 powers of two
    field = tl.minimum(tl.maximum(257 - e, 1), 253)
    s = (field << 23).to(tl.float32, bitcast=True)
    inv_s = ((254 - field) << 23).to(tl.float32, bitcast=True)
    bits = (xf * s).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    lo, hi = tl.split(tl.reshape(bits, (BLOCK_K // 2, 2)))
    # pair j = 4a + 2b + c of chunk g at [g, a, b, c]
    c0, c1 = tl.split(tl.reshape(lo | (hi << 16), (BLOCK_K // 16, 2, 2, 2)))
    b0c0, b1c0 = tl.split(c0)
    b0c1, b1c1 = tl.split(c1)
    p0, p4 = tl.split(b0c0)
    p2, p6 = tl.split(b1c0)
    p1, p5 = tl.split(b0c1)
    p3, p7 = tl.split(b1c1)
    return p0, p1, p2, p3, p4, p5, p6, p7, inv_s


def _chunk_ptx() -> str:
    """``_chunk_sums``' PTX: words ``$1``-``$4``; word m's low two bytes times pair
    ``$(5 + 2m)``, its high two times ``$(6 + 2m)``, into one f16x2 sum; ``$0`` its halves'
    float32 sum."""
    lines = [".reg .b16 lo, hi;", ".reg .b32 a, c;", ".reg .f16 p, q;", ".reg .f32 u, v;"]
    for m in range(4):
        lines.append(f"mov.b32 {{lo, hi}}, ${1 + m};")
        for half, pair in (("lo", 5 + 2 * m), ("hi", 6 + 2 * m)):
            lines.append(f"cvt.rn.f16x2.e4m3x2 a, {half};")
            first = m == 0 and half == "lo"
            lines.append(f"mul.rn.f16x2 c, a, ${pair};" if first
                         else f"fma.rn.f16x2 c, a, ${pair}, c;")
    lines += ["mov.b32 {p, q}, c;", "cvt.f32.f16 u, p;", "cvt.f32.f16 v, q;",
              "add.f32 $0, u, v;"]
    return "{\n" + "\n".join(lines) + "\n}"


# (constexpr: a jitted function reads only constexpr globals)
_CHUNK_PTX = tl.constexpr(_chunk_ptx())
_CHUNK_CONSTRAINTS = tl.constexpr("=f," + ",".join(["r"] * 12))  # f32 out; 4 words, 8 pairs


@triton.jit
def _chunk_words(w, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """``w`` (BLOCK_R, BLOCK_K // 4) words dealt into each 16-column chunk's four:
    ``w[m][r, g]`` is word ``4 g + m`` of row ``r`` (a register split: a thread's 16-byte
    load holds a chunk)."""
    # word m = 2a + b of chunk g at [r, g, a, b]
    b0, b1 = tl.split(tl.reshape(w, (BLOCK_R, BLOCK_K // 16, 2, 2)))
    w0, w2 = tl.split(b0)
    w1, w3 = tl.split(b1)
    return w0, w1, w2, w3


@triton.jit
def _chunk_sums(w, x, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per 16-column chunk of each weight row of ``w`` (BLOCK_R, BLOCK_K // 4) int32 words
    of four e4m3 values: the sum of its 16 products with the row's ``_half_pairs`` ``x``,
    in float32 (BLOCK_R, BLOCK_K // 16). The products are formed and summed in f16 pairs
    (``cvt.rn.f16x2.e4m3x2`` is exact; one ``mul`` and seven ``fma`` on f16x2, so each half
    sums eight products, at most 8 x 448 x 16 = 57344: no overflow), the two halves added
    in float32: about 1.25 instructions a weight, against 2.5 for float32 products."""
    w0, w1, w2, w3 = _chunk_words(w, BLOCK_R, BLOCK_K)
    p0, p1, p2, p3, p4, p5, p6, p7, _ = x
    return tl.inline_asm_elementwise(
        asm=_CHUNK_PTX,
        constraints=_CHUNK_CONSTRAINTS,
        args=[w0, w1, w2, w3, p0[None, :], p1[None, :], p2[None, :], p3[None, :],
              p4[None, :], p5[None, :], p6[None, :], p7[None, :]],
        dtype=tl.float32, is_pure=True, pack=1)
