"""FP8 expert weights for the fused-MoE kernel tests: stacked experts quantized per expert
with ``executor.quant.fp8`` (per output channel or per 128x128 block), dequantized back to
float32 for the reference, and that reference rounded where the kernels round."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from executor.quant.fp8 import dequantize, quantize_blocks, quantize_rows

BLOCK = (128, 128)
LAYOUTS = ("channel", "block")


def quantize_experts(w: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked experts ``(E, rows, cols)`` -> e4m3 ``(E, rows, cols)`` and float32 scales
    ``(E, rows)`` (channel) or ``(E, cdiv(rows, 128), cdiv(cols, 128))`` (block)."""
    qs, ss = [], []
    for e in range(w.shape[0]):
        q, s = quantize_blocks(w[e], BLOCK) if layout == "block" else quantize_rows(w[e])
        qs.append(q)
        ss.append(s if layout == "block" else s.reshape(-1))
    return torch.stack(qs), torch.stack(ss).contiguous()


def dequantize_experts(q: torch.Tensor, s: torch.Tensor, layout: str) -> torch.Tensor:
    """The float32 experts ``q`` and its scales stand for."""
    block = BLOCK if layout == "block" else None
    return torch.stack([dequantize(q[e], s[e], block, torch.float32)
                        for e in range(q.shape[0])])


def fp8_kwargs(s13: torch.Tensor, s2: torch.Tensor, layout: str) -> dict[str, Any]:
    """The kernels' keyword arguments for the scales of ``layout``."""
    return {"w13_scale": s13, "w2_scale": s2, "block": BLOCK if layout == "block" else None}


def rounded_reference(x: torch.Tensor, d13: torch.Tensor, d2: torch.Tensor,
                      weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The experts on float32 weights ``d13`` / ``d2`` with ``x``'s values, rounded to
    ``x``'s dtype where the kernels round: each GEMM's output, SiLU, the product, the
    weighted output; the ``top_k`` outputs summed in float32."""
    dt = x.dtype
    inter = d13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in ids.unique().tolist():
        token, slot = torch.where(ids == expert)
        xs = x[token].float()
        gate = (xs @ d13[expert, :inter].T).to(dt).float()
        up = (xs @ d13[expert, inter:].T).to(dt).float()
        act = (nn.functional.silu(gate).to(dt).float() * up).to(dt).float()
        y = (act @ d2[expert].T).to(dt).float()
        out.index_add_(0, token, (y * weights[token, slot, None]).to(dt).float())
    return out.to(dt)
