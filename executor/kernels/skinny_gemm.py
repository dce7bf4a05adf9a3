# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""Skinny GEMM for decode: ``x @ W.T`` with few rows (``M <= MAX_ROWS``), optionally with
SiLU-and-mul fused into its input.

At batch 1 a decoder layer's projections are matrix-vector products that only stream the
weight once; cuBLAS picks tensor-core tiles (and split-K with a second reduce kernel for the
down projection) that reached 1.3-2.6 TB/s on an H100 for the Llama-3.2-1B shapes. Here
each program owns ``BLOCK_N`` output columns, reads their weight rows ``(BLOCK_N, K)`` in
``BLOCK_K`` chunks with 16-byte loads and reduces on the CUDA cores in float32. There is no
split-K: every output is summed by one program in a fixed order, so results are
deterministic (the order, hence the last bit, may differ between batch sizes, as cuBLAS's
kernel choice does).

``SILU_MUL``: the input is the fused gate/up output ``(M, 2K)`` and each chunk of
``silu(gate) * up`` is computed as it is loaded, rounded exactly as
``executor.kernels.activation`` rounds it (so the GEMM sees the same input as the unfused
path): one launch instead of SiLU-and-mul, the down GEMM and its split-K reduce.

RMSNorm prologues: the input is the residual stream before its norm, ``x`` (and the
residual to add): each program first sums the squares of its rows (L2-resident), then
normalizes each chunk as it loads it, rounded exactly as ``executor.kernels.norm`` rounds;
program 0 also writes the new residual ``x + residual``. One launch instead of the norm
kernel and the GEMM (the qkv and gate_up projections follow a norm). Tiles with
``one_pass`` read the input once instead: the sum of squares is gathered in the product's
pass and the norm's scale, one number per row, multiplies the finished dot products
(the normalized input is then the float32 one, not rounded to the activation dtype).
Measured on an H100 it won only on small shapes (SmolLM2-135M's), where the tuned tiles
use it (``bench/results/2026-11-26-h100-one-pass-tiles``), and on an H200 at K = 8192 (the
70B's per-rank qkv and gate_up at TP = 4, ``bench/results/2026-11-26-h200-70b-tp4-tiles``).

Where a GPU's sweep found the unfused path (the norm or SiLU kernel, then cuBLAS) at
least 5 % faster than the best tile (``CUBLAS_MARGIN``), ``linear`` and its fused twins
leave that shape to it on that GPU (``cublas_faster``): so far only the 70B's per-rank
down projection at TP = 4 on an H200 (34.6 against 38.2 us).

Tensor parallelism (``REDUCE``, ``ReduceSite``; ``--tp-fuse-all-reduce on``, off by
default): a row-parallel projection may PUSH its output row into every rank's reduce
buffer instead of storing it (``push_linear``: each program stores its columns there,
arrives on a counter, and the last one flags the call in every buffer), and the pre-norm
projection after it may GATHER its input as the sum of those slices (``gather_norm_linear``:
it waits for every rank's flag, then sums in float32 in rank order, as our all-reduce
kernel does, so the outputs are the same bits). Measured slower than the all-reduce
kernel between two plain launches (``executor.distributed.group``). SEND (on by default
where the push all-reduce takes the row): a row-parallel projection stores its output
row as this rank's share of the push all-reduce's next call in every rank's lane buffer
(``send_linear``, ``all_reduce.lamport_send``), and that kernel, launched next, only sums.

The row kernel (``_skinny_row_kernel``, ``RowTile``): one row on a persistent grid of a
few programs per SM. Each program computes its input row once (the norm or SiLU-and-mul
prologue, rounded as above) and keeps it in registers, then reduces column block after
column block with the next block's weight load already in flight. The classic kernel
computes the prologue again in every program, one per few output columns (the two-pass
norm reads the input row twice each time) and its weight stream pauses at each program's
start. It takes one-row launches with ``K`` in ``ROW_KERNEL_K`` by default where each
program of a full grid gets at least ``ROW_KERNEL_MIN_BLOCKS`` column blocks
(``row_tile``): on an H100 the 1B's batch-1 decode went 1.114-1.115 -> 1.073-1.074 ms
(gate_up and down on it, qkv and o_proj not) and the 8B's 5.429 -> 5.354 ms (every
projection but down, whose K is 14336): ``bench/results/2026-11-27-h100-row-rule``.
A row-parallel projection sending into the push all-reduce takes it by the same rule
(``ROW_KERNEL_REDUCE``; at TP = 2 the 8B's down_proj, whose K per rank is 7168).

Numerics: float32 products and sums of the activation-dtype inputs, one rounding at the
end, like cuBLAS; the summation order differs, so outputs can differ from ``F.linear``
by an ulp of the activation dtype.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from executor.kernels import switches
from executor.kernels.all_reduce import (
    lamport_next_region,
    lamport_send,
    load_acquire,
    store_release,
)
from executor.kernels.fast_launch import FastLauncher, cdiv, next_power_of_2
from executor.kernels.pdl import pdl_enter

# Rows up to which the skinny kernel serves; more rows go to cuBLAS. Measured on an H100
# (1B shape, bench.skinny_gemm): ahead of cuBLAS at M = 1, behind it from M = 2 (the CUDA
# cores do M products per weight element).
MAX_ROWS = 1


# The input prologue (constexpr ``PROLOGUE``): what the kernel computes from its input
# rows before the product. The RMSNorm ones round like executor.kernels.norm.
PLAIN, SILU_MUL, RMS_NORM, ADD_RMS_NORM = 0, 1, 2, 3
# Where the output goes and the input comes from under tensor parallelism (constexpr
# ``REDUCE``, ``ReduceSite``): a row-parallel projection PUSHes its partial output into
# every rank's reduce buffer; the pre-norm projection after it GATHERs the sum.
# SEND: a row-parallel projection stores its partial output as this rank's share of the
# all-reduce that ``lamport_all_reduce_kernel`` (``SENT``) completes (``SendLane``).
NO_REDUCE, PUSH, GATHER, SEND = 0, 1, 2, 3
PUSH_ = tl.constexpr(PUSH)
GATHER_ = tl.constexpr(GATHER)
SEND_ = tl.constexpr(SEND)
#: Bytes of a site's arrival flags (int32 per source rank) before its two data slots.
SITE_FLAG_BYTES = 128
_SITE_FLAG_BYTES = tl.constexpr(SITE_FLAG_BYTES)


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
    red_ptr,  # (WORLD,) int64: every rank's reduce buffer (REDUCE); else unused
    ctl_ptr,  # (2,) int32, this rank's [arrivals, epoch] of the reduce site (PUSH,
    # GATHER); SEND: the lane's counters
    rank,  # this rank (REDUCE)
    site_off,  # bytes from a reduce buffer's start to the site's flags (PUSH, GATHER)
    slot_bytes,  # bytes per data slot of the site (PUSH, GATHER); SEND: elements per region
    PROLOGUE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_PASS: tl.constexpr,  # RMSNorm prologues: sum the squares in the product's pass
    REDUCE: tl.constexpr,  # NO_REDUCE, PUSH (the output to every rank), GATHER (the
    # input) or SEND (the output to every rank's all-reduce lane)
    WORLD: tl.constexpr,  # ranks (REDUCE)
    SLICES: tl.constexpr,  # WORLD under GATHER, else 1
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
                      other=0.0)
    pdl_enter(USE_PDL)
    if REDUCE == GATHER_:  # the input is the sum of the slices every rank pushed
        x_rows = _gathered_rows(red_ptr, ctl_ptr, rank, site_off, slot_bytes, offs_m,
                                out_ptr.dtype.element_ty, WORLD)
    ro_rows = res_out_ptr + offs_m.to(tl.int64)[:, None] * stride_rom
    writes = mask_m & (offs_m * 0 + pid == 0)  # program 0 writes the new residual
    if ONE_PASS and PROLOGUE >= 2:
        acc = _one_pass_norm_product(x_rows, r_rows, ro_rows, writes, nw_ptr, w_rows, out_ptr,
                                     w_first, offs_k, mask_m, mask_n, K, inv_k, eps, PROLOGUE,
                                     BLOCK_M, BLOCK_N, BLOCK_K, SLICES)
    else:
        rstd = tl.zeros((BLOCK_M, 1), dtype=tl.float32)
        if PROLOGUE >= 2:  # RMSNorm: a first pass over the rows for their sums of squares
            ssq = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + offs_k
                s32 = _residual_sum(x_rows, r_rows, ro_rows, writes, out_ptr, ks, mask_m,
                                    ks < K, K, PROLOGUE, SLICES).to(tl.float32)
                ssq += tl.sum(s32 * s32, axis=1)
            rstd = tl.math.rsqrt(ssq * inv_k + eps)[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _accumulate(acc, w_first, _input_chunk(x_rows, r_rows, nw_ptr, out_ptr, offs_k,
                                                     mask_m, offs_k < K, rstd, K, PROLOGUE,
                                                     SLICES), BLOCK_M)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            ks = k0 + offs_k
            mask_k = ks < K
            w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            acc = _accumulate(acc, w, _input_chunk(x_rows, r_rows, nw_ptr, out_ptr, ks, mask_m,
                                                   mask_k, rstd, K, PROLOGUE, SLICES), BLOCK_M)
    if REDUCE == PUSH_:
        _push(acc.to(out_ptr.dtype.element_ty), red_ptr, ctl_ptr, rank, site_off, slot_bytes,
              offs_n, mask_m[:, None] & mask_n[None, :], N, WORLD)
    elif REDUCE == SEND_:
        lamport_send(acc.to(out_ptr.dtype.element_ty), offs_m[:, None] * N + offs_n[None, :],
                     mask_m[:, None] & mask_n[None, :], red_ptr,
                     lamport_next_region(ctl_ptr, rank, slot_bytes, WORLD), WORLD)
    else:
        dst = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _gathered_rows(red_ptr, ctl_ptr, rank, site_off, slot_bytes, offs_m, elem: tl.constexpr,
                   WORLD: tl.constexpr):
    """GATHER: wait until every rank has pushed this call's slice into this rank's buffer
    and return the first slice's rows (the others follow, ``K`` apart). The call's epoch
    is what this rank's PUSH, the previous kernel, recorded (complete: the PDL wait)."""
    epoch = tl.load(ctl_ptr + 1)
    mine = tl.load(red_ptr + rank)
    flags = (mine + site_off).to(tl.pointer_type(tl.int32)) + tl.arange(0, WORLD)
    while tl.min(load_acquire(flags) - epoch, axis=0) < 0:  # wrapping difference
        pass
    tl.debug_barrier()
    data = mine + site_off + _SITE_FLAG_BYTES + (epoch & 1).to(tl.int64) * slot_bytes
    return tl.multiple_of(data.to(tl.pointer_type(elem)), 16) + offs_m[:, None] * 0


@triton.jit
def _push(val, red_ptr, ctl_ptr, rank, site_off, slot_bytes, offs_n, mask, N,
          WORLD: tl.constexpr):
    """PUSH: store this program's outputs ``val`` (1, BLOCK_N) as this rank's slice in
    every rank's buffer (slot of the call's epoch parity), then arrive; the last program
    to arrive records the epoch here and flags it, with release semantics at system scope,
    in every rank's buffer."""
    epoch = tl.load(ctl_ptr + 1) + 1  # this site's calls so far, this one included
    data = site_off + _SITE_FLAG_BYTES + (epoch & 1).to(tl.int64) * slot_bytes
    for r in tl.static_range(WORLD):
        dst = tl.multiple_of((tl.load(red_ptr + r) + data).to(
            tl.pointer_type(val.dtype)), 16) + rank * N
        tl.store(dst + offs_n[None, :], val, mask=mask)
    tl.debug_barrier()  # every thread's stores, before the program's arrival releases them
    # (System scope: the stores went to other GPUs too. gpu scope, which the last
    # program's system-scope release should make enough, measured no faster: 96dcb80.)
    arrived = tl.atomic_add(ctl_ptr, 1, sem="acq_rel", scope="sys")
    if arrived == tl.num_programs(0) - 1:  # the last program: every slice is out
        tl.store(ctl_ptr, 0)  # (the next call's programs start after this grid ends)
        tl.store(ctl_ptr + 1, epoch)
        ranks = tl.arange(0, WORLD)
        flags = (tl.load(red_ptr + ranks) + site_off).to(tl.pointer_type(tl.int32)) + rank
        store_release(flags, epoch + ranks * 0)


@triton.jit
def _one_pass_norm_product(x_rows, r_rows, ro_rows, writes, nw_ptr, w_rows, out_ptr, w_first,
                           offs_k, mask_m, mask_n, K, inv_k, eps, PROLOGUE: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, SLICES: tl.constexpr):
    """``rms_norm(s) @ W.T`` as ``rstd * ((s * nw) @ W.T)``: the norm's scale is one
    number per row, so it can wait until the sum of squares, gathered in the same pass
    over the input as the product, is complete. Each program reads its input rows once
    (the two-pass prologue reads them twice); the normalized input is never rounded to
    the activation dtype, so the product is the float32 one, not the norm kernel's
    rounded output times ``W``."""
    acc, ssq = _one_pass_chunk(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),
                               tl.zeros((BLOCK_M,), dtype=tl.float32), w_first, x_rows, r_rows,
                               ro_rows, nw_ptr, out_ptr, offs_k, mask_m, offs_k < K, writes,
                               K, PROLOGUE, BLOCK_M, SLICES)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc, ssq = _one_pass_chunk(acc, ssq, w, x_rows, r_rows, ro_rows, nw_ptr, out_ptr, ks,
                                   mask_m, mask_k, writes, K, PROLOGUE, BLOCK_M, SLICES)
    return acc * tl.math.rsqrt(ssq * inv_k + eps)[:, None]


@triton.jit
def _one_pass_chunk(acc, ssq, w, x_rows, r_rows, ro_rows, nw_ptr, out_ptr, ks, mask_m, mask_k,
                    writes, K, PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr,
                    SLICES: tl.constexpr):
    """One input chunk of ``_one_pass_norm_product``: its squares into ``ssq``, its
    weighted (not yet normalized) columns times ``w`` into ``acc``."""
    s32 = _residual_sum(x_rows, r_rows, ro_rows, writes, out_ptr, ks, mask_m, mask_k, K,
                        PROLOGUE, SLICES).to(tl.float32)
    nw = tl.load(nw_ptr + ks, mask=mask_k, other=0.0).to(tl.float32)
    return _accumulate(acc, w, s32 * nw[None, :], BLOCK_M), ssq + tl.sum(s32 * s32, axis=1)


@triton.jit
def _residual_sum(x_rows, r_rows, ro_rows, writes, out_ptr, ks, mask_m, mask_k, K,
                  PROLOGUE: tl.constexpr, SLICES: tl.constexpr, STORE: tl.constexpr = True):
    """Columns ``ks`` of the norm's input in the activation dtype: ``x``, or with a
    residual (ADD_RMS_NORM) ``x + residual`` rounded once (as HF does), which the ``writes``
    rows store as the new residual when ``STORE``. With ``SLICES`` > 1 (GATHER), ``x`` is
    the sum of that many slices ``K`` apart, in float32 in slice (rank) order and rounded
    once, as the all-reduce kernel sums."""
    x_mask = mask_m[:, None] & mask_k[None, :]
    if SLICES > 1:  # (read after the flags' acquire: plain loads see the peers' writes)
        s32 = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0).to(tl.float32)
        for r in tl.static_range(1, SLICES):
            s32 += tl.load(x_rows + r * K + ks[None, :], mask=x_mask,
                           other=0.0).to(tl.float32)
        s = s32.to(out_ptr.dtype.element_ty)
    else:
        s = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)
    if PROLOGUE == 3:
        r = tl.load(r_rows + ks[None, :], mask=x_mask, other=0.0)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
        if STORE:
            tl.store(ro_rows + ks[None, :], s, mask=writes[:, None] & mask_k[None, :])
    return s


