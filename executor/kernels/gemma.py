# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""The Gemma decoder's element-wise kernels (``executor.model.gemma_ops``).

* ``gemma_rms_norm``: ``normalize(x) * (1 + weight)``, all in float32 and rounded once
  (Hugging Face's ``Gemma2RMSNorm`` / ``Gemma3RMSNorm``: unlike Llama's, the normalized
  value is not rounded before the weight multiply). Rows of a 2-D ``(T, N)`` or a
  strided 3-D ``(T, H, N)`` input (q or k heads, views of the QKV output).
* ``gemma_add_norm``: a sublayer's post-norm, the residual add (rounded to the activation
  dtype, as HF adds) and the next sublayer's pre-norm, in one program per row.
* ``gelu_tanh_and_mul``: ``gelu_tanh(gate) * up`` (GELU in float32 rounded to the dtype,
  the product rounded again, as the torch ops in the activation dtype).

Under Dynamo each calls a custom op with a fake impl, as ``executor.kernels.norm`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor.kernels import pdl
from executor.kernels.pdl import pdl_enter

MAX_ROW = 65536  # a row is held in registers whole
GELU_BLOCK = 1024
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # compiled kernels read only constexpr globals


@triton.jit
def _offset_norm(x32, w_ptr, offs, mask, inv_n, eps):
    """``x32 * rsqrt(mean(x32^2) + eps) * (1 + w)`` in float32."""
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x32 * x32, axis=0) * inv_n + eps)
    return x32 * rstd * (1.0 + w)


@triton.jit
def _offset_rms_norm_kernel(
    x_ptr,  # (T, H, N) rows (H = 1 for 2-D input), unit column stride
    res_ptr,  # (T, N) residual in (read only if ADD)
    w_post_ptr,  # (N,) the norm of x (ADD), else the only norm
    w_pre_ptr,  # (N,) the norm of the sum (read only if ADD)
    out_ptr,  # (T, H, N) contiguous
    res_out_ptr,  # (T, N) the sum (written only if ADD)
    n_cols,
    stride_x_t, stride_x_h, stride_res, stride_res_out,
    inv_n,
    eps,
    ADD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    heads = tl.num_programs(1)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n_cols
    act_ty = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x_t + head * stride_x_h + offs, mask=mask, other=0.0)
    y = _offset_norm(x.to(tl.float32), w_post_ptr, offs, mask, inv_n, eps)
    if ADD:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
        s = (r + y.to(act_ty).to(tl.float32)).to(act_ty)  # HF: residual + hidden, rounded
        tl.store(res_out_ptr + row * stride_res_out + offs, s, mask=mask)
        y = _offset_norm(s.to(tl.float32), w_pre_ptr, offs, mask, inv_n, eps)
    tl.store(out_ptr + (row * heads + head) * n_cols + offs, y.to(act_ty), mask=mask)


@triton.jit
def _gelu_tanh_and_mul_kernel(
    x_ptr,  # (T, 2 * N): gate in columns [0, N), up in [N, 2N)
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
    z = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
    e = tl.exp(-2.0 * tl.abs(z))  # in (0, 1]: no overflow
    tanh = tl.where(z >= 0, 1.0, -1.0) * (1.0 - e) / (1.0 + e)
    act = (0.5 * g * (1.0 + tanh)).to(act_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * u).to(act_ty), mask=mask)


def _num_warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


def _launch_norm(x: torch.Tensor, residual: torch.Tensor | None, post: torch.Tensor,
                 pre: torch.Tensor | None, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert x.dim() in (2, 3) and x.stride(-1) == 1, "x must be (T, N) or (T, H, N) rows"
    n = x.shape[-1]
    x3 = x if x.dim() == 3 else x.unsqueeze(1)  # (T, H, N)
    num_rows, heads = x3.shape[0], x3.shape[1]
    assert post.shape == (n,) and post.is_contiguous(), (post.shape, n)
    assert n <= MAX_ROW, f"rows of {n} > {MAX_ROW} elements are not supported"
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = None
    if residual is not None:
        assert x.dim() == 2 and pre is not None and pre.shape == (n,) and pre.is_contiguous()
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.stride(-1) == 1, "residual rows must be contiguous"
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_rows == 0 or heads == 0:
        return out, res_out
    block = triton.next_power_of_2(n)
    res_in = residual if residual is not None else x
    res_dst = res_out if res_out is not None else out
    _offset_rms_norm_kernel[(num_rows, heads)](
        x3, res_in, post, pre if pre is not None else post, out, res_dst, n,
        x3.stride(0), x3.stride(1), res_in.stride(0), res_dst.stride(0),
        1.0 / n, eps,
        ADD=residual is not None,
        BLOCK_N=block,
        num_warps=_num_warps(block),
        **pdl.options(),
    )
    return out, res_out


def _launch_gelu(x: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be (T, 2N) with contiguous rows"
    num_rows, width = x.shape
    assert width % 2 == 0, f"gate_up width {width} is odd"
    n = width // 2
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    _gelu_tanh_and_mul_kernel[(num_rows, triton.cdiv(n, GELU_BLOCK))](
        x, out, n, x.stride(0), out.stride(0), BLOCK_N=GELU_BLOCK, num_warps=4,
        **pdl.options())
    return out


# -- custom ops: what Dynamo records (opaque nodes with fake impls) --------------------------
@torch.library.custom_op("model_executor::gemma_rms_norm", mutates_args=())
def _gemma_rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch_norm(x, None, weight, None, eps)[0]


@_gemma_rms_norm_op.register_fake
def _gemma_rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("model_executor::gemma_add_norm", mutates_args=())
def _gemma_add_norm_op(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                       pre: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, res_out = _launch_norm(x, residual, post, pre, eps)
    assert res_out is not None
    return out, res_out


@_gemma_add_norm_op.register_fake
def _gemma_add_norm_fake(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                         pre: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op("model_executor::gelu_tanh_and_mul", mutates_args=())
def _gelu_tanh_and_mul_op(x: torch.Tensor) -> torch.Tensor:
    return _launch_gelu(x)


@_gelu_tanh_and_mul_op.register_fake
def _gelu_tanh_and_mul_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[1] // 2))


# -- public entry points -----------------------------------------------------------------
def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``normalize(x) * (1 + weight)`` over the last dim of ``x`` ``(T, N)`` or
    ``(T, H, N)`` (any row and head strides); a new contiguous tensor."""
    if torch.compiler.is_compiling():
        return torch.ops.model_executor.gemma_rms_norm(x, weight, eps)  # type: ignore[no-any-return]
    return _launch_norm(x, None, weight, None, eps)[0]


def gemma_add_norm(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                   pre: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = residual + gemma_rms_norm(x, post)``; returns ``(gemma_rms_norm(s, pre), s)``
    in one launch (``x``, ``residual`` ``(T, N)``); new tensors, inputs untouched."""
    if torch.compiler.is_compiling():
        out, res = torch.ops.model_executor.gemma_add_norm(x, residual, post, pre, eps)
        return out, res
    out, res_out = _launch_norm(x, residual, post, pre, eps)
    assert res_out is not None
    return out, res_out


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x[:, :N]) * x[:, N:]`` for ``x`` (T, 2N); a new (T, N) tensor."""
    if torch.compiler.is_compiling():
        return torch.ops.model_executor.gelu_tanh_and_mul(x)  # type: ignore[no-any-return]
    return _launch_gelu(x)
