"""Launch shapes of the FP8 kernels and which kernel takes a row bucket: tuned ones as
data, defaults otherwise.

A launch of ``(scales, rows, N, K, input op, GLU)`` takes the tile tuned for it on this GPU
(``tiles.json`` beside this module, written by ``bench.kernels.fp8_gemm --sweep
--tiles-out``), else the first GPU's the file lists for it, else the default: one row on a
GPU the persistent row kernel's ``default_row_tile`` where it takes the shape, else
``default_tile`` (the w8a16 kernel). Rows are bucketed to powers of two up to 64 (the
sweep times each bucket's top). A file row's ``kernel`` names the path it measured
fastest: at one row ``"w8a16"`` (``Fp8Tile``; rows without the field) or ``"row"``
(``Fp8RowTile``); from ``DOT_MIN_ROWS`` rows ``"w8a16"``, ``"dot"`` (the FP8 x FP8
kernel, its tile in ``dot_tile``) or ``"scaled_mm"`` (``skinny_kernel``); a bucket the
sweep did not time takes the nearest timed one's. A row with ``"glu": true`` is the gated
epilogue's launch of a fused gate|up weight (``launch.w8a16_glu``; ``n``: the weight's
rows, ``tile`` block: output columns, twice that many weight rows), tuned apart from the
plain launch of the same weight; its ``scaled_mm_us`` (the unfused cuBLAS FP8 path) is
informative only.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from executor.kernels.fast_launch import cdiv, next_power_of_2

TILES_FILE = Path(__file__).with_name("tiles.json")
#: Rows from which ``tl.dot`` (16-row tiles) multiplies; fewer reduce on the CUDA cores,
#: where the input ops can be fused in.
DOT_MIN_ROWS = 8
# The skinny kernels' input ops (``executor.kernels.skinny.kernel``), restated here so
# this module needs no Triton: PLAIN, SILU_MUL, RMS_NORM, ADD_RMS_NORM.
PLAIN, SILU_MUL, RMS_NORM, ADD_RMS_NORM = 0, 1, 2, 3


@dataclass(frozen=True)
class Fp8Tile:
    """Output columns and K chunk per program, warps, pipelining depth (0: the device's
    default, ``launch.stages``)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 0


@dataclass(frozen=True)
class Fp8RowTile:
    """Launch shape of the persistent row kernel (``row_kernel.py``): output columns per
    block, warps per program, programs per SM (the grid is at most that many times the
    SM count, fewer where fewer fit), and the weight pipeline's depth (0: the next block
    prefetched in registers; 2 or more: Triton's pipelined loop, that many stages in
    shared memory)."""

    block_n: int
    num_warps: int = 8
    programs_per_sm: int = 4
    num_stages: int = 0


def rows_bucket(m: int) -> int:
    """The tuned-tile bucket of ``m`` rows: the next power of two, at most 128 (more)."""
    return min(next_power_of_2(m), 128)


def block_m(m: int) -> int:
    """Rows per program: all of them on the CUDA cores, 16 to 64 on the tensor cores."""
    return next_power_of_2(m) if m < DOT_MIN_ROWS else min(max(16, next_power_of_2(m)), 64)


