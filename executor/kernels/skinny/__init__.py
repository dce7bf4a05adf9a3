"""Skinny GEMM for decode: ``x @ W.T`` with few rows, the input's norm or SiLU-and-mul fused.

    kernel  the classic and the persistent row Triton kernels (``INPUT_OP``, ``REDUCE``)
    tiles   launch shapes: tuned tiles (``tiles.json``), defaults, the row-kernel rule,
            the occupancy model
    ops     launchers: ``skinny_gemm``, ``skinny_norm_gemm``, ``send_linear``
    linear  where the model's projections take it: ``linear`` and its fused twins

The design (why no split-K, the row kernel, the tuned tiles) is in ``docs/kernels.md``.
"""

from executor.kernels.skinny.kernel import (
    ADD_RMS_NORM,
    NO_REDUCE,
    PLAIN,
    RMS_NORM,
    SEND,
    SILU_MUL,
)
from executor.kernels.skinny.linear import (
    MAX_ROWS,
    add_rms_norm_linear,
    linear,
    serves,
    silu_and_mul_linear,
    takes,
)
from executor.kernels.skinny.ops import SendLane, send_linear, skinny_gemm, skinny_norm_gemm
from executor.kernels.skinny.tiles import (
    ROW_KERNEL_K,
    ROW_KERNEL_MIN_BLOCKS,
    ROW_KERNEL_MIN_BLOCKS_PLAIN,
    ROW_KERNEL_REDUCE,
    TILES_FILE,
    RowTile,
    Tile,
    cublas_faster,
    default_tile,
    device_name,
    pick_tile,
    resident_programs,
    row_programs,
    row_tile,
    sm_count,
    tuned_tiles,
)

__all__ = ["ADD_RMS_NORM", "MAX_ROWS", "NO_REDUCE", "PLAIN", "RMS_NORM", "ROW_KERNEL_K",
           "ROW_KERNEL_MIN_BLOCKS", "ROW_KERNEL_MIN_BLOCKS_PLAIN", "ROW_KERNEL_REDUCE", "SEND",
           "SILU_MUL", "TILES_FILE", "RowTile", "SendLane", "Tile", "add_rms_norm_linear",
           "cublas_faster", "default_tile", "device_name", "linear", "pick_tile",
           "resident_programs", "row_programs", "row_tile", "send_linear", "serves",
           "silu_and_mul_linear", "skinny_gemm", "skinny_norm_gemm", "sm_count", "takes",
           "tuned_tiles"]
