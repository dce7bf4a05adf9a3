"""Building blocks of a Llama-family decoder, and the two implementations of their ops.

The modules (``RMSNorm``, ``RotaryEmbedding``, ``GatedMLP``) hold parameters and tables;
the arithmetic between the matmuls goes through a ``LayerOps``:

* ``TORCH_OPS``: plain PyTorch, op for op what Hugging Face computes (RMSNorm in float32,
  RoPE tables in float32 cast to the activation dtype), so float32 logits match it
  tightly. Used on CPU, for float32, and as the reference of the kernels' tests.
* ``TRITON_OPS``: the fused kernels of ``executor.kernels``: a few launches per layer
  instead of tens, with the same op-by-op rounding in fp16/bf16. At one row (decode at
  batch 1, ``skinny.MAX_ROWS``) plain ``nn.Linear`` projections run as a skinny GEMM with
  the norm or SiLU-and-mul before them fused in; outputs then differ from cuBLAS by
  summation order (about an ulp).

``select_ops`` picks one per forward from a ``KernelChoice`` and the activations.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Literal, Protocol

import torch
from torch import nn

from executor.model.spec import RopeSpec

# "auto": the fused Triton kernels on CUDA for fp16/bf16 activations, plain torch
# otherwise. "torch": always plain torch (e.g. to let a compiler fuse the ops itself).
# "triton": always the kernels (CPU works only under TRITON_INTERPRET=1; for tests).
KernelChoice = Literal["auto", "torch", "triton"]
KERNEL_CHOICES: tuple[KernelChoice, ...] = ("auto", "torch", "triton")
_FUSED_DTYPES = (torch.float16, torch.bfloat16)


class LayerOps(Protocol):
    """The element-wise and normalization work of a decoder layer.

    Every method returns new tensors and leaves its inputs unchanged. Shapes: rows are
    tokens ``T``; ``q`` is ``(T, heads, head_dim)``, ``k`` is ``(T, kv_heads, head_dim)``
    (strided views of the QKV output are fine: only the last dim must be contiguous).

    ``gemm_sends``: whether a row-parallel projection's GEMM may store its output straight
    into the push all-reduce's buffers (``TensorParallel.linear_all_reduce``): only the
    kernels' ops, whose one-row projections are the skinny GEMMs that can send.
    """

    gemm_sends: bool

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * normalize(x)`` over the last dim."""
        ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)``, the sum in the activation dtype."""
        ...

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
             k_norm: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half RoPE of q and k at ``positions`` from float32 ``(P, head_dim)``
        tables, after a per-head RMSNorm with weights ``q_norm``/``k_norm`` if given."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` ``(T, 2 * I)`` -> ``(T, I)``."""
        ...

    def linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``layer(x)`` for a projection ``layer`` (``(T, in)`` -> ``(T, out)``)."""
        ...

    def embed(self, table: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """``table(ids)``: the token embedding's rows ``(T, hidden)`` for ``ids`` ``(T,)``."""
        ...

    def logits(self, lm_head: nn.Module, hidden: torch.Tensor, out: torch.Tensor | None
               ) -> torch.Tensor:
        """``lm_head(hidden)`` for a bias-free ``nn.Linear`` LM head, written into ``out``
        (``(T, vocab)``) if given, else a new tensor."""
        ...

    def add_rms_norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None,
                            weight: torch.Tensor, eps: float, layer: nn.Module
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(layer(rms_norm(x + residual)), x + residual)``: a pre-norm projection; with
        ``residual=None`` the norm of ``x`` alone, and ``x`` is the residual."""
        ...

    def silu_and_mul_linear(self, gate_up: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        """``layer(silu_and_mul(gate_up))``: the down projection of a gated MLP."""
        ...

    def add_rms_norm_glu_linear(self, x: torch.Tensor, residual: torch.Tensor | None,
                                weight: torch.Tensor, eps: float, layer: nn.Module
                                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(silu_and_mul(layer(rms_norm(x + residual))), x + residual)`` for a gate_up
        ``layer``, in one launch where the layer has that GEMM and it fuses these rows
        (``executor.quant.Fp8Linear.norm_glu_linear``); else None, having computed
        nothing (the caller takes ``add_rms_norm_linear`` and ``silu_and_mul_linear``)."""
        ...


