"""The element-wise work Gemma adds to a decoder layer, in two implementations.

``GEMMA_TORCH_OPS`` follows Hugging Face's Gemma modules op for op (the norm in float32,
times ``1 + weight`` in float32, rounded once; the residual add in the activation dtype);
``GEMMA_TRITON_OPS`` runs the same arithmetic as one kernel per call
(``executor.kernels.gemma``). ``select_gemma_ops`` follows the ``LayerOps`` picked for the
forward, so the kernels run exactly where the Llama family's fused kernels do.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from executor.model.layers import (
    TORCH_OPS,
    TRITON_OPS,
    KernelChoice,
    LayerOps,
    triton_available,
)


class GemmaNormOps(Protocol):
    """Inputs are left unchanged; rows are the leading dims, normalized over the last."""

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``normalize(x) * (1 + weight)`` in float32, rounded to ``x``'s dtype."""
        ...

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                 pre: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``s = residual + norm(x, post)`` (the sum in the activation dtype); returns
        ``(norm(s, pre), s)``: a sublayer's post-norm, the residual add, and the next
        sublayer's pre-norm."""
        ...

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` for ``gate_up`` ``(T, 2 * I)`` -> ``(T, I)``."""
        ...

    def norm_rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
                  k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head of q ``(T, heads, D)`` and k ``(T, kv_heads, D)`` normed (``norm``),
        then rotated at ``positions`` (``LayerOps.rope``; Gemma 3's q/k norm)."""
        ...


class GemmaTorchOps:
    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (x32 * (1.0 + weight.float())).to(x.dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                 pre: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        summed = residual + self.norm(x, post, eps)
        return self.norm(summed, pre, eps), summed

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.gelu(gate, approximate="tanh") * up

    def norm_rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
                  k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = self.norm(q, q_weight, eps), self.norm(k, k_weight, eps)
        return TORCH_OPS.rope(positions, q, k, cos, sin, None, None, eps)


class GemmaTritonOps:
    """The kernels of ``executor.kernels.gemma`` (imported at the first call, as
    ``TritonOps`` does, so importing the model never imports Triton)."""

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from executor.kernels import gemma

        return gemma.gemma_rms_norm(x, weight, eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                 pre: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        from executor.kernels import gemma

        return gemma.gemma_add_norm(x, residual, post, pre, eps)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        from executor.kernels import gemma

        return gemma.gelu_tanh_and_mul(gate_up)

    def norm_rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
                  k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        from executor import kernels

        # One launch: the RoPE kernel's per-head norm in Gemma's arithmetic.
        return kernels.rope_qk(q, k, positions, cos, sin, q_weight, k_weight, eps,
                               offset_norm=True)


GEMMA_TORCH_OPS = GemmaTorchOps()
GEMMA_TRITON_OPS = GemmaTritonOps()


def prepare_gemma_kernels(choice: KernelChoice) -> None:
    """Import (and so register) the Gemma kernels now where ``choice`` may pick them, so a
    Dynamo trace never runs their first import (as ``layers.prepare_kernels``)."""
    if choice == "triton" or (choice == "auto" and torch.cuda.is_available()
                              and triton_available()):
        import executor.kernels.gemma  # noqa: F401


def select_gemma_ops(ops: LayerOps) -> GemmaNormOps:
    """The Gemma ops matching the forward's ``LayerOps``."""
    return GEMMA_TRITON_OPS if ops is TRITON_OPS else GEMMA_TORCH_OPS
