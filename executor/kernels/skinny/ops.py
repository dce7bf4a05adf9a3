"""Launching the skinny GEMM: ``skinny_gemm``, ``skinny_norm_gemm`` and ``send_linear``.

Each call checks shapes, picks a tile (``tiles.py``) and launches one of ``kernel.py``'s
kernels through a ``FastLauncher`` (PDL where it is on). The row kernel's grid is sized
once per specialization to what its compiled kernel fits on an SM (``row_grid``).
Numerics: float32 products and sums of the activation-dtype inputs, one rounding at the
end, like cuBLAS; the summation order differs, so outputs can differ from ``F.linear`` by
an ulp of the activation dtype. There is no split-K, so results are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from executor.kernels.fast_launch import FastLauncher, cdiv, next_power_of_2
from executor.kernels.skinny.kernel import (
    ADD_RMS_NORM,
    NO_REDUCE,
    PLAIN,
    RMS_NORM,
    SEND,
    SILU_MUL,
    _skinny_gemm_kernel,
    _skinny_row_kernel,
)
from executor.kernels.skinny.tiles import (
    RowTile,
    Tile,
    device_name,
    pick_tile,
    resident_programs,
    row_programs,
    row_tile,
    sm_count,
)


@dataclass(frozen=True)
class SendLane:
    """A lane of the push all-reduce (``executor.distributed.all_reduce.paths.PushAllReduce``)
    as a SEND target: every rank's buffer, the lane's counters, and the elements per
    region."""

    bases: torch.Tensor  # (world,) int64
    counters: torch.Tensor  # (programs,) int32
    rank: int
    world: int
    region_elems: int


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
                tile: Tile | RowTile | None = None, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` (M, K) and ``weight`` (N, K); with ``silu_mul``, ``x`` is
    (M, 2K) gate|up and the product is ``silu_and_mul(x) @ weight.T``. A new (M, N) tensor,
    or written into ``out`` ((M, N) of ``x``'s dtype, unit column stride: e.g. rows of a
    graph's logits buffer) and returned. Rows of ``x`` and ``weight`` must have unit column
    stride."""
    n, k = weight.shape
    assert x.dim() == 2 and x.shape[1] == (2 * k if silu_mul else k), (x.shape, weight.shape)
    if out is not None:
        assert out.shape == (x.shape[0], n) and out.dtype == x.dtype and out.stride(-1) == 1, \
            (out.shape, out.dtype, out.stride())
    return _launch(x, None, None, 0.0, weight, SILU_MUL if silu_mul else PLAIN, tile,
                   out=out)[0]


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
    input_op = RMS_NORM if residual is None else ADD_RMS_NORM
    return _launch(x, residual, norm_weight, eps, weight, input_op, tile)


