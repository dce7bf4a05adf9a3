"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, gated MLP.

Numerics follow the Hugging Face reference implementations (RMSNorm in float32, RoPE
tables in float32 cast to the activation dtype) so float32 logits match it tightly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from executor.model.spec import RopeSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(rope: RopeSpec, head_dim: int, device: torch.device) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) in float32, for the supported RoPE types."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Llama 3.1 frequency-dependent scaling: long wavelengths are divided by ``factor``,
        # short ones kept, and the band between interpolated smoothly.
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with a precomputed cos/sin table.

    The table covers ``max_positions`` positions so a forward is one gather, which is
    also what makes it capturable in a CUDA graph (positions live in a static buffer).
    """

    def __init__(self, rope: RopeSpec, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_positions = rope, head_dim, max_positions
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.init_tables(torch.device("cpu"))

    def init_tables(self, device: torch.device) -> None:
        """(Re)compute the tables on ``device``; the loader calls this after materializing
        a model built on the meta device."""
        if device.type == "meta":
            return
        inv_freq = rope_inv_freq(self.rope, self.head_dim, device)
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # (positions, head_dim // 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (positions, head_dim)
        self.cos, self.sin = emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (T, heads, head_dim), k: (T, kv_heads, head_dim), positions: (T,)."""
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)  # (T, 1, head_dim)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)
