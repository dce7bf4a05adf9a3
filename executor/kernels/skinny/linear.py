"""Where the model's projections take the skinny GEMM: ``linear`` and its fused twins, and
the LM head's one row (``logits_into``).

A projection runs as one skinny launch where ``serves`` and ``takes`` say so (a plain
bias-free ``nn.Linear``, at most ``MAX_ROWS`` rows, outside a Dynamo trace, and not a shape
this GPU's tuning sweep left to cuBLAS); otherwise it falls back to the module (cuBLAS)
after the norm or SiLU-and-mul kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor.kernels.skinny.kernel import ADD_RMS_NORM, PLAIN, SILU_MUL
from executor.kernels.skinny.ops import skinny_gemm, skinny_norm_gemm
from executor.kernels.skinny.tiles import cublas_faster, row_tile, sm_count

#: Rows up to which the skinny kernel serves; more rows go to cuBLAS (the CUDA cores do M
#: products per weight element, so the kernel's lead over tensor cores ends after one row).
MAX_ROWS = 1


def serves(x: torch.Tensor, layer: torch.nn.Module) -> bool:
    """Whether the skinny GEMM takes ``layer(x)``: a plain bias-free ``nn.Linear`` (any
    other module, e.g. a tensor-parallel linear, keeps its own forward), few rows, same
    dtype, outside a Dynamo trace (a compiled graph keeps ``F.linear``).

    NOTE: the Dynamo check comes first: under a trace with a dynamic token count, testing
    ``x.shape[0]`` would add a guard on it (a recompile, or a specialized piece)."""
    if torch.compiler.is_compiling():
        return False
    return (type(layer) is torch.nn.Linear and layer.bias is None
            and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.stride(-1) == 1
            and x.dtype == layer.weight.dtype and layer.weight.stride(-1) == 1)


def takes(x: torch.Tensor, layer: torch.nn.Module, silu_mul: bool = False) -> bool:
    """Whether ``layer(x)`` (``silu_mul``: ``layer(silu_and_mul(x))``) runs as one
    ``skinny_gemm`` launch here: the kernel serves them, the widths chain, and this GPU's
    sweep did not find the unfused path faster (``cublas_faster``)."""
    if not serves(x, layer):  # (a plain nn.Linear: it has a weight)
        return False
    weight: torch.Tensor = layer.weight  # type: ignore[assignment]
    return x.shape[1] == weight.shape[1] * (2 if silu_mul else 1) \
        and not cublas_faster(SILU_MUL if silu_mul else PLAIN, x, weight)


def linear(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, through ``skinny_gemm`` where it ``takes`` it."""
    if takes(x, layer):
        return skinny_gemm(x, layer.weight)  # type: ignore[arg-type]
    return layer(x)  # type: ignore[no-any-return]


def logits_into(layer: torch.nn.Module, x: torch.Tensor, out: torch.Tensor | None
                ) -> torch.Tensor:
    """``layer(x)`` for an LM head ``layer`` (a plain ``nn.Linear``, vocab x hidden),
    written into ``out`` ((M, vocab), or a new tensor if None) and returned. One row the
    skinny GEMM ``serves`` and the row kernel takes by its default rule (``row_tile``: a
    decode step at batch 1 on a GPU) streams the weight there, with PDL, into ``out``
    itself; anything else is cuBLAS's GEMM, which writes ``out`` itself too (for 2-D input
    the ``mm`` that ``F.linear`` calls)."""
    weight: torch.Tensor = layer.weight  # type: ignore[assignment]
    n, k = weight.shape
    if serves(x, layer) and row_tile(PLAIN, 1, n, k, sms=sm_count(x.device)) is not None:
        return skinny_gemm(x, weight, out=out)
    if out is None:
        return layer(x)  # type: ignore[no-any-return]
    return torch.mm(x, weight.t(), out=out)


def silu_and_mul_linear(gate_up: torch.Tensor, layer: torch.nn.Module,
                        silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``layer(silu_and_mul(gate_up))``, as one ``skinny_gemm`` launch where it ``takes``
    it (a layer with a fused GEMM of its own, ``silu_mul_linear``, launches that)."""
    own = None if type(layer) is torch.nn.Linear else \
        getattr(layer, "silu_mul_linear", None)  # e.g. executor.quant.Fp8Linear
    if own is not None and (out := own(gate_up)) is not None:
        return out  # type: ignore[no-any-return]
    if takes(gate_up, layer, silu_mul=True):
        return skinny_gemm(gate_up, layer.weight, silu_mul=True)  # type: ignore[arg-type]
    return layer(silu_and_mul(gate_up))  # type: ignore[no-any-return]


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                        eps: float, layer: torch.nn.Module,
                        norm: Callable[..., torch.Tensor],
                        add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer(rms_norm(x + residual)), x + residual)`` (without a residual: the norm of
    ``x``, and ``x`` as the residual), one ``skinny_norm_gemm`` launch where it serves;
    else ``norm``/``add_norm`` (the norm kernels) then ``linear`` (cuBLAS where this GPU's
    sweep found that path faster for the shape). A layer with a fused GEMM of its own
    (``norm_linear``) launches that where it fuses."""
    own = None if type(layer) is torch.nn.Linear else \
        getattr(layer, "norm_linear", None)  # e.g. executor.quant.Fp8Linear
    if own is not None and (got := own(x, residual, norm_weight, eps)) is not None:
        return got  # type: ignore[no-any-return]
    fused = serves(x, layer) and norm_weight.dtype == x.dtype and norm_weight.is_contiguous() \
        and (residual is None or (residual.dtype == x.dtype and residual.stride(-1) == 1))
    unfused = fused and cublas_faster(ADD_RMS_NORM, x, layer.weight)  # type: ignore[arg-type]
    if fused and not unfused:
        out, res_out = skinny_norm_gemm(x, residual, norm_weight, eps,
                                        layer.weight)  # type: ignore[arg-type]
        return out, res_out if res_out is not None else x
    if residual is None:
        normed = norm(x, norm_weight, eps)
        residual = x
    else:
        normed, residual = add_norm(x, residual, norm_weight, eps)
    return (layer(normed) if unfused else linear(layer, normed)), residual