@triton.jit
def _input_chunk(x_rows, r_rows, nw_ptr, out_ptr, ks, mask_m, mask_k, rstd, K,
                 PROLOGUE: tl.constexpr, SLICES: tl.constexpr):
    """The input columns ``ks`` of every row, after the prologue, in float32."""
    act_ty = out_ptr.dtype.element_ty
    x_mask = mask_m[:, None] & mask_k[None, :]
    if PROLOGUE == 1:  # silu(gate) * up, rounded like executor.kernels.activation
        g = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0).to(tl.float32)
        u = tl.load(x_rows + K + ks[None, :], mask=x_mask, other=0.0).to(tl.float32)
        act = tl.div_rn(g, 1.0 + tl.exp(-g)).to(act_ty).to(tl.float32)
        x = (act * u).to(act_ty).to(tl.float32)  # (BLOCK_M, BLOCK_K)
    elif PROLOGUE >= 2:  # weight * normalize(x [+ residual]), rounded like the norm kernel
        s = _residual_sum(x_rows, r_rows, r_rows, mask_m, out_ptr, ks, mask_m, mask_k, K,
                          PROLOGUE, SLICES, STORE=False)  # (the first pass stored it)
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
    PROLOGUE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= K: the whole input row
    REDUCE: tl.constexpr,  # NO_REDUCE or SEND
    WORLD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One row, a persistent grid (``RowTile``): each program computes the prologue's
    input row once and keeps it in registers, then takes column blocks ``pid``,
    ``pid + programs``, ... with the next block's weight load issued before the current
    block is reduced, so its weight stream has no gaps. The prologue rounds exactly as the
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
                mask=(offs_n < N)[:, None] & mask_k[None, :], other=0.0)
    pdl_enter(USE_PDL)
    act_ty = out_ptr.dtype.element_ty
    if PROLOGUE == 1:  # silu(gate) * up, rounded like executor.kernels.activation
        g = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        a = tl.div_rn(g, 1.0 + tl.exp(-g)).to(act_ty).to(tl.float32)
        x = (a * u).to(act_ty).to(tl.float32)
    elif PROLOGUE >= 2:  # weight * normalize(x [+ residual]), rounded like the norm kernel
        s = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0)
        if PROLOGUE == 3:
            r = tl.load(res_ptr + offs_k, mask=mask_k, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(act_ty)
            tl.store(res_out_ptr + offs_k, s, mask=mask_k & (offs_k * 0 + pid == 0))
        s32 = s.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(s32 * s32, axis=0) * inv_k + eps)
        nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        x = ((s32 * rstd).to(act_ty).to(tl.float32) * nw).to(act_ty).to(tl.float32)
    else:
        x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    region = 0
    if REDUCE == SEND_:  # (the lane's counter: written by the all-reduce, after the wait)
        region = lamport_next_region(ctl_ptr, rank, slot_elems, WORLD)
    block = pid
    while block < tl.cdiv(N, BLOCK_N):
        offs_n = block * BLOCK_N + offs_b
        block += programs
        offs_next = block * BLOCK_N + offs_b  # past N: masked, nothing read
        w_next = tl.load(w_ptr + offs_next.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                         mask=(offs_next < N)[:, None] & mask_k[None, :], other=0.0)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1).to(act_ty)
        if REDUCE == SEND_:
            lamport_send(acc, offs_n, offs_n < N, red_ptr, region, WORLD)
        else:
            tl.store(out_ptr + offs_n, acc, mask=offs_n < N)
        w = w_next


