# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""SiLU-and-mul over the fused gate/up projection output: ``silu(gate) * up``.

Numerics follow the torch ops in the activation dtype: SiLU in float32
(``g / (1 + exp(-g))``) rounded to the dtype, then the product rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor.kernels import pdl
from executor.kernels.pdl import pdl_enter

BLOCK = 1024  # columns per program: 8 bf16 per thread with 4 warps


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # (T, 2 * N): gate in columns [0, N), up in [N, 2N); unit column stride
    out_ptr,  # (T, N)
    n_cols,
    stride_x, stride_out,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    act_ty = out_ptr.dtype.element_ty
    src = x_ptr + row * stride_x + cols
    g = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(src + n_cols, mask=mask, other=0.0).to(tl.float32)
    act = tl.div_rn(g, 1.0 + tl.exp(-g)).to(act_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * u).to(act_ty), mask=mask)


def _launch(x: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be (T, 2N) with contiguous rows"
    num_rows, width = x.shape
    assert width % 2 == 0, f"gate_up width {width} is odd"
    n = width // 2
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    _silu_and_mul_kernel[(num_rows, triton.cdiv(n, BLOCK))](
        x, out, n, x.stride(0), out.stride(0), BLOCK_N=BLOCK, num_warps=4, **pdl.options(),
    )
    return out


@torch.library.custom_op("model_executor::silu_and_mul", mutates_args=())
def _silu_and_mul_op(x: torch.Tensor) -> torch.Tensor:
    return _launch(x)


@_silu_and_mul_op.register_fake
def _silu_and_mul_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[1] // 2))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :N]) * x[:, N:]`` for ``x`` (T, 2N); a new (T, N) tensor."""
    if torch.compiler.is_compiling():
        return torch.ops.model_executor.silu_and_mul(x)  # type: ignore[no-any-return]
    return _launch(x)
