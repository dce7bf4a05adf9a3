"""FP8 (e4m3) expert weights: their scale layouts, checked, as the kernels' arguments.

Without scales the weights are in the activation dtype (``NONE``: the kernels compile as
they always did). With scales they are e4m3, each value dequantized in registers
(``fp8.to(float32) * scale``): per output channel (``CHANNEL``: ``(E, rows)``) or per
128x128 block (``BLOCKS``: ``(E, cdiv(rows, 128), cdiv(cols, 128))``, the DeepSeek /
Qwen3-FP8 layout; a chunk of the reduction lies inside one block column, so the kernels
scale each chunk's products, or its partial sums, by one scale per output row).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

NONE, CHANNEL, BLOCKS = 0, 1, 2
#: The only block shape served (square, as every FP8 checkpoint publishes it).
BLOCK = 128
FP8 = torch.float8_e4m3fn


class ScaleArgs(NamedTuple):
    """A weight's scales as kernel arguments: ``mode`` (the ``W_SCALES`` constexpr), the
    tensor (the weight itself as a placeholder with ``NONE``: never read), and the strides
    of its expert and row (a row block with ``BLOCKS``; the block column's stride is 1)."""

    mode: int
    scale: torch.Tensor
    stride_e: int
    stride_r: int


def scale_args(name: str, weight: torch.Tensor, scale: torch.Tensor | None,
               block: tuple[int, int] | None) -> ScaleArgs:
    """``weight`` ``(E, rows, cols)`` and its ``scale`` checked against the layout
    (``ValueError`` naming the tensor) and turned into kernel arguments."""
    if scale is None:
        if weight.dtype == FP8:
            raise ValueError(f"{name}: e4m3 weights need their scales")
        return ScaleArgs(NONE, weight, 0, 0)
    if weight.dtype != FP8:
        raise ValueError(f"{name}: scales given, so e4m3 weights are expected, "
                         f"got {weight.dtype}")
    if scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"{name} scales: contiguous float32 expected, got {scale.dtype}"
                         f"{'' if scale.is_contiguous() else ' (not contiguous)'}")
    experts, rows, cols = weight.shape
    if block is None:
        if tuple(scale.shape) != (experts, rows):
            raise ValueError(f"{name} scales: per-channel shape {(experts, rows)} expected, "
                             f"got {tuple(scale.shape)}")
        return ScaleArgs(CHANNEL, scale, scale.stride(0), 1)
    if tuple(block) != (BLOCK, BLOCK):
        raise ValueError(f"{name}: only {BLOCK}x{BLOCK} scale blocks are served, got {block}")
    want = (experts, -(-rows // BLOCK), -(-cols // BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(f"{name} scales: block shape {want} expected, "
                         f"got {tuple(scale.shape)}")
    return ScaleArgs(BLOCKS, scale, scale.stride(0), scale.stride(1))


def check_pair(w_gate_up: torch.Tensor, w_down: torch.Tensor, w13_scale: torch.Tensor | None,
               w2_scale: torch.Tensor | None, block: tuple[int, int] | None
               ) -> tuple[ScaleArgs, ScaleArgs]:
    """Both weights' scale arguments: both FP8 with scales of one layout, or neither;
    with blocks the experts' width is a multiple of the block, so gate's blocks end where
    up's begin."""
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("w13_scale and w2_scale: give both or neither")
    if block is not None and w13_scale is None:
        raise ValueError("block: scale blocks given without scales")
    if block is not None and (w_gate_up.shape[1] // 2) % BLOCK:
        raise ValueError(f"w_gate_up: block scales need the experts' width to be a multiple "
                         f"of {BLOCK}, got {w_gate_up.shape[1] // 2}")
    return (scale_args("w_gate_up", w_gate_up, w13_scale, block),
            scale_args("w_down", w_down, w2_scale, block))
