"""The GEMM an ``Fp8Linear`` runs on an FP8-capable GPU, chosen once at load (``prepare``).

* up to ``SKINNY_MAX_ROWS`` rows (decode): ``w8a16``, our Triton kernel: FP8 weight read,
  bf16 row, dequantized in registers (the weights are the bytes a decode step reads, so
  halving them is the gain; no activation quantization); except row buckets where this
  GPU's tile sweep measured cuBLAS FP8 faster (``tiles.scaled_mm_faster``).
* more rows, per-channel or per-tensor scales: the activations quantized to e4m3 (one
  Triton pass: per token, or the checkpoint's static scale), then ``torch._scaled_mm``
  (cuBLAS FP8 tensor cores) with row-wise or per-tensor scales.
* more rows, block scales: ``w8a16`` on the tensor cores (``tl.dot`` of bf16 after the
  in-register conversion; block scales applied to each 128-column chunk's partial sums).

Everything is shape-static and sync-free, so CUDA graphs capture it; under Dynamo the layer
is one custom op (``model_executor::fp8_linear``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor.quant.linear import Fp8Linear

#: Rows up to which a projection takes the w8a16 kernel whatever its scales.
SKINNY_MAX_ROWS = 64
# How a layer with more rows multiplies (the ``mode`` of ``fp8_linear``).
W8A16, ROWWISE, PER_TENSOR = 0, 1, 2
_MODE_NAMES = {W8A16: "triton_w8a16", ROWWISE: "scaled_mm_rowwise",
               PER_TENSOR: "scaled_mm_per_tensor"}


def fp8_supported(device: torch.device) -> bool:
    """FP8 tensor-core GEMMs: CUDA compute capability 8.9 (Ada) or 9.0+ (Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def prepare(layer: Fp8Linear) -> None:
    """Give ``layer`` its GEMM on this GPU (and the static scale buffers it reads)."""
    kind = layer.scheme.kind
    n, k = layer.out_features, layer.in_features
    # What cuBLAS FP8 takes: dimensions in multiples of 16; row-wise scales on Hopper
    # (torch's CPU ``_scaled_mm``, which the interpreter tests run, takes them too).
    aligned = n % 16 == 0 and k % 16 == 0
    dev = layer.weight.device
    rowwise = dev.type != "cuda" or torch.cuda.get_device_capability(dev) >= (9, 0)
    if kind == "fp8_block":
        mode, scale, block = W8A16, layer.scales, layer.scheme.block
        input_scale = None
    else:
        block = None
        input_scale = None
        if kind == "fp8_per_tensor" and layer.scheme.static_input:
            _requantize_to_one_scale(layer)
            assert layer.input_scale is not None
            input_scale = layer.input_scale.max().reshape(1)  # the safe one of the shards'
        scale = layer.row_scales().contiguous()  # (N,)
        if not aligned:
            mode = W8A16
        elif input_scale is not None:
            mode = PER_TENSOR
        else:
            mode = ROWWISE if rowwise else W8A16
    # Static buffers (CUDA graphs keep their addresses), owned by the layer.
    # NOTE: the GEMM holds these tensors themselves: the layer is prepared on its device
    # and never moved after.
    scale = scale.contiguous()
    if scale is not layer.scales:  # (block scales serve as they are)
        layer.register_buffer("gemm_scale", scale, persistent=False)
    layer.register_buffer("gemm_input_scale", input_scale, persistent=False)
    bn, bk = block or (0, 0)
    weight, gemm_scale = layer.weight, scale

    def gemm(x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, weight, gemm_scale, input_scale, bn, bk, mode)

    layer.gemm = gemm
    layer.norm_gemm, layer.silu_mul_gemm = _fused(weight, gemm_scale, block, mode != W8A16)
    layer.path = f"w8a16 (<= {SKINNY_MAX_ROWS} rows) + {_MODE_NAMES[mode]}"


def _fused(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
           cublas: bool) -> tuple[Callable[..., tuple[torch.Tensor, torch.Tensor | None] | None],
                      Callable[[torch.Tensor], torch.Tensor | None]]:
    """The layer's GEMMs with the RMSNorm (residual-add + RMSNorm) or the SiLU-and-mul
    before it fused in: one launch instead of two for the few rows of a decode step
    (fewer than ``tiles.DOT_MIN_ROWS``), as the bf16 skinny GEMM fuses them. Outside
    a Dynamo trace only (the fused launch is no custom op), and not where the sweep found
    cuBLAS FP8 faster (``cublas``: the layer has that path)."""
    from executor.quant import launch
    from executor.quant.tiles import ADD_RMS_NORM, DOT_MIN_ROWS, RMS_NORM, SILU_MUL

    def rows_fit(x: torch.Tensor) -> bool:
        return not torch.compiler.is_compiling() and x.dim() == 2 and x.stride(-1) == 1 \
            and 0 < x.shape[0] < DOT_MIN_ROWS and not (cublas and cublas_here(x, weight))

    def norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        if not rows_fit(x) or norm_weight.dtype != x.dtype or not norm_weight.is_contiguous() \
                or (residual is not None and (residual.dtype != x.dtype
                                              or residual.stride(-1) != 1)):
            return None
        op = RMS_NORM if residual is None else ADD_RMS_NORM
        return launch.w8a16_fused(x, weight, scale, block, op, residual, norm_weight, eps)

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
        if not rows_fit(gate_up):
            return None
        return launch.w8a16_fused(gate_up, weight, scale, block, SILU_MUL, None, None, 0.0)[0]

    return norm, silu_mul


def _requantize_to_one_scale(layer: Fp8Linear) -> None:
    """Fused shards with per-tensor scales of their own: re-round every shard to the
    largest scale, so one scale serves the fused tensor (cuBLAS per-tensor scaling)."""
    scale = layer.scales
    if scale.numel() == 1 or bool((scale == scale[0]).all()):
        return
    top = scale.max()
    rows = layer.row_scales().reshape(-1, 1)
    with torch.no_grad():
        layer.weight.copy_((layer.weight.float() * (rows / top)).to(layer.weight.dtype))
        scale.fill_(float(top))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               input_scale: torch.Tensor | None, block_n: int, block_k: int, mode: int
               ) -> torch.Tensor:
    """``x @ dequantize(weight).T`` in ``x``'s dtype (see the module docstring)."""
    if torch.compiler.is_compiling():
        return torch.ops.model_executor.fp8_linear(  # type: ignore[no-any-return]
            x, weight, scale, input_scale, block_n, block_k, mode)
    return _fp8_linear(x, weight, scale, input_scale, block_n, block_k, mode)


