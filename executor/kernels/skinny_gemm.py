# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""Skinny GEMM for decode: ``x @ W.T`` with few rows (``M <= MAX_ROWS``), optionally with
SiLU-and-mul fused into its input.

At batch 1 a decoder layer's projections are matrix-vector products that only stream the
weight once; cuBLAS picks tensor-core tiles (and split-K with a second reduce kernel for the
down projection) that reached 1.3-2.6 TB/s on an H100 for the Llama-3.2-1B shapes. Here
each program owns ``BLOCK_N`` output columns, reads their weight rows ``(BLOCK_N, K)`` in
``BLOCK_K`` chunks with 16-byte loads and reduces on the CUDA cores in float32. There is no
split-K: every output is summed by one program in a fixed order, so results are
deterministic (the order, hence the last bit, may differ between batch sizes, as cuBLAS's
kernel choice does).

``SILU_MUL``: the input is the fused gate/up output ``(M, 2K)`` and each chunk of
``silu(gate) * up`` is computed as it is loaded, rounded exactly as
``executor.kernels.activation`` rounds it (so the GEMM sees the same input as the unfused
path): one launch instead of SiLU-and-mul, the down GEMM and its split-K reduce.

Numerics: float32 products and sums of the activation-dtype inputs, one rounding at the
end, like cuBLAS; the summation order differs, so outputs can differ from ``F.linear``
by an ulp of the activation dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from executor.kernels.launch import FastLauncher, cdiv, next_power_of_2

# Rows up to which the skinny kernel serves (decode at small batch); more rows go to cuBLAS.
MAX_ROWS = 4


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # (M, K) rows, unit column stride; (M, 2K) gate|up when SILU_MUL
    w_ptr,  # (N, K) row-major, as nn.Linear stores it
    out_ptr,  # (M, N)
    M, N, K,
    stride_xm, stride_wn, stride_om,
    SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    act_ty = out_ptr.dtype.element_ty
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # (BLOCK_M, 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x_mask = mask_m[:, None] & mask_k[None, :]
        if SILU_MUL:
            g = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0).to(tl.float32)
            u = tl.load(x_rows + K + ks[None, :], mask=x_mask, other=0.0).to(tl.float32)
            act = tl.div_rn(g, 1.0 + tl.exp(-g)).to(act_ty).to(tl.float32)
            x = (act * u).to(act_ty).to(tl.float32)  # (BLOCK_M, BLOCK_K)
        else:
            x = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0).to(tl.float32)
        if BLOCK_M == 1:
            acc += tl.sum(w.to(tl.float32) * x, axis=1)[None, :]
        else:
            acc += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    dst = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(dst, acc.to(act_ty), mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class Tile:
    """Launch shape: output columns and K chunk per program, warps per program."""

    block_n: int
    block_k: int
    num_warps: int = 4


def default_tile(m: int, n: int, k: int) -> Tile:
    """At least about 4 programs per SM of an H100 (132 SMs) over the columns, and a chunk
    of about 8192 weight elements (16 KB of bf16, 8 x 16-byte loads per thread of 4 warps)
    in flight per program; fewer K per chunk as rows grow (M x chunk products in registers)."""
    block_n = max(2, min(32, next_power_of_2(max(1, n // 512)) if n >= 1024 else 2))
    while block_n > 2 and cdiv(n, block_n) < 512:
        block_n //= 2
    block_m = next_power_of_2(m)
    block_k = max(64, min(next_power_of_2(k), 8192 // block_n // block_m))
    return Tile(block_n, block_k)


_LAUNCHERS: dict[int, FastLauncher] = {}


def _launcher(num_warps: int) -> FastLauncher:
    if num_warps not in _LAUNCHERS:
        _LAUNCHERS[num_warps] = FastLauncher(_skinny_gemm_kernel, num_warps=num_warps)
    return _LAUNCHERS[num_warps]


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False,
                tile: Tile | None = None) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` (M, K) and ``weight`` (N, K); with ``silu_mul``, ``x`` is
    (M, 2K) gate|up and the product is ``silu_and_mul(x) @ weight.T``. A new (M, N) tensor.
    Rows of ``x`` and ``weight`` must have unit column stride."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be (M, K) with contiguous rows"
    assert weight.dim() == 2 and weight.stride(-1) == 1, "weight must be (N, K) row-major"
    m = x.shape[0]
    n, k = weight.shape
    assert x.shape[1] == (2 * k if silu_mul else k), (x.shape, weight.shape, silu_mul)
    assert x.dtype == weight.dtype, (x.dtype, weight.dtype)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    tile = tile or default_tile(m, n, k)
    block_m = next_power_of_2(m)
    # Key: what the JIT specializes on besides pointer alignment (dtype, integers).
    key = (x.dtype, m, n, k, x.stride(0), weight.stride(0), out.stride(0), silu_mul,
           block_m, tile.block_n, tile.block_k)
    _launcher(tile.num_warps).launch(
        (cdiv(n, tile.block_n), 1, 1), key,
        (x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0)),
        {"SILU_MUL": silu_mul, "BLOCK_M": block_m, "BLOCK_N": tile.block_n,
         "BLOCK_K": tile.block_k})
    return out


def serves(x: torch.Tensor, layer: torch.nn.Module) -> bool:
    """Whether ``skinny_gemm`` takes ``layer(x)``: a plain bias-free ``nn.Linear`` (any
    other module, e.g. a tensor-parallel linear, keeps its own forward), few rows, same
    dtype, outside a Dynamo trace (a compiled graph keeps ``F.linear``)."""
    return (type(layer) is torch.nn.Linear and layer.bias is None
            and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.stride(-1) == 1
            and x.dtype == layer.weight.dtype and layer.weight.stride(-1) == 1
            and not torch.compiler.is_compiling())


def linear(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, through ``skinny_gemm`` where it serves."""
    if serves(x, layer):
        return skinny_gemm(x, layer.weight)  # type: ignore[arg-type]
    return layer(x)  # type: ignore[no-any-return]


def silu_and_mul_linear(gate_up: torch.Tensor, layer: torch.nn.Module,
                        silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``layer(silu_and_mul(gate_up))``, as one ``skinny_gemm`` launch where it serves."""
    if serves(gate_up, layer) and gate_up.shape[1] == 2 * layer.weight.shape[1]:  # type: ignore[index]
        return skinny_gemm(gate_up, layer.weight, silu_mul=True)  # type: ignore[arg-type]
    return layer(silu_and_mul(gate_up))  # type: ignore[no-any-return]
