"""FP8 (e4m3) arithmetic in plain torch: quantize, dequantize, and the activation scales.

The reference of every FP8 path: the dequantize-at-load fallback uses it, the tests write
checkpoints with it and check the kernels against it. Scales are float32 multipliers:
``real = fp8_value * scale`` (the checkpoint's ``weight_scale_inv`` is one too).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
#: Smallest scale, so an all-zero row or block quantizes to zeros, not NaN.
MIN_SCALE = 1e-12


def _over_max(amax: torch.Tensor) -> torch.Tensor:
    """``amax / FP8_MAX``, correctly rounded on every device. (CUDA torch divides by a
    Python scalar as a multiply by its reciprocal, one ulp off at times; a one-ulp scale
    moves values across e4m3 rounding boundaries, so the Triton activation kernel, which
    divides exactly, would not be reproducible from this reference.)"""
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel: ``w`` (N, K) -> (fp8 (N, K), float32 scales (N, 1))."""
    w32 = w.float()
    scale = _over_max(w32.abs().amax(dim=1, keepdim=True)).clamp_min(MIN_SCALE)
    return (w32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor: ``w`` -> (fp8, float32 scalar scale ())."""
    w32 = w.float()
    scale = _over_max(w32.abs().amax()).clamp_min(MIN_SCALE)
    return (w32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise: ``w`` (N, K) -> (fp8 (N, K), float32 scales (ceil(N/bn), ceil(K/bk)));
    partial blocks at the edges get their own scale."""
    n, k = w.shape
    scale = _over_max(block_amax(w.float(), block)).clamp_min(MIN_SCALE)
    full = expand_blocks(scale, block, n, k)
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bn, bk = block
    n, k = w.shape
    pn, pk = -(-n // bn) * bn, -(-k // bk) * bk
    padded = torch.zeros(pn, pk, dtype=w.dtype, device=w.device)
    padded[:n, :k] = w.abs()
    return padded.view(pn // bn, bn, pk // bk, bk).amax(dim=(1, 3))


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """Block scales (ceil(N/bn), ceil(K/bk)) -> one per element (N, K)."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (N, K) fp8 times its scales -> (N, K) in ``dtype``. ``scale``: block
    scales (with ``block``), (N, 1) per row, or one scalar. The product is float32, then
    rounded once to ``dtype``."""
    n, k = weight.shape
    w32 = weight.float()
    if block is not None:
        w32 = w32 * expand_blocks(scale.float(), block, n, k)
    else:
        w32 = w32 * scale.float().reshape(-1, 1) if scale.numel() > 1 else w32 * scale.float()
    return w32.to(dtype)


def quantize_activations(x: torch.Tensor, static_scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``x`` (M, K) -> (fp8 (M, K), float32 scales (M, 1)): per token
    (dynamic), or with one ``static_scale`` for every token."""
    x32 = x.float()
    if static_scale is None:
        scale = _over_max(x32.abs().amax(dim=1, keepdim=True)).clamp_min(MIN_SCALE)
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.contiguous()
