"""Launchers of the FP8 Triton kernels (``kernels.py``, ``row_kernel.py``): output
allocation, the tile (``tiles.py``), the grid. One row takes the persistent row kernel where
its tile says so (an ``Fp8RowTile``; through a ``FastLauncher`` with PDL, its grid sized as the
bf16 row kernel's, ``skinny.ops.row_grid``), else the w8a16 kernel. ``w8a16_glu``: the same
kernels with the gated epilogue (a gate|up weight in, ``silu(gate) * up`` out).

Imported at the first FP8 GEMM, never with the model, so CPU runs that only load and
dequantize never import Triton.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from executor.kernels import pdl, switches
from executor.kernels.fast_launch import FastLauncher, cdiv, next_power_of_2
from executor.kernels.skinny.ops import row_grid
from executor.kernels.skinny.tiles import RowTile, device_name, sm_count
from executor.quant.fp8 import FP8
from executor.quant.kernels import _act_quant_kernel, _w8a16_kernel
from executor.quant.row_kernel import _w8a16_row_kernel
from executor.quant.tiles import (
    DOT_MIN_ROWS,
    PLAIN,
    SILU_MUL,
    Fp8RowTile,
    Fp8Tile,
    block_m,
    pick_tile,
    valid,
)


@functools.cache
def stages(device: torch.device) -> int:
    """Default software-pipelining depth: Hopper's shared memory holds four stages of the
    largest tile (64 x 128 bf16 rows + 128 x 128 FP8 weights); Ada's (~100 KiB) two."""
    if device.type != "cuda":
        return 2
    return 4 if torch.cuda.get_device_capability(device) >= (9, 0) else 2


def w8a16(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
          block: tuple[int, int] | None, tile: Fp8Tile | Fp8RowTile | None = None
          ) -> torch.Tensor:
    """``x @ dequantize(weight).T`` for ``x`` (M, K) bf16/fp16, ``weight`` (N, K) e4m3 and
    ``scale`` block scales (with ``block``) or (N,) row scales. A new (M, N) tensor.
    ``tile``: the launch shape (default: ``tiles.pick_tile``)."""
    return _launch(x, weight, scale, block, PLAIN, None, None, 0.0, tile, False)[0]


def w8a16_fused(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                block: tuple[int, int] | None, input_op: int, residual: torch.Tensor | None,
                norm_weight: torch.Tensor | None, eps: float,
                tile: Fp8Tile | Fp8RowTile | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``w8a16`` of the input op's output (``executor.kernels.skinny`` ``SILU_MUL``: ``x``
    is (M, 2K) gate|up; ``RMS_NORM``/``ADD_RMS_NORM``: ``rms_norm(x [+ residual])`` with
    ``norm_weight``), for fewer than ``DOT_MIN_ROWS`` rows; with a residual also
    ``x + residual``, as ``skinny_norm_gemm`` returns them."""
    assert 0 < x.shape[0] < DOT_MIN_ROWS, x.shape
    return _launch(x, weight, scale, block, input_op, residual, norm_weight, eps, tile, False)


def w8a16_glu(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              block: tuple[int, int] | None, input_op: int, residual: torch.Tensor | None,
              norm_weight: torch.Tensor | None, eps: float,
              tile: Fp8Tile | Fp8RowTile | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``w8a16_fused`` of a fused gate|up ``weight`` (2I, K) with the gated epilogue:
    ``silu_and_mul`` of its (M, 2I) output as (M, I), bit for bit what the unfused
    kernels give at a tile of the same reduction (``tile``'s block: I-columns, each two
    weight rows, reduced as the plain launch's twice-as-tall block). With a residual also
    ``x + residual``. Fewer than ``DOT_MIN_ROWS`` rows; block scales follow the weight
    rows, so a (TP shard's) gate|up weight need not split on a block boundary."""
    assert 0 < x.shape[0] < DOT_MIN_ROWS and weight.shape[0] % 2 == 0, (x.shape, weight.shape)
    return _launch(x, weight, scale, block, input_op, residual, norm_weight, eps, tile, True)


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
            block: tuple[int, int] | None, input_op: int, residual: torch.Tensor | None,
            norm_weight: torch.Tensor | None, eps: float, tile: Fp8Tile | Fp8RowTile | None,
            glu: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.dtype == FP8, (x.shape, weight.dtype)
    m = x.shape[0]
    n, k = weight.shape
    assert x.shape[1] == (2 * k if input_op == SILU_MUL else k), (x.shape, weight.shape)
    cols = n // 2 if glu else n  # output columns
    out = x.new_empty((m, cols))
    res_out = torch.empty_like(x) if residual is not None else None
    if m == 0:
        return out, res_out
    dot = m >= DOT_MIN_ROWS
    assert not dot or (input_op == PLAIN and not glu)
    if tile is None:
        name = device_name(x.device) if x.is_cuda else ""
        row_sms = sm_count(x.device) if x.is_cuda and switches.active().row_kernel else 0
        tile = pick_tile(m, n, k, block is not None, input_op, name, row_sms, glu)
    assert valid(tile, m, block is not None), tile
    sbn, sbk = block or (1, 1)
    res_in = residual if residual is not None else x
    res_dst = res_out if res_out is not None else out
    nw = norm_weight if norm_weight is not None else x
    if isinstance(tile, Fp8RowTile):
        _launch_row(x, res_in, nw, weight, scale, block, out, res_dst, input_op, eps, tile,
                    glu)
        return out, res_out
    bm = block_m(m)
    grid = (cdiv(cols, tile.block_n), cdiv(m, bm))
    _w8a16_kernel[grid](x, res_in, nw, weight, scale, out, res_dst, m, cols, k, x.stride(0),
                        res_in.stride(0), weight.stride(0), out.stride(0), res_dst.stride(0),
                        scale.stride(0), 1.0 / k, eps, SBN=sbn, SBK=sbk,
                        BLOCK_SCALES=block is not None, INPUT_OP=input_op, BLOCK_M=bm,
                        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, USE_DOT=dot, GLU=glu,
                        num_warps=tile.num_warps,
                        num_stages=tile.num_stages or stages(x.device))
    return out, res_out