@dataclass(frozen=True)
class Tile:
    """Launch shape: output columns and K chunk per program, warps per program, Triton's
    software-pipelining depth of the K loop, and (RMSNorm prologues only) whether the
    sum of squares is gathered in the product's pass (``_one_pass_norm_product``)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3  # Triton's default
    one_pass: bool = False


# Tuned tiles at M = 1, by (prologue, N, K) and the GPU they were tuned on: written by
# ``bench.skinny_gemm --tiles-out`` from a sweep on the GPU (each candidate checked against
# the unfused path) and shipped beside this module. A GPU takes its own tile for a shape,
# else the first GPU's the file lists for it; shapes missing from it take ``default_tile``.
TILES_FILE = Path(__file__).with_name("skinny_tiles.json")
_TUNED: dict[tuple[int, int, int], dict[str, Tile]] | None = None
#: (prologue, N, K, device) whose sweep found the unfused path (the norm or SiLU kernel,
#: then cuBLAS) faster than the best tile by ``CUBLAS_MARGIN`` or more: left to cuBLAS.
_CUBLAS: set[tuple[int, int, int, str]] = set()
#: How much faster the unfused path must have been (its time / the tile's at most this):
#: a skinny kernel keeps the PDL chain going and saves a launch, which an isolated
#: timing does not show.
CUBLAS_MARGIN = 0.95


def tuned_tiles() -> dict[tuple[int, int, int], dict[str, Tile]]:
    """The tuned tiles of ``TILES_FILE`` by shape, then by device name, in file order
    (read once, at the first launch)."""
    global _TUNED
    if _TUNED is None:
        _TUNED = {}
        _CUBLAS.clear()
        if TILES_FILE.is_file():
            for row in json.loads(TILES_FILE.read_text())["tiles"]:
                key = (row["prologue"], row["n"], row["k"])
                device = row.get("device", "")
                _TUNED.setdefault(key, {})[device] = Tile(*row["tile"])
                if "us" in row and row.get("unfused_us", float("inf")) <= \
                        CUBLAS_MARGIN * row["us"]:
                    _CUBLAS.add((*key, device))
    return _TUNED


def cublas_faster(prologue: int, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this GPU's sweep left ``x @ weight.T`` with this prologue to the unfused
    path (one row only: the sweep runs at M = 1)."""
    if x.shape[0] != 1:
        return False
    tuned_tiles()
    device = device_name(x.device) if x.is_cuda else ""
    n, k = weight.shape
    return (ADD_RMS_NORM if prologue == RMS_NORM else prologue, n, k, device) in _CUBLAS