def send_linear(x: torch.Tensor, weight: torch.Tensor, lane: SendLane,
                silu_mul: bool = False, tile: Tile | RowTile | None = None) -> None:
    """``x @ weight.T`` (``silu_mul``: of ``silu_and_mul(x)``) for one row, stored as this
    rank's share of the lane's next all-reduce in every rank's buffer instead of returned;
    the lane's kernel launched next with ``SENT`` sums it. Launch both on every rank."""
    n, k = weight.shape
    assert x.shape == (1, 2 * k if silu_mul else k), (x.shape, weight.shape)
    assert 0 < n <= lane.region_elems and k > 0, "the output row must fit the lane"
    _launch(x, None, None, 0.0, weight, SILU_MUL if silu_mul else PLAIN, tile, lane)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None,
            eps: float, weight: torch.Tensor, input_op: int, tile: Tile | RowTile | None,
            lane: SendLane | None = None, out: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch into ``out`` (a new tensor if None); with a ``lane`` (SEND) nothing is
    returned in ``out`` (it is ``x``)."""
    assert x.stride(-1) == 1, "x must have contiguous rows"
    assert weight.dim() == 2 and weight.stride(-1) == 1, "weight must be (N, K) row-major"
    m = x.shape[0]
    n, k = weight.shape
    for t in (residual, norm_weight):
        assert t is None or t.dtype == x.dtype, "inputs must share the activation dtype"
    assert x.dtype == weight.dtype, (x.dtype, weight.dtype)
    assert lane is None or m == 1
    reduce = NO_REDUCE if lane is None else SEND
    if lane is not None:
        out = x
    elif out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if m == 0 or n == 0 or k == 0:  # nothing to launch (an empty sum is zero)
        if res_out is not None and residual is not None:
            res_out.copy_(x + residual)
        return out.zero_(), res_out
    if tile is None:
        tile = row_tile(input_op, m, n, k, reduce, sms=sm_count(x.device)) or \
            pick_tile(input_op, m, n, k, device_name(x.device) if x.is_cuda else "")
    if isinstance(tile, RowTile):
        assert m == 1, "the row kernel takes one row"
        _launch_row(x, residual, norm_weight, eps, weight, out, res_out, input_op, tile, lane)
        return out, res_out
    block_m = next_power_of_2(m)
    res_in = residual if residual is not None else x
    res_dst = res_out if res_out is not None else out
    nw = norm_weight if norm_weight is not None else x
    strides = (x.stride(0), res_in.stride(0), weight.stride(0), out.stride(0), res_dst.stride(0))
    # Key: what the JIT specializes on besides pointer alignment (dtype, integers).
    one_pass = tile.one_pass and input_op >= RMS_NORM
    red, world = _lane_args(x, lane)
    key = (x.dtype, m, n, k, strides, input_op, block_m, tile.block_n, tile.block_k, one_pass,
           reduce, world, red[2:])
    _launcher(tile.num_warps, tile.num_stages).launch(
        (cdiv(n, tile.block_n), 1, 1), key,
        (x, res_in, nw, weight, out, res_dst, m, n, k, *strides, 1.0 / k, eps, *red),
        {"INPUT_OP": input_op, "BLOCK_M": block_m, "BLOCK_N": tile.block_n,
         "BLOCK_K": tile.block_k, "ONE_PASS": one_pass, "REDUCE": reduce, "WORLD": world})
    return out, res_out


def _lane_args(x: torch.Tensor, lane: SendLane | None
               ) -> tuple[tuple[torch.Tensor, torch.Tensor, int, int], int]:
    """The kernels' SEND arguments (every rank's buffer, the lane's counters, rank,
    elements per region; ``x`` stands in where there is no lane), and the world size."""
    if lane is None:
        return (x, x, 0, 0), 1
    return (lane.bases, lane.counters, lane.rank, lane.region_elems), lane.world


def _launch_row(x: torch.Tensor, residual: torch.Tensor | None,
                norm_weight: torch.Tensor | None, eps: float, weight: torch.Tensor,
                out: torch.Tensor, res_out: torch.Tensor | None, input_op: int, tile: RowTile,
                lane: SendLane | None) -> None:
    """``_skinny_row_kernel`` on the grid of ``row_programs``, sized the first time a
    specialization launches to the programs its compiled kernel fits on an SM
    (``row_grid``)."""
    n, k = weight.shape
    reduce = NO_REDUCE if lane is None else SEND
    red, world = _lane_args(x, lane)
    block_k = next_power_of_2(k)
    # Key: what the JIT specializes on besides pointer alignment (dtype, integers).
    key = (x.dtype, n, k, weight.stride(0), input_op, tile.block_n, block_k, reduce, world,
           red[2:])
    launcher = _row_launcher(tile.num_warps)
    args = (x, residual if residual is not None else x,
            norm_weight if norm_weight is not None else x, weight, out,
            res_out if res_out is not None else out, n, k, weight.stride(0), 1.0 / k, eps, *red)
    constexprs = {"INPUT_OP": input_op, "BLOCK_N": tile.block_n, "BLOCK_K": block_k,
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