def _fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                input_scale: torch.Tensor | None, block_n: int, block_k: int, mode: int
                ) -> torch.Tensor:
    from executor.quant import launch

    block = (block_n, block_k) if block_n else None
    if mode == W8A16 or (x.shape[0] <= SKINNY_MAX_ROWS and not cublas_here(x, weight)):
        return launch.w8a16(x, weight, scale, block)
    q, row_scales = launch.act_quant(x, input_scale)
    if mode == PER_TENSOR:
        assert input_scale is not None
        return torch._scaled_mm(q, weight.t(), scale_a=input_scale, scale_b=scale[:1],
                                out_dtype=x.dtype)
    return torch._scaled_mm(q, weight.t(), scale_a=row_scales, scale_b=scale.view(1, -1),
                            out_dtype=x.dtype)


def cublas_here(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this GPU's tile sweep found cuBLAS FP8 faster for these few rows."""
    from executor.kernels.skinny.tiles import device_name
    from executor.quant.tiles import scaled_mm_faster

    n, k = weight.shape
    return scaled_mm_faster(x.shape[0], n, k, device_name(x.device) if x.is_cuda else "")


@torch.library.custom_op("model_executor::fp8_linear", mutates_args=())
def _fp8_linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   input_scale: torch.Tensor | None, block_n: int, block_k: int, mode: int
                   ) -> torch.Tensor:
    return _fp8_linear(x, weight, scale, input_scale, block_n, block_k, mode)


@_fp8_linear_op.register_fake
def _fp8_linear_fake(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     input_scale: torch.Tensor | None, block_n: int, block_k: int, mode: int
                     ) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))
