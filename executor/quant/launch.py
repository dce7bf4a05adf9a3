"""Launchers of the FP8 Triton kernels (``kernels.py``): tile choice, output allocation.

Imported at the first FP8 GEMM, never with the model, so CPU runs that only load and
dequantize never import Triton.
"""

from __future__ import annotations

import functools

import torch

from executor.kernels.fast_launch import cdiv, next_power_of_2
from executor.kernels.skinny.kernel import PLAIN, SILU_MUL
from executor.kernels.skinny.tiles import sm_count
from executor.quant.fp8 import FP8
from executor.quant.kernels import _act_quant_kernel, _w8a16_kernel

#: Rows from which ``tl.dot`` (16-row tiles) multiplies; fewer reduce on the CUDA cores,
#: where the input ops can be fused in.
DOT_MIN_ROWS = 8


def _tile(m: int, n: int, k: int, block: tuple[int, int] | None,
          device: torch.device) -> tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT) for an (m, n, k) product."""
    dot = m >= DOT_MIN_ROWS
    block_m = min(max(16, next_power_of_2(m)), 64) if dot else next_power_of_2(m)
    # Enough programs to cover every SM twice over (no split-K: one program owns whole
    # output columns), never fewer columns than 16 nor more than 128.
    want = max(1, n // (2 * sm_count(device)))
    block_n = min(128, max(16, 1 << (want.bit_length() - 1)))
    if m > 64:
        block_n = 128
    block_k = 128 if block is not None or m > 1 else 256
    block_k = min(block_k, max(16, next_power_of_2(k)))
    if block is not None:
        assert block[1] % block_k == 0, (block, block_k)
    return block_m, block_n, block_k, dot


@functools.cache
def _stages(device: torch.device) -> int:
    """Software-pipelining depth: Hopper's shared memory holds four stages of the largest
    tile (64 x 128 bf16 rows + 128 x 128 FP8 weights); Ada's (~100 KiB) two."""
    if device.type != "cuda":
        return 2
    return 4 if torch.cuda.get_device_capability(device) >= (9, 0) else 2


def w8a16(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
          block: tuple[int, int] | None) -> torch.Tensor:
    """``x @ dequantize(weight).T`` for ``x`` (M, K) bf16/fp16, ``weight`` (N, K) e4m3 and
    ``scale`` block scales (with ``block``) or (N,) row scales. A new (M, N) tensor."""
    return _launch(x, weight, scale, block, PLAIN, None, None, 0.0)[0]


def w8a16_fused(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                block: tuple[int, int] | None, input_op: int, residual: torch.Tensor | None,
                norm_weight: torch.Tensor | None, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``w8a16`` of the input op's output (``executor.kernels.skinny`` ``SILU_MUL``: ``x``
    is (M, 2K) gate|up; ``RMS_NORM``/``ADD_RMS_NORM``: ``rms_norm(x [+ residual])`` with
    ``norm_weight``), for fewer than ``DOT_MIN_ROWS`` rows; with a residual also
    ``x + residual``, as ``skinny_norm_gemm`` returns them."""
    assert 0 < x.shape[0] < DOT_MIN_ROWS, x.shape
    return _launch(x, weight, scale, block, input_op, residual, norm_weight, eps)


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
            block: tuple[int, int] | None, input_op: int, residual: torch.Tensor | None,
            norm_weight: torch.Tensor | None, eps: float
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.dtype == FP8, (x.shape, weight.dtype)
    m = x.shape[0]
    n, k = weight.shape
    assert x.shape[1] == (2 * k if input_op == SILU_MUL else k), (x.shape, weight.shape)
    out = x.new_empty((m, n))
    res_out = torch.empty_like(x) if residual is not None else None
    if m == 0:
        return out, res_out
    bm, bn, bk, dot = _tile(m, n, k, block, x.device)
    assert not dot or input_op == PLAIN
    sbn, sbk = block or (1, 1)
    res_in = residual if residual is not None else x
    res_dst = res_out if res_out is not None else out
    nw = norm_weight if norm_weight is not None else x
    grid = (cdiv(n, bn), cdiv(m, bm))
    _w8a16_kernel[grid](x, res_in, nw, weight, scale, out, res_dst, m, n, k, x.stride(0),
                        res_in.stride(0), weight.stride(0), out.stride(0), res_dst.stride(0),
                        scale.stride(0), 1.0 / k, eps, SBN=sbn, SBK=sbk,
                        BLOCK_SCALES=block is not None, INPUT_OP=input_op, BLOCK_M=bm,
                        BLOCK_N=bn, BLOCK_K=bk, USE_DOT=dot, num_warps=4 if m <= 64 else 8,
                        num_stages=_stages(x.device))
    return out, res_out


def act_quant(x: torch.Tensor, static_scale: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` (M, K) to e4m3: (q (M, K), float32 scales (M, 1)); per row, or all
    with ``static_scale`` (1,)."""
    assert x.dim() == 2 and x.stride(-1) == 1
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(4096, next_power_of_2(k))
        _act_quant_kernel[(m,)](x, q, s, static_scale if static_scale is not None else s,
                                k, x.stride(0), q.stride(0), STATIC=static_scale is not None,
                                BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return q, s
