# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""SiLU-and-mul over the fused gate/up projection output: ``silu(gate) * up``.

Numerics follow the torch ops in the activation dtype: SiLU in float32
(``g / (1 + exp(-g))``) rounded to the dtype, then the product rounded again.
``silu_and_mul_quant`` writes those products as e4m3 with a per-row scale instead (what
the FP8 activation quantization makes of them, ``row_quant``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor.kernels import pdl
from executor.kernels.pdl import pdl_enter
from executor.kernels.row_quant import quantize_store, row_scale

BLOCK = 1024  # columns per program: 8 bf16 per thread with 4 warps
#: Rows up to this many products are quantized from registers (16 warps, 32 per thread).
MAX_WHOLE_ROW = 16384


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


@triton.jit
def _silu_mul(src, cols, mask, n_cols, act_ty: tl.constexpr):
    """The products of columns ``cols`` of one row (as ``_silu_and_mul_kernel``), float32."""
    g = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(src + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = tl.div_rn(g, 1.0 + tl.exp(-g)).to(act_ty).to(tl.float32)
    return (act * u).to(act_ty).to(tl.float32)


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr,  # (T, 2 * N) gate|up, unit column stride
    act_ptr,  # (1,) of the activation dtype (its element type only)
    q_ptr,  # (T, N) e4m3 out
    s_ptr,  # (T,) float32 row scales out
    n_cols,
    stride_x, stride_q,
    BLOCK_N: tl.constexpr,
    WHOLE_ROW: tl.constexpr,  # BLOCK_N >= n_cols: the row stays in registers
    USE_PDL: tl.constexpr,
):
    # One program per row: the row's largest product first, then the quantized products
    # (a longer row is recomputed chunk by chunk: read twice, not written and read back).
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    act_ty = act_ptr.dtype.element_ty
    src = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK_N)
    if WHOLE_ROW:
        mask = offs < n_cols
        v = _silu_mul(src, offs, mask, n_cols, act_ty)
        scale = row_scale(tl.max(tl.abs(v), axis=0))
        quantize_store(v, scale, q_ptr + row * stride_q + offs, mask)
    else:
        amax = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for c0 in range(0, n_cols, BLOCK_N):
            v = _silu_mul(src, c0 + offs, c0 + offs < n_cols, n_cols, act_ty)
            amax = tl.maximum(amax, tl.abs(v))
        scale = row_scale(tl.max(amax, axis=0))
        for c0 in range(0, n_cols, BLOCK_N):
            mask = c0 + offs < n_cols
            v = _silu_mul(src, c0 + offs, mask, n_cols, act_ty)
            quantize_store(v, scale, q_ptr + row * stride_q + c0 + offs, mask)
    tl.store(s_ptr + row, scale)


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


def silu_and_mul_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_and_mul(x)`` quantized per row for an FP8 GEMM: (e4m3 (T, N), float32
    scales (T, 1)), equal to the activation quantization of ``silu_and_mul``'s output.
    Eager only."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0, x.shape
    num_rows, n = x.shape[0], x.shape[1] // 2
    q = torch.empty((num_rows, n), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows and n:
        whole = n <= MAX_WHOLE_ROW
        block = triton.next_power_of_2(n) if whole else 2 * BLOCK
        _silu_and_mul_quant_kernel[(num_rows,)](
            x, x, q, s, n, x.stride(0), q.stride(0), BLOCK_N=block, WHOLE_ROW=whole,
            num_warps=min(max(block // 512, 4), 16), **pdl.options())
    return q, s


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :N]) * x[:, N:]`` for ``x`` (T, 2N); a new (T, N) tensor."""
    if torch.compiler.is_compiling():
        return torch.ops.model_executor.silu_and_mul(x)  # type: ignore[no-any-return]
    return _launch(x)