def pick_tile(prologue: int, m: int, n: int, k: int, device: str = "") -> Tile:
    """The tile tuned for this shape at M = 1 on ``device`` (a CUDA device name), else on
    the first GPU the file names for it, else ``default_tile``."""
    if m == 1:  # the first layer's norm (no residual) takes its add-norm twin's tile
        tuned = tuned_tiles().get((ADD_RMS_NORM if prologue == RMS_NORM else prologue, n, k))
        if tuned:
            return tuned.get(device) or next(iter(tuned.values()))
    return default_tile(m, n, k, prologue)


@functools.cache
def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def default_tile(m: int, n: int, k: int, prologue: int = PLAIN) -> Tile:
    """Untuned shapes, by the H100 sweep of the 1B projections at M = 1 (``bench.skinny_gemm``,
    ``bench/results/2026-11-25-h100-kernels``): chunks of up to 2048 columns; plain inputs
    2 output columns per program with 8 warps (o: 5.5 us), fused prologues 4 columns with
    4 warps (qkv 8.1, gate_up 29.0, down 17.5 us; under PDL gate_up's best as well): each
    program of those also reads its input rows (the norm reads them twice), so fewer, wider
    programs.
    Fewer K per chunk as rows grow (M x chunk products sit in registers)."""
    block_m = next_power_of_2(m)
    block_k = max(64, min(next_power_of_2(k), 2048 // block_m))
    if prologue == PLAIN:
        return Tile(2, block_k, 8)
    return Tile(4, block_k, 4)


@dataclass(frozen=True)
class RowTile:
    """Launch shape of the persistent one-row kernel (``_skinny_row_kernel``): output
    columns per block, warps per program, and programs per SM (the grid is at most that
    many times the GPU's SM count; each program loops over its column blocks)."""

    block_n: int
    num_warps: int = 8
    programs_per_sm: int = 4


#: Inner sizes ``K`` (the weight's) the row kernel takes by default: the whole input row
#: sits in each program's registers, with two weight blocks of ``block_n`` rows. Measured
#: on an H100 from 2048 to 8192 (``bench/results/2026-11-26-h100-row-kernel``); smaller
#: rows (SmolLM2's 576 and 1536) keep their tuned classic tiles, and longer ones (the 8B's
#: down projection, 14336) the classic kernel's K loop.
ROW_KERNEL_K = (2048, 8192)
#: Outputs the row kernel takes by default: stored (NO_REDUCE) and sent into the push
#: all-reduce (SEND: the tensor-parallel o_proj/down_proj). With SEND the 8B's TP = 2
#: down_proj (4096 x 7168) runs on it; on two H200s, interleaved against the classic
#: kernel, its decode at batch 1 through a Session took 2.456-2.471 ms a token against
#: 2.492-2.500 (``bench/results/2026-11-27-tp-h200-row-send``).
ROW_KERNEL_REDUCE = (NO_REDUCE, SEND)
#: Column blocks per program of a full grid below which default launches keep the classic
#: kernel. Measured in the 1B's batch-1 decode on an H100
#: (``bench/results/2026-11-27-h100-row-rule``): with 1-1.5 blocks a program (its o_proj,
#: 512 blocks on 528 programs; its qkv, 768) the grid saves little prologue work and the
#: kernel after it (attention, gate_up) lost more than it gained: the classic kernel there
#: took the step from 1.085 to 1.077 ms; down (3.9 blocks a program) and gate_up (7.8)
#: stay quicker on the row kernel.
ROW_KERNEL_MIN_BLOCKS = 2
#: SMs the interpreter's grid is sized for (no GPU): two, so programs loop.
_INTERPRETER_SMS = 2
def row_tile(prologue: int, m: int, n: int, k: int, reduce: int = NO_REDUCE, *,
             sms: int) -> RowTile | None:
    """The row kernel's tile for a launch it takes by default on a GPU of ``sms`` SMs,
    else None (the classic kernel): the switch on (``switches.active().row_kernel``), one
    row, an output kind in ``ROW_KERNEL_REDUCE``, ``K`` in ``ROW_KERNEL_K``, and at least
    ``ROW_KERNEL_MIN_BLOCKS`` column blocks for each program of a full grid.
    By the H100 sweep of the 1B and the 8B's TP = 2 shapes, each projection alone
    (``bench/results/2026-11-26-h100-row-kernel``): 8 warps; SiLU-and-mul inputs 2 columns
    per block, 2 programs per SM (down: 13.7 against the classic tile's 15.2 us at 8192 x
    2048, 21.5 against 22.2 at 7168 x 4096); the others 4 columns up to K = 2048 and 2
    above, 4 programs per SM (qkv 5.6 against 7.4 us at 2048 x 3072, 9.5 against 10.5 at
    4096 x 3072)."""
    if not switches.active().row_kernel or m != 1 or reduce not in ROW_KERNEL_REDUCE \
            or not ROW_KERNEL_K[0] <= k <= ROW_KERNEL_K[1]:
        return None
    tile = RowTile(2, 8, 2) if prologue == SILU_MUL else RowTile(4 if k <= 2048 else 2, 8, 4)
    if cdiv(n, tile.block_n) < ROW_KERNEL_MIN_BLOCKS * tile.programs_per_sm * sms:
        return None
    return tile


def row_programs(tile: RowTile, n: int, sms: int, resident: int | None = None) -> int:
    """The row kernel's grid for ``n`` columns: the fewest programs that take its column
    blocks in as many rounds as a full grid (``tile.programs_per_sm`` per SM, or fewer
    where only ``resident`` fit on an SM at once) would. Each program takes that many
    blocks, a few (fewer than the rounds) one less: 768 blocks on at most 528 programs run
    as 384 programs of two, not 240 of two and 288 of one, which would leave half the GPU
    idle for the last round."""
    per_sm = tile.programs_per_sm if resident is None else min(tile.programs_per_sm, resident)
    blocks = cdiv(n, tile.block_n)
    return cdiv(blocks, cdiv(blocks, per_sm * sms))


#: 32-bit registers of an SM (sm_70 to sm_90), allocated to a warp in units of
#: ``REGISTER_UNIT``; shared memory the driver reserves per program on sm_80 and later.
SM_REGISTERS, REGISTER_UNIT, RESERVED_SHARED = 65536, 256, 1024
#: Programs an SM holds at once, whatever their size (sm_80 and sm_90).
SM_MAX_PROGRAMS = 32


def resident_programs(n_regs: int, num_warps: int, shared: int, *, max_warps: int,
                      shared_per_sm: int) -> int:
    """Programs of a kernel compiled to ``n_regs`` registers a thread and ``shared`` bytes
    of shared memory, ``num_warps`` warps each, that one SM runs at once (at least 1):
    the fewest its registers, its ``max_warps`` warps and its ``shared_per_sm`` bytes allow.
    A row kernel whose tile asks for more (a newer Triton's register allocation, a heavier
    prologue) would otherwise run its persistent grid in two rounds: its receiving
    variant, 78 registers against 64, took 10 us a layer longer at 4 programs per SM
    (``bench/results/2026-11-27-tp-h200-recv-lane``)."""
    per_warp = cdiv(n_regs * 32, REGISTER_UNIT) * REGISTER_UNIT
    fit = min(SM_REGISTERS // (per_warp * num_warps), max_warps // num_warps, SM_MAX_PROGRAMS,
              shared_per_sm // (shared + RESERVED_SHARED))
    return max(fit, 1)


@functools.cache
def sm_count(device: torch.device) -> int:
    """The SMs the row kernel's grid and rule count on ``device`` (``_INTERPRETER_SMS`` off
    CUDA)."""
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


_LAUNCHERS: dict[tuple[int, int], FastLauncher] = {}


def _launcher(num_warps: int, num_stages: int) -> FastLauncher:
    key = (num_warps, num_stages)
    if key not in _LAUNCHERS:
        _LAUNCHERS[key] = FastLauncher(_skinny_gemm_kernel, pdl=True, num_warps=num_warps,
                                       num_stages=num_stages)
    return _LAUNCHERS[key]


_ROW_LAUNCHERS: dict[int, FastLauncher] = {}


def _row_launcher(num_warps: int) -> FastLauncher:
    if num_warps not in _ROW_LAUNCHERS:
        _ROW_LAUNCHERS[num_warps] = FastLauncher(_skinny_row_kernel, pdl=True,
                                                 num_warps=num_warps)
    return _ROW_LAUNCHERS[num_warps]


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False,
                tile: Tile | RowTile | None = None) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` (M, K) and ``weight`` (N, K); with ``silu_mul``, ``x`` is
    (M, 2K) gate|up and the product is ``silu_and_mul(x) @ weight.T``. A new (M, N) tensor.
    Rows of ``x`` and ``weight`` must have unit column stride."""
    k = weight.shape[1]
    assert x.dim() == 2 and x.shape[1] == (2 * k if silu_mul else k), (x.shape, weight.shape)
    return _launch(x, None, None, 0.0, weight, SILU_MUL if silu_mul else PLAIN, tile)[0]


def skinny_norm_gemm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                     eps: float, weight: torch.Tensor, tile: Tile | RowTile | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rms_norm(x [+ residual]) @ weight.T, x + residual)`` in one launch: the norm of
    ``executor.kernels.norm`` (same roundings) fused into the GEMM's input; the new
    residual is None without one. New tensors; inputs untouched."""
    assert x.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert norm_weight.shape == (x.shape[1],) and norm_weight.is_contiguous()
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
    prologue = RMS_NORM if residual is None else ADD_RMS_NORM
    return _launch(x, residual, norm_weight, eps, weight, prologue, tile)


@dataclass(frozen=True, eq=False)
class ReduceSite:
    """Where a row-parallel projection's partial output meets its peers' (PUSH) and the
    next pre-norm projection takes their sum (GATHER): one site of a tensor-parallel
    group's reduce buffers, which ``executor.distributed.group`` registers as symmetric
    memory. Each rank's buffer holds, at ``offset``, one int32 arrival flag per source
    rank (``SITE_FLAG_BYTES``), then two data slots of ``slot_bytes`` (a call uses the slot
    of its epoch's parity), each ``world`` slices of one row in source-rank order.

    A PUSH and its GATHER must follow each other on every rank's stream, and every rank
    must make the same calls in the same order (the epochs advance in step on the device).
    """

    bases: torch.Tensor  # (world,) int64: every rank's buffer address
    ctl: torch.Tensor  # (2,) int32 in this rank's memory: [arrivals of the call, epoch]
    rank: int
    world: int
    offset: int
    slot_bytes: int
    buffer: torch.Tensor | None = None  # this rank's buffer, held while the site lives

    def fits(self, n: int, dtype: torch.dtype) -> bool:
        """Whether ``world`` slices of ``n`` elements fit a slot, 16-byte aligned."""
        size = n * dtype.itemsize
        return size % 16 == 0 and self.world * size <= self.slot_bytes


@dataclass(frozen=True)
class SendLane:
    """A lane of the push all-reduce (``executor.distributed.group._TritonLamport``) as a
    SEND target: every rank's buffer, the lane's counters, and the elements per region."""

    bases: torch.Tensor  # (world,) int64
    counters: torch.Tensor  # (programs,) int32
    rank: int
    world: int
    region_elems: int


def send_linear(x: torch.Tensor, weight: torch.Tensor, lane: SendLane,
                silu_mul: bool = False, tile: Tile | RowTile | None = None) -> None:
    """``x @ weight.T`` (``silu_mul``: of ``silu_and_mul(x)``) for one row, stored as this
    rank's share of the lane's next all-reduce in every rank's buffer instead of returned;
    the lane's kernel launched next with ``SENT`` sums it. Launch both on every rank."""
    n, k = weight.shape
    assert x.shape == (1, 2 * k if silu_mul else k), (x.shape, weight.shape)
    assert 0 < n <= lane.region_elems and k > 0, "the output row must fit the lane"
    _launch(x, None, None, 0.0, weight, SILU_MUL if silu_mul else PLAIN, tile, SEND, lane)


def push_linear(x: torch.Tensor, weight: torch.Tensor, site: ReduceSite, silu_mul: bool = False,
                tile: Tile | RowTile | None = None) -> None:
    """``x @ weight.T`` (``silu_mul``: of ``silu_and_mul(x)``) for one row, pushed as this
    rank's slice into every rank's buffer at ``site`` instead of returned:
    ``gather_norm_linear`` takes the sum. Launch it on every rank."""
    k = weight.shape[1]
    assert x.shape == (1, 2 * k if silu_mul else k), (x.shape, weight.shape)
    assert site.fits(weight.shape[0], x.dtype), "the output row does not fit the site's slot"
    _launch(x, None, None, 0.0, weight, SILU_MUL if silu_mul else PLAIN, tile, PUSH, site)


def reducible(x: torch.Tensor, producer: torch.nn.Module, consumer: torch.nn.Module,
               norm_weight: torch.Tensor, site: ReduceSite, silu_mul: bool = False) -> bool:
    """Whether ``producer(x)`` (``silu_mul``: of ``silu_and_mul(x)``) can be pushed to
    ``site`` for ``consumer``, a pre-norm projection with norm weight ``norm_weight``, to
    gather: both are one-row skinny GEMMs on this GPU (``serves``, not left to cuBLAS),
    their widths chain and the row fits the site."""
    if not (x.is_cuda and x.shape[0] == 1 and takes(x, producer, silu_mul)
            and serves(x, consumer)):
        return False
    w_p: torch.Tensor = producer.weight  # type: ignore[assignment]
    w_c: torch.Tensor = consumer.weight  # type: ignore[assignment]
    return (w_c.shape[1] == w_p.shape[0] and site.fits(w_p.shape[0], x.dtype)
            and norm_weight.dtype == x.dtype and norm_weight.is_contiguous()
            and not cublas_faster(ADD_RMS_NORM, x, w_c))


def gather_norm_linear(site: ReduceSite, residual: torch.Tensor, norm_weight: torch.Tensor,
                       eps: float, weight: torch.Tensor, tile: Tile | RowTile | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``skinny_norm_gemm(x, residual, ...)`` where ``x`` is the sum over ranks of what
    their ``push_linear`` put at ``site`` (summed like the all-reduce kernel: float32, rank
    order, rounded once): ``(rms_norm(x + residual) @ weight.T, x + residual)``."""
    assert residual.shape == (1, weight.shape[1]) and residual.stride(-1) == 1
    assert norm_weight.shape == (weight.shape[1],) and norm_weight.is_contiguous()
    out, res_out = _launch(residual, residual, norm_weight, eps, weight, ADD_RMS_NORM, tile,
                           GATHER, site)
    assert res_out is not None
    return out, res_out


def _launch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None,
            eps: float, weight: torch.Tensor, prologue: int, tile: Tile | RowTile | None,
            reduce: int = NO_REDUCE, site: ReduceSite | SendLane | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch; under GATHER ``x`` only stands in for the activation (the input is
    the site's sum), under PUSH and SEND nothing is returned in ``out`` (it is ``x``)."""
    assert x.stride(-1) == 1, "x must have contiguous rows"
    assert weight.dim() == 2 and weight.stride(-1) == 1, "weight must be (N, K) row-major"
    m = x.shape[0]
    n, k = weight.shape
    for t in (residual, norm_weight):
        assert t is None or t.dtype == x.dtype, "inputs must share the activation dtype"
    assert x.dtype == weight.dtype, (x.dtype, weight.dtype)
    assert (reduce == NO_REDUCE) == (site is None) and (site is None or m == 1)
    out = x if reduce in (PUSH, SEND) else torch.empty((m, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if m == 0 or n == 0 or k == 0:  # nothing to launch (an empty sum is zero)
        if res_out is not None and residual is not None:
            res_out.copy_(x + residual)
        return out.zero_(), res_out
    if tile is None:
        tile = row_tile(prologue, m, n, k, reduce, sms=sm_count(x.device)) or \
            pick_tile(prologue, m, n, k, device_name(x.device) if x.is_cuda else "")
    if isinstance(tile, RowTile):
        assert m == 1 and reduce in (NO_REDUCE, SEND), "the row kernel: one row, no gather"
        _launch_row(x, residual, norm_weight, eps, weight, out, res_out, prologue, tile,
                    reduce, site)
        return out, res_out
    block_m = next_power_of_2(m)
    res_in = residual if residual is not None else x
    res_dst = res_out if res_out is not None else out
    nw = norm_weight if norm_weight is not None else x
    strides = (x.stride(0), res_in.stride(0), weight.stride(0), out.stride(0), res_dst.stride(0))
    # Key: what the JIT specializes on besides pointer alignment (dtype, integers).
    one_pass = tile.one_pass and prologue >= RMS_NORM
    red, world = _reduce_args(x, site)
    key = (x.dtype, m, n, k, strides, prologue, block_m, tile.block_n, tile.block_k, one_pass,
           reduce, world, red[2:])
    _launcher(tile.num_warps, tile.num_stages).launch(
        (cdiv(n, tile.block_n), 1, 1), key,
        (x, res_in, nw, weight, out, res_dst, m, n, k, *strides, 1.0 / k, eps, *red),
        {"PROLOGUE": prologue, "BLOCK_M": block_m, "BLOCK_N": tile.block_n,
         "BLOCK_K": tile.block_k, "ONE_PASS": one_pass, "REDUCE": reduce, "WORLD": world,
         "SLICES": world if reduce == GATHER else 1})
    return out, res_out


def _reduce_args(x: torch.Tensor, site: ReduceSite | SendLane | None
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor, int, int, int], int]:
    """The kernels' reduce arguments (every rank's buffer, this rank's counters, rank,
    site offset, slot size) for ``site`` (``x`` stands in where there is none), and the
    world size."""
    if site is None:
        return (x, x, 0, 0, 0), 1
    if isinstance(site, SendLane):
        return (site.bases, site.counters, site.rank, 0, site.region_elems), site.world
    return (site.bases, site.ctl, site.rank, site.offset, site.slot_bytes), site.world


def _launch_row(x: torch.Tensor, residual: torch.Tensor | None,
                norm_weight: torch.Tensor | None, eps: float, weight: torch.Tensor,
                out: torch.Tensor, res_out: torch.Tensor | None, prologue: int, tile: RowTile,
                reduce: int, site: ReduceSite | SendLane | None) -> None:
    """``_skinny_row_kernel`` on the grid of ``row_programs``, sized the first time a
    specialization launches to the programs its compiled kernel fits on an SM
    (``row_grid``)."""
    n, k = weight.shape
    red5, world = _reduce_args(x, site)
    red = (*red5[:3], red5[4])  # no site offset: a SEND lane's regions start at 0
    block_k = next_power_of_2(k)
    # Key: what the JIT specializes on besides pointer alignment (dtype, integers).
    key = (x.dtype, n, k, weight.stride(0), prologue, tile.block_n, block_k, reduce, world,
           red[2:])
    launcher = _row_launcher(tile.num_warps)
    args = (x, residual if residual is not None else x,
            norm_weight if norm_weight is not None else x, weight, out,
            res_out if res_out is not None else out, n, k, weight.stride(0), 1.0 / k, eps, *red)
    constexprs = {"PROLOGUE": prologue, "BLOCK_N": tile.block_n, "BLOCK_K": block_k,
                  "REDUCE": reduce, "WORLD": world}
    grid_key = (key, tile.programs_per_sm, tile.num_warps, x.device)
    programs = _ROW_GRIDS.get(grid_key)
    if programs is None:
        programs = _ROW_GRIDS[grid_key] = row_grid(launcher, tile, n, args, constexprs)
    launcher.launch((programs, 1, 1), key, args, constexprs)


#: The row kernel's grid per specialization, tile and device (``row_grid``).
_ROW_GRIDS: dict[tuple[Any, ...], int] = {}


def row_grid(launcher: FastLauncher, tile: RowTile, n: int, args: tuple[Any, ...],
             constexprs: dict[str, Any]) -> int:
    """``row_programs`` for a launch of ``args``, with the programs per SM capped by what
    its compiled kernel fits (``resident_programs``); the tile's own count where the kernel
    cannot be inspected (the interpreter)."""
    device = args[0].device
    kernel = launcher.compiled(args, constexprs) if device.type == "cuda" else None
    if kernel is None:
        return row_programs(tile, n, sm_count(device))
    props = torch.cuda.get_device_properties(device)
    fit = resident_programs(kernel.n_regs, tile.num_warps, int(kernel.metadata.shared),
                            max_warps=props.max_threads_per_multi_processor // 32,
                            shared_per_sm=props.shared_memory_per_multiprocessor)
    return row_programs(tile, n, sm_count(device), fit)


def serves(x: torch.Tensor, layer: torch.nn.Module) -> bool:
    """Whether ``skinny_gemm`` takes ``layer(x)``: a plain bias-free ``nn.Linear`` (any
    other module, e.g. a tensor-parallel linear, keeps its own forward), few rows, same
    dtype, outside a Dynamo trace (a compiled graph keeps ``F.linear``).

    NOTE: the Dynamo check comes first: under a trace with a dynamic token count, testing
    ``x.shape[0]`` would add a guard on it (a recompile, or a specialized piece)."""
    if torch.compiler.is_compiling():
        return False
    return (type(layer) is torch.nn.Linear and layer.bias is None
            and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.stride(-1) == 1
            and x.dtype == layer.weight.dtype and layer.weight.stride(-1) == 1)


def takes(x: torch.Tensor, layer: torch.nn.Module, silu_mul: bool = False) -> bool:
    """Whether ``layer(x)`` (``silu_mul``: ``layer(silu_and_mul(x))``) runs as one
    ``skinny_gemm`` launch here: the kernel serves them, the widths chain, and this GPU's
    sweep did not find the unfused path faster (``cublas_faster``)."""
    if not serves(x, layer):  # (a plain nn.Linear: it has a weight)
        return False
    weight: torch.Tensor = layer.weight  # type: ignore[assignment]
    return x.shape[1] == weight.shape[1] * (2 if silu_mul else 1) \
        and not cublas_faster(SILU_MUL if silu_mul else PLAIN, x, weight)


def linear(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, through ``skinny_gemm`` where it ``takes`` it."""
    if takes(x, layer):
        return skinny_gemm(x, layer.weight)  # type: ignore[arg-type]
    return layer(x)  # type: ignore[no-any-return]


def silu_and_mul_linear(gate_up: torch.Tensor, layer: torch.nn.Module,
                        silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``layer(silu_and_mul(gate_up))``, as one ``skinny_gemm`` launch where it ``takes``
    it."""
    if takes(gate_up, layer, silu_mul=True):
        return skinny_gemm(gate_up, layer.weight, silu_mul=True)  # type: ignore[arg-type]
    return layer(silu_and_mul(gate_up))  # type: ignore[no-any-return]


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                        eps: float, layer: torch.nn.Module,
                        norm: Callable[..., torch.Tensor],
                        add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer(rms_norm(x + residual)), x + residual)`` (without a residual: the norm of
    ``x``, and ``x`` as the residual), one ``skinny_norm_gemm`` launch where it serves;
    else ``norm``/``add_norm`` (the norm kernels) then ``linear`` (cuBLAS where this GPU's
    sweep found that path faster for the shape)."""
    fused = serves(x, layer) and norm_weight.dtype == x.dtype and norm_weight.is_contiguous() \
        and (residual is None or (residual.dtype == x.dtype and residual.stride(-1) == 1))
    unfused = fused and cublas_faster(ADD_RMS_NORM, x, layer.weight)  # type: ignore[arg-type]
    if fused and not unfused:
        out, res_out = skinny_norm_gemm(x, residual, norm_weight, eps,
                                        layer.weight)  # type: ignore[arg-type]
        return out, res_out if res_out is not None else x
    if residual is None:
        normed = norm(x, norm_weight, eps)
        residual = x
    else:
        normed, residual = add_norm(x, residual, norm_weight, eps)
    return (layer(normed) if unfused else linear(layer, normed)), residual