def default_tile(m: int, n: int, k: int, blocks: bool, input_op: int = PLAIN,
                 glu: bool = False) -> Fp8Tile:
    """Untuned shapes. CUDA cores (fewer than ``DOT_MIN_ROWS`` rows): the bf16 skinny
    GEMM's shape (narrow programs, long K chunks: many programs in flight, each streaming
    its rows), 4 weight rows per program (FP8 rows are half the bytes; GLU: 2 columns of
    a gate and an up row each) over 8 warps, which keeps a fused input op's program under
    96 registers on Hopper (8 columns over 4 warps take 224). Tensor cores: 64 columns
    (128 above 64 rows), 128-column chunks (a block's width)."""
    if m < DOT_MIN_ROWS:
        return Fp8Tile(2 if glu else 4,
                       max(64, min(next_power_of_2(k), 2048 // next_power_of_2(m))), 8)
    return Fp8Tile(64 if m <= 64 else 128, 128 if blocks or k >= 128 else 64,
                   4 if m <= 64 else 8)


@dataclass(frozen=True)
class DotTile:
    """The FP8 x FP8 kernel's launch (``dot_kernel``): output columns and K chunk per
    program, K slices (split-K), warps, pipelining depth (0: the device's default), and
    whether the weight rows take the MMA's M side (``swap_ab``: few activation rows then
    fill its narrow N side instead of padding M)."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 0
    swap_ab: bool = True


def default_dot_tile(m: int, n: int, k: int, blocks: bool) -> DotTile:
    """Untuned shapes: 64 columns per program in 128-column chunks (a block's width), K
    split in two, four or eight until the programs cover the SMs of a large GPU about
    twice (skinny rows read each weight byte once: the SMs must all be reading), keeping
    slices of at least 512 columns."""
    split = 1
    while cdiv(n, 64) * split < 200 and split < 8 and k >= 1024 * split:
        split *= 2
    return DotTile(64, 128, split)


# The paths of 8 to 64 rows of a per-channel or block-scaled projection (``kernel``).
W8A16_KERNEL, DOT_KERNEL, SCALED_MM_KERNEL = "w8a16", "dot", "scaled_mm"


#: How much faster cuBLAS FP8 (activation quantization + ``torch._scaled_mm``) must have
#: been than the best tile for a row bucket to take it: w8a16 keeps the input op fused.
SCALED_MM_MARGIN = 0.9


#: Inner sizes ``K`` up to which the row kernel takes one-row launches by default: its
#: input row sits in registers (activation dtype) beside two weight blocks.
ROW_MAX_K = 16384
#: Weight bytes per column block the default row tile aims at (the bf16 row kernel's
#: 4 x 2048 bf16 block): FP8 takes twice the columns of a bf16 block of the same K.
ROW_BLOCK_BYTES = 16384


def default_row_tile(n: int, k: int, sms: int, glu: bool = False) -> Fp8RowTile | None:
    """The row kernel's untuned tile for one row of an (N, K) projection on ``sms`` SMs,
    or None where the w8a16 kernel takes it: ``K`` above ``ROW_MAX_K``, or fewer column
    blocks than a full grid has programs (the grid would save no input-op work). Up to
    K = 8192: columns per block for ``ROW_BLOCK_BYTES`` (at most 8), 8 warps, 2 programs
    per SM, a 3-stage pipeline (each program computes the input row, so few programs, each
    with blocks in flight through shared memory); longer rows (registers: the row itself)
    2 columns over 16 warps, one program per SM, 4 stages. GLU (``n``: the fused gate|up
    weight's rows): the same weight rows per block, as half as many output columns."""
    kp = next_power_of_2(k)
    if kp > ROW_MAX_K:
        return None
    tile = Fp8RowTile(max(1, min(8, ROW_BLOCK_BYTES // kp)), 8, 2, 3) if kp <= 8192 \
        else Fp8RowTile(2, 16, 1, 4)
    if cdiv(n, tile.block_n) < tile.programs_per_sm * sms:
        return None
    return replace(tile, block_n=max(1, tile.block_n // 2)) if glu else tile


def _tile(row: dict[str, Any]) -> Fp8Tile | Fp8RowTile:
    """A file row's tile, by its ``kernel`` (rows without one are the w8a16 kernel's)."""
    return Fp8RowTile(*row["tile"]) if row.get("kernel") == "row" else Fp8Tile(*row["tile"])


#: A tuned tile's key: scales ("rows"/"blocks"), rows bucket, N (weight rows), K, input
#: op, GLU.
TileKey = tuple[str, int, int, int, int, bool]


@functools.cache
def tuned_tiles() -> dict[TileKey, dict[str, Fp8Tile | Fp8RowTile]]:
    """``TileKey`` -> device name -> tile, read once."""
    out: dict[TileKey, dict[str, Fp8Tile | Fp8RowTile]] = {}
    for row in _rows():
        key = (row["scales"], row["m"], row["n"], row["k"], row["input_op"],
               bool(row.get("glu", False)))
        out.setdefault(key, {})[row.get("device", "")] = _tile(row)
    return out


@functools.cache
def _scaled_mm_faster() -> frozenset[tuple[int, int, int, str]]:
    """(rows bucket, N, K, device) where the sweep found cuBLAS FP8 faster (per-channel
    scales, by ``SCALED_MM_MARGIN``)."""
    return frozenset((r["m"], r["n"], r["k"], r.get("device", "")) for r in _rows()
                     if r["scales"] == "rows" and "scaled_mm_us" in r and not r.get("glu")
                     and r["scaled_mm_us"] <= SCALED_MM_MARGIN * r["us"])


def scaled_mm_faster(m: int, n: int, k: int, device: str) -> bool:
    """Whether ``m`` rows of an (N, K) per-channel projection go to cuBLAS FP8 on this GPU
    although the w8a16 kernel takes up to ``gemm.SKINNY_MAX_ROWS`` (measured, not assumed:
    the sweep records both)."""
    return (rows_bucket(m), n, k, device) in _scaled_mm_faster()


@functools.cache
def _dot_rows() -> dict[tuple[str, int, int, int, str], tuple[str, DotTile | None]]:
    """(scales, rows bucket, N, K, device) -> (the fastest path's name, the dot tile), for
    the rows of ``DOT_MIN_ROWS`` and more that name one."""
    out: dict[tuple[str, int, int, int, str], tuple[str, DotTile | None]] = {}
    for r in _rows():
        if "kernel" in r and r["m"] >= DOT_MIN_ROWS and not r.get("glu"):
            tile = DotTile(*r["dot_tile"]) if "dot_tile" in r else None
            out[(r["scales"], r["m"], r["n"], r["k"], r.get("device", ""))] = (r["kernel"], tile)
    return out


def skinny_kernel(m: int, n: int, k: int, blocks: bool, device: str) -> str:
    """Which path ``m`` rows (``DOT_MIN_ROWS`` to ``gemm.SKINNY_MAX_ROWS``) of an (N, K)
    projection take on this GPU: the sweep's fastest. Otherwise (untuned, or a row of an
    older sweep without ``kernel``): per-channel scales cuBLAS FP8 where it was measured
    faster than w8a16 (``scaled_mm_faster``), else the FP8 x FP8 kernel (w8a16 is a bf16
    ``tl.dot`` with twice its operand bytes); block scales w8a16 (no activation rounding)
    until a sweep says otherwise."""
    got = _dot_row(m, n, k, blocks, device)
    if got is not None:
        return got[0]
    if blocks:
        return W8A16_KERNEL
    return SCALED_MM_KERNEL if scaled_mm_faster(m, n, k, device) else DOT_KERNEL


def pick_dot_tile(m: int, n: int, k: int, blocks: bool, device: str) -> DotTile:
    """The FP8 x FP8 kernel's tile for a launch: tuned on this GPU, else the default."""
    got = _dot_row(m, n, k, blocks, device)
    tile = got[1] if got is not None else None
    # (a tile with the activation rows on the MMA's M side is swept from 32 rows only)
    if tile is None or (not tile.swap_ab and m <= 16):
        return default_dot_tile(m, n, k, blocks)
    return tile


def _dot_row(m: int, n: int, k: int, blocks: bool, device: str
             ) -> tuple[str, DotTile | None] | None:
    """The sweep's row for ``m``'s bucket on this GPU; a bucket the sweep did not time
    (it times 8 and 64 rows) takes the nearest one it did, the larger first."""
    rows = _dot_rows()
    scales = "blocks" if blocks else "rows"
    bucket = rows_bucket(m)
    near = sorted((b for b in (8, 16, 32, 64) if (scales, b, n, k, device) in rows),
                  key=lambda b: (abs(b.bit_length() - bucket.bit_length()), -b))
    return rows[(scales, near[0], n, k, device)] if near else None


def _rows() -> list[dict[str, Any]]:
    if not TILES_FILE.is_file():
        return []
    return list(json.loads(TILES_FILE.read_text())["tiles"])


def pick_tile(m: int, n: int, k: int, blocks: bool, input_op: int, device: str,
              row_sms: int = 0, glu: bool = False) -> Fp8Tile | Fp8RowTile:
    """The tile for a launch (see the module docstring). ``row_sms``: the GPU's SMs where
    the row kernel may run (0: it may not; a tuned row tile then gives way to the
    defaults too). ``glu``: the gated epilogue's launch of an (N, K) gate|up weight."""
    op = ADD_RMS_NORM if input_op == RMS_NORM else input_op  # the norms share tiles
    tuned = tuned_tiles().get(("blocks" if blocks else "rows", rows_bucket(m), n, k, op, glu))
    tile = (tuned.get(device) or next(iter(tuned.values()))) if tuned else None
    if tile is not None and (row_sms or not isinstance(tile, Fp8RowTile)):
        return tile
    row = default_row_tile(n, k, row_sms, glu) if m == 1 and row_sms else None
    return row or default_tile(m, n, k, blocks, input_op, glu)


def valid(tile: Fp8Tile | Fp8RowTile, m: int, blocks: bool) -> bool:
    """Whether the kernel takes ``tile``: the row kernel one row (any scales); the w8a16
    kernel's block scales need tensor-core chunks inside one 128-column block and
    CUDA-core chunks of whole blocks (or inside one)."""
    if isinstance(tile, Fp8RowTile):
        return m == 1
    if not blocks:
        return True
    if m >= DOT_MIN_ROWS:
        return 128 % tile.block_k == 0
    return tile.block_k % 128 == 0 or 128 % tile.block_k == 0