class TorchOps:
    """Plain PyTorch, following the Hugging Face modules op for op."""

    gemm_sends = False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
             k_norm: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if q_norm is not None and k_norm is not None:
            q, k = self.rms_norm(q, q_norm, eps), self.rms_norm(k, k_norm, eps)
        c = cos[positions].to(q.dtype).unsqueeze(1)  # (T, 1, head_dim)
        s = sin[positions].to(q.dtype).unsqueeze(1)
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up

    def linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer(x)  # type: ignore[no-any-return]

    def embed(self, table: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return table(ids)  # type: ignore[no-any-return]

    def logits(self, lm_head: nn.Module, hidden: torch.Tensor, out: torch.Tensor | None
               ) -> torch.Tensor:
        # (for 2-D input F.linear without a bias is this same mm: the same values)
        if out is None:
            return lm_head(hidden)  # type: ignore[no-any-return]
        return torch.mm(hidden, lm_head.weight.t(), out=out)  # type: ignore[operator]

    def add_rms_norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None,
                            weight: torch.Tensor, eps: float, layer: nn.Module
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return layer(self.rms_norm(x, weight, eps)), x
        normed, residual = self.add_rms_norm(x, residual, weight, eps)
        return layer(normed), residual

    def silu_and_mul_linear(self, gate_up: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        return layer(self.silu_and_mul(gate_up))  # type: ignore[no-any-return]

    def add_rms_norm_glu_linear(self, x: torch.Tensor, residual: torch.Tensor | None,
                                weight: torch.Tensor, eps: float, layer: nn.Module
                                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None  # (op for op: the norm, the projection, SiLU-and-mul)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TritonOps:
    """The fused kernels of ``executor.kernels`` (2-D row-major inputs for the norms).

    ``executor.kernels`` (hence Triton) is imported at the first call, never when this
    module is imported: CPU test runs import the model long before an interpreter test
    sets ``TRITON_INTERPRET``. ``prepare_kernels`` imports it ahead of any Dynamo trace.
    """

    gemm_sends = True

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from executor import kernels

        return kernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        from executor import kernels

        return kernels.add_rms_norm(x, residual, weight, eps)

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
             k_norm: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        from executor import kernels

        return kernels.rope_qk(q, k, positions, cos, sin, q_norm, k_norm, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        from executor import kernels

        return kernels.silu_and_mul(gate_up)

    def linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # One row (decode at batch 1) of a plain nn.Linear: the skinny GEMM; else layer(x).
        from executor import kernels

        return kernels.linear(layer, x)

    def embed(self, table: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        # The whole table in one PDL kernel (ATen's gather is none); a tensor-parallel
        # table (its own module) and a Dynamo trace keep theirs.
        if type(table) is not nn.Embedding or torch.compiler.is_compiling() \
                or ids.dim() != 1 or not table.weight.is_contiguous():
            return table(ids)  # type: ignore[no-any-return]
        from executor import kernels

        return kernels.token_embedding(ids, table.weight)

    def logits(self, lm_head: nn.Module, hidden: torch.Tensor, out: torch.Tensor | None
               ) -> torch.Tensor:
        # One row (decode at batch 1): the row kernel where it takes the shape; else cuBLAS.
        from executor import kernels

        return kernels.logits_into(lm_head, hidden, out)

    def add_rms_norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None,
                            weight: torch.Tensor, eps: float, layer: nn.Module
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        from executor import kernels

        return kernels.add_rms_norm_linear(x, residual, weight, eps, layer, kernels.rms_norm,
                                           kernels.add_rms_norm)

    def silu_and_mul_linear(self, gate_up: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        from executor import kernels

        return kernels.silu_and_mul_linear(gate_up, layer, kernels.silu_and_mul)

    def add_rms_norm_glu_linear(self, x: torch.Tensor, residual: torch.Tensor | None,
                                weight: torch.Tensor, eps: float, layer: nn.Module
                                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        own = None if type(layer) is nn.Linear else \
            getattr(layer, "norm_glu_linear", None)  # e.g. executor.quant.Fp8Linear
        return None if own is None else own(x, residual, weight, eps)  # type: ignore[no-any-return]


TORCH_OPS = TorchOps()
TRITON_OPS = TritonOps()


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def prepare_kernels(choice: KernelChoice) -> None:
    """Import the kernels now if ``choice`` may pick them on this machine, so that a
    Dynamo trace never runs their first import (which registers custom ops)."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"unknown kernel choice {choice!r}; valid: {', '.join(KERNEL_CHOICES)}")
    if choice == "triton" or (choice == "auto" and torch.cuda.is_available()
                              and triton_available()):
        import executor.kernels  # noqa: F401


def select_ops(choice: KernelChoice, x: torch.Tensor) -> LayerOps:
    """The ops for activations like ``x``: see ``KernelChoice``."""
    if choice == "triton":
        return TRITON_OPS
    if choice == "auto" and x.is_cuda and x.dtype in _FUSED_DTYPES:
        return TRITON_OPS
    return TORCH_OPS


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor, ops: LayerOps
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(x + residual), x + residual)``: the pre-norm residual step."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)

    def linear_forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                       layer: nn.Module, ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        """``(layer(self(x + residual)), x + residual)``: the residual step and the
        projection after it (``residual=None``: ``x`` alone, and ``x`` is the residual)."""
        return ops.add_rms_norm_linear(x, residual, self.weight, self.eps, layer)

    def glu_linear_forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                           layer: nn.Module, ops: LayerOps
                           ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``linear_forward`` of a gate_up ``layer`` with SiLU-and-mul after it, as one
        launch where the ops and the layer have it (``LayerOps.add_rms_norm_glu_linear``),
        else None."""
        return ops.add_rms_norm_glu_linear(x, residual, self.weight, self.eps, layer)


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
    """Neox-style (rotate-half) RoPE tables: float32 ``cos``/``sin`` ``(P, head_dim)``.

    The tables cover ``max_positions`` positions so a forward is one gather, which is
    also what makes it capturable in a CUDA graph (positions live in a static buffer).
    Both halves of each row are equal (``cat(freqs, freqs)``); the kernel reads the first.
    With a partial rotary factor (Phi-3) only the leading ``rotary_dim`` of each head are
    rotated (tables ``(P, rotary_dim)``) and the rest pass through, as Hugging Face does.
    """

    def __init__(self, rope: RopeSpec, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_positions = rope, head_dim, max_positions
        self.rotary_dim = rope.rotary_dim(head_dim)
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
        inv_freq = rope_inv_freq(self.rope, self.rotary_dim, device)
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # (positions, head_dim // 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (positions, head_dim)
        self.cos, self.sin = emb.cos(), emb.sin()

    @property
    def fusable(self) -> bool:
        """Whether a decode kernel that rotates whole heads may apply these tables."""
        return self.rotary_dim == self.head_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                ops: LayerOps, q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (T, heads, head_dim), k: (T, kv_heads, head_dim), positions: (T,); with
        ``q_norm``/``k_norm`` (same eps), each head is RMS-normed before the rotation."""
        qw = q_norm.weight if q_norm is not None else None
        kw = k_norm.weight if k_norm is not None else None
        eps = q_norm.eps if q_norm is not None else 0.0
        r = self.rotary_dim
        if r == self.head_dim:
            return ops.rope(positions, q, k, self.cos, self.sin, qw, kw, eps)
        # Partial rotary (no q/k norm: the spec refuses both together).
        q_rot, k_rot = ops.rope(positions, q[..., :r], k[..., :r], self.cos, self.sin,
                                None, None, eps)
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return self.down(ops.linear(self.gate_up_proj, x), ops)

    def down(self, gate_up: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """The MLP after its gate_up projection: ``gate_up`` ``(T, 2 * I)`` -> ``(T, hidden)``."""
        return ops.silu_and_mul_linear(gate_up, self.down_proj)
