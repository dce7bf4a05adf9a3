"""The skinny GEMM's launch shapes: which tile a launch takes, and the row kernel's grid.

``Tile`` shapes the classic kernel, ``RowTile`` the persistent row kernel. A one-row
shape takes the tile tuned for it on this GPU (``tiles.json``, written by the tuner
``bench.kernels.skinny_gemm --tiles-out``), else ``default_tile``; the row kernel takes one-row
launches by ``row_tile``'s rule while the row-kernel switch is on. ``resident_programs``
is the occupancy model that caps the row kernel's grid. The reasons behind each rule are in
``docs/kernels.md``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from executor.kernels import switches
from executor.kernels.fast_launch import cdiv, next_power_of_2
from executor.kernels.skinny.kernel import ADD_RMS_NORM, NO_REDUCE, PLAIN, RMS_NORM, SEND, SILU_MUL


@dataclass(frozen=True)
class Tile:
    """Launch shape: output columns and K chunk per program, warps per program, Triton's
    software-pipelining depth of the K loop, and (RMSNorm input ops only) whether the
    sum of squares is gathered in the product's pass (``_one_pass_norm_product``)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3  # Triton's default
    one_pass: bool = False


# Tuned tiles at M = 1, by (input op, N, K) and the GPU they were tuned on: written by
# ``bench.kernels.skinny_gemm --tiles-out`` from a sweep on the GPU (each candidate checked against
# the unfused path) and shipped beside this module. A GPU takes its own tile for a shape,
# else the first GPU's the file lists for it; shapes missing from it take ``default_tile``.
# (The file's rows name the input op "prologue".)
TILES_FILE = Path(__file__).with_name("tiles.json")
_TUNED: dict[tuple[int, int, int], dict[str, Tile]] | None = None
#: (input op, N, K, device) whose sweep found the unfused path (the norm or SiLU kernel,
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


def cublas_faster(input_op: int, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this GPU's sweep left ``x @ weight.T`` with this input op to the unfused
    path (one row only: the sweep runs at M = 1)."""
    if x.shape[0] != 1:
        return False
    tuned_tiles()
    device = device_name(x.device) if x.is_cuda else ""
    n, k = weight.shape
    return (ADD_RMS_NORM if input_op == RMS_NORM else input_op, n, k, device) in _CUBLAS


def pick_tile(input_op: int, m: int, n: int, k: int, device: str = "") -> Tile:
    """The tile tuned for this shape at M = 1 on ``device`` (a CUDA device name), else on
    the first GPU the file names for it, else ``default_tile``."""
    if m == 1:  # the first layer's norm (no residual) takes its add-norm twin's tile
        tuned = tuned_tiles().get((ADD_RMS_NORM if input_op == RMS_NORM else input_op, n, k))
        if tuned:
            return tuned.get(device) or next(iter(tuned.values()))
    return default_tile(m, n, k, input_op)


@functools.cache
def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def default_tile(m: int, n: int, k: int, input_op: int = PLAIN) -> Tile:
    """Untuned shapes: K chunks of up to 2048 columns; plain inputs 2 output columns per
    program with 8 warps, fused input ops 4 columns with 4 warps (each of those programs
    also reads its input rows, the norm twice, so fewer, wider programs pay off). Fewer K
    per chunk as rows grow (M x chunk products sit in registers)."""
    block_m = next_power_of_2(m)
    block_k = max(64, min(next_power_of_2(k), 2048 // block_m))
    if input_op == PLAIN:
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
#: sits in each program's registers beside two weight blocks; shorter rows keep their tuned
#: classic tiles, longer ones the classic kernel's K loop.
ROW_KERNEL_K = (2048, 8192)
#: Outputs the row kernel takes by default: stored, and sent into the push all-reduce
#: (the tensor-parallel o_proj/down_proj).
ROW_KERNEL_REDUCE = (NO_REDUCE, SEND)
#: Column blocks per program of a full grid below which default launches keep the classic
#: kernel: with fewer, the grid saves too little input-op work to pay for its start.
ROW_KERNEL_MIN_BLOCKS = 2
#: The same for plain inputs (o_proj), which have no input op to repeat: from one block a
#: program the row kernel's unbroken weight stream wins (Qwen3-30B-A3B's o_proj, 1024
#: blocks), while a norm input at that share (the 1B's qkv, 768 blocks) slows the
#: attention after it more than it gains (docs/experiments.md).
ROW_KERNEL_MIN_BLOCKS_PLAIN = 1
#: SMs the interpreter's grid is sized for (no GPU): two, so programs loop.
_INTERPRETER_SMS = 2


def row_tile(input_op: int, m: int, n: int, k: int, reduce: int = NO_REDUCE, *,
             sms: int) -> RowTile | None:
    """The row kernel's tile for a launch it takes by default on a GPU of ``sms`` SMs,
    else None (the classic kernel): the switch on (``switches.active().row_kernel``), one
    row, an output kind in ``ROW_KERNEL_REDUCE``, ``K`` in ``ROW_KERNEL_K``, and at least
    ``ROW_KERNEL_MIN_BLOCKS`` column blocks for each program of a full grid
    (``ROW_KERNEL_MIN_BLOCKS_PLAIN`` for a plain input). 8 warps;
    SiLU-and-mul inputs (the down projection, the widest K) 2 columns per block and 2
    programs per SM, the others 4 columns up to K = 2048 and 2 above, 4 programs per SM."""
    if not switches.active().row_kernel or m != 1 or reduce not in ROW_KERNEL_REDUCE \
            or not ROW_KERNEL_K[0] <= k <= ROW_KERNEL_K[1]:
        return None
    tile = RowTile(2, 8, 2) if input_op == SILU_MUL else RowTile(4 if k <= 2048 else 2, 8, 4)
    least = ROW_KERNEL_MIN_BLOCKS_PLAIN if input_op == PLAIN else ROW_KERNEL_MIN_BLOCKS
    if cdiv(n, tile.block_n) < least * tile.programs_per_sm * sms:
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
    input op) would otherwise run its persistent grid in two rounds."""
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