@functools.cache
def half_products(device: torch.device) -> bool:
    """Whether the row kernel forms its products in f16 pairs on ``device`` (``HALF``:
    ``cvt.rn.f16x2.e4m3x2`` is an sm_89 instruction; the interpreter runs no PTX)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


_ROW_LAUNCHERS: dict[int, FastLauncher] = {}
#: The row kernel's grid per specialization, tile and device (``skinny.ops.row_grid``).
_ROW_GRIDS: dict[tuple[Any, ...], int] = {}


def _launch_row(x: torch.Tensor, res_in: torch.Tensor, nw: torch.Tensor, weight: torch.Tensor,
                scale: torch.Tensor, block: tuple[int, int] | None, out: torch.Tensor,
                res_dst: torch.Tensor, input_op: int, eps: float, tile: Fp8RowTile,
                glu: bool) -> None:
    """``_w8a16_row_kernel`` on a persistent grid of what its compiled kernel fits on an SM
    (sized at a specialization's first launch)."""
    k = weight.shape[1]
    n = out.shape[1]  # output columns (GLU: half the weight rows)
    sbn, sbk = block or (1, 0)
    block_k = max(next_power_of_2(k), sbk)
    sbk = sbk or block_k  # row scales: one "block" of the whole row (no per-block sums)
    assert sbk & (sbk - 1) == 0, "the row kernel takes power-of-two scale blocks"
    if tile.num_warps not in _ROW_LAUNCHERS:
        _ROW_LAUNCHERS[tile.num_warps] = FastLauncher(_w8a16_row_kernel, pdl=True,
                                                      num_warps=tile.num_warps)
    launcher = _ROW_LAUNCHERS[tile.num_warps]
    # f16-pair products read 16-column chunks of 4-byte words (the stride in words)
    half = half_products(x.device) and k % 16 == 0 and weight.stride(0) % 16 == 0 \
        and weight.data_ptr() % 16 == 0 and sbk >= 16
    stride_w = weight.stride(0) // 4 if half else weight.stride(0)
    # Key: what the JIT specializes on besides pointer alignment (dtype, integers).
    key = (x.dtype, n, k, weight.stride(0), scale.stride(0), sbn, sbk, block is not None,
           input_op, tile.block_n, block_k, tile.num_stages, glu, half)
    args = (x, res_in, nw, weight, scale, out, res_dst, n, k, stride_w,
            scale.stride(0), 1.0 / k, eps)
    # A plain input (o_proj; down_proj after the gated epilogue) is followed by a persistent
    # row launch, which starts best on SMs this grid has left: trigger it late. A fused
    # input op's successor (attention, down_proj) gains from launching early.
    constexprs = {"SBN": sbn, "SBK": sbk, "BLOCK_SCALES": block is not None,
                  "INPUT_OP": input_op, "BLOCK_N": tile.block_n, "BLOCK_K": block_k,
                  "STAGES": tile.num_stages, "GLU": glu, "LATE_TRIGGER": input_op == PLAIN,
                  "HALF": half}
    grid_key = (key, tile.programs_per_sm, x.device)
    programs = _ROW_GRIDS.get(grid_key)
    if programs is None:
        shape = RowTile(tile.block_n, tile.num_warps, tile.programs_per_sm)  # (the grid's)
        programs = _ROW_GRIDS[grid_key] = row_grid(launcher, shape, n, args, constexprs)
    launcher.launch((programs, 1, 1), key, args, constexprs)


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
                                BLOCK=block, num_warps=4 if block <= 1024 else 8,
                                **pdl.options())
    return q, s
