# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""RMSNorm and fused residual-add + RMSNorm, one program per row.

Numerics follow Hugging Face's bf16/fp16 semantics, op by op:

* the residual add ``x + residual`` is rounded to the activation dtype (HF adds in bf16),
  and that rounded sum is both the new residual and the norm's input;
* the norm runs in float32 (sum of squares, mean, rsqrt) and its result is rounded to the
  activation dtype *before* the weight multiply, whose product is rounded again (HF:
  ``weight * hidden.to(input_dtype)``).

The only difference from the torch ops is the order of the float32 sum of squares.
``rms_norm_quant`` writes the normed rows as e4m3 with a per-row scale instead (what the
FP8 activation quantization makes of the bf16/fp16 output, ``row_quant``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor.kernels import pdl
from executor.kernels.pdl import pdl_enter
from executor.kernels.row_quant import quantize_store, row_scale

# A row is held in registers whole: more than this and one program per row stops paying.
MAX_ROW = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # (T, N) rows, unit column stride
    res_ptr,  # (T, N) residual in (read only if HAS_RESIDUAL)
    w_ptr,  # (N,)
    out_ptr,  # (T, N) normed out; QUANT: e4m3
    res_out_ptr,  # (T, N) x + residual out (written only if HAS_RESIDUAL)
    scale_ptr,  # QUANT: (T,) float32 row scales out
    n_cols,
    stride_x, stride_res, stride_out, stride_res_out,
    inv_n,  # 1 / N
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
    QUANT: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n_cols
    act_ty = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(act_ty)  # one rounding, like HF
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x32 * x32, axis=0) * inv_n + eps)
    y = (x32 * rstd).to(act_ty).to(tl.float32)  # HF rounds before the weight multiply
    out = y * w.to(tl.float32)
    if QUANT:  # the activation-dtype output, quantized as the unfused kernel would
        out = out.to(act_ty).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(out), axis=0))
        quantize_store(out, scale, out_ptr + row * stride_out + offs, mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty),
                 mask=mask)


def _num_warps(block: int) -> int:
    # About 8 elements (16 bytes of bf16) per thread, 1 to 16 warps.
    return min(max(block // 256, 1), 16)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float, scales: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be (T, N) with contiguous rows"
    num_rows, n = x.shape
    assert weight.shape == (n,) and weight.is_contiguous(), (weight.shape, n)
    assert n <= MAX_ROW, f"rows of {n} > {MAX_ROW} elements are not supported"
    dtype = torch.promote_types(x.dtype, weight.dtype) if scales is None \
        else torch.float8_e4m3fn
    out = torch.empty((num_rows, n), dtype=dtype, device=x.device)
    res_out = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x"
        assert residual.stride(-1) == 1, "residual rows must be contiguous"
        res_out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out, res_out
    block = triton.next_power_of_2(n)
    res_in = residual if residual is not None else x
    res_dst = res_out if res_out is not None else out
    _rms_norm_kernel[(num_rows,)](
        x, res_in, weight, out, res_dst, scales if scales is not None else out,
        n,
        x.stride(0), res_in.stride(0), out.stride(0), res_dst.stride(0),
        1.0 / n, eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_N=block,
        num_warps=_num_warps(block),
        QUANT=scales is not None,
        **pdl.options(),
    )
    return out, res_out


def rms_norm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``rms_norm(x [+ residual])`` quantized per row for an FP8 GEMM: (e4m3 (T, N),
    float32 scales (T, 1), ``x + residual`` or None), equal to the activation quantization
    of ``rms_norm``/``add_rms_norm``'s output. ``weight`` in ``x``'s dtype; eager only."""
    assert weight.dtype == x.dtype, (weight.dtype, x.dtype)
    scales = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    q, res_out = _launch(x, residual, weight, eps, scales)
    return q, scales, res_out


# -- custom ops: what Dynamo records (opaque nodes with fake impls) --------------------------
@torch.library.custom_op("model_executor::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


@_rms_norm_op.register_fake
def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("model_executor::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, res_out = _launch(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out


@_add_rms_norm_op.register_fake
def _add_rms_norm_fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)),
            x.new_empty(x.shape))


# -- public entry points -----------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rms_normalize(x)`` over the last dim of ``x`` (T, N); a new tensor."""
    if torch.compiler.is_compiling():
        return torch.ops.model_executor.rms_norm(x, weight, eps)  # type: ignore[no-any-return]
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one launch; new tensors, inputs untouched.

    The sum is rounded to the activation dtype before it is normalized (HF semantics).
    """
    if torch.compiler.is_compiling():
        out, res = torch.ops.model_executor.add_rms_norm(x, residual, weight, eps)
        return out, res
    out, res_out = _launch(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out
