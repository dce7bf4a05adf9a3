"""The GEMM an ``Fp8Linear`` runs on an FP8-capable GPU, chosen once at load (``prepare``).

* fewer than ``tiles.DOT_MIN_ROWS`` rows (decode): ``w8a16``, our Triton kernel: FP8
  weight read, bf16 row, dequantized in registers (the weights are the bytes a decode step
  reads, so halving them is the gain; no activation quantization); except row buckets
  where this GPU's tile sweep measured cuBLAS FP8 faster (``tiles.scaled_mm_faster``).
* ``DOT_MIN_ROWS`` to ``SKINNY_MAX_ROWS`` rows, per-channel or block scales: the fastest
  of ``w8a16``, our FP8 x FP8 kernel (``dot_kernel``: activations quantized per token,
  split-K over the SMs) and cuBLAS FP8, as this GPU's sweep measured
  (``tiles.skinny_kernel``). A norm or SiLU-and-mul before the GEMM quantizes its own
  output then (``norm_gemm``/``silu_mul_gemm``), also for cuBLAS FP8 with more rows.
* more rows, per-channel or per-tensor scales: the activations quantized to e4m3 (one
  Triton pass: per token, or the checkpoint's static scale), then ``torch._scaled_mm``
  (cuBLAS FP8 tensor cores) with row-wise or per-tensor scales.
* more rows, block scales: ``w8a16`` on the tensor cores (``tl.dot`` of bf16 after the
  in-register conversion; block scales applied to each 128-column chunk's partial sums).

A gate|up projection's w8a16 rows may also end in the gated epilogue (``norm_glu_gemm``:
the norm before it and ``silu(gate) * up`` after it in one launch, so the down projection
takes the activation as a plain input instead of recomputing it in every program).

Everything is shape-static and sync-free, so CUDA graphs capture it; under Dynamo the layer
is one custom op (``model_executor::fp8_linear``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor.quant.linear import Fp8Linear
from executor.quant.tiles import (
    DOT_KERNEL,
    DOT_MIN_ROWS,
    SCALED_MM_KERNEL,
    W8A16_KERNEL,
    pick_dot_tile,
    scaled_mm_faster,
    skinny_kernel,
)

#: Rows up to which a projection takes a skinny path (``_route``: w8a16, the FP8 x FP8
#: kernel, or cuBLAS FP8 where measured faster); more rows go by the layer's ``mode``.
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

    def route_of(x: torch.Tensor) -> str:
        from executor.kernels.skinny.tiles import device_name

        name = device_name(x.device) if x.is_cuda else ""
        return _route(x.shape[0], n, k, block is not None, mode, input_scale, name)

    layer.gemm, layer.route_of = gemm, route_of
    layer.norm_gemm, layer.silu_mul_gemm, layer.norm_glu_gemm = _fused(
        weight, gemm_scale, input_scale, block, mode)
    name = ""
    if dev.type == "cuda":
        from executor.kernels.skinny.tiles import device_name

        name = device_name(dev)
    buckets = {}
    for m in (DOT_MIN_ROWS, 16, 32, SKINNY_MAX_ROWS):
        buckets[m] = _route(m, n, k, block is not None, mode, input_scale, name)
        if buckets[m] == DOT_KERNEL and dev.type == "cuda":  # (graphs keep its address)
            from executor.quant import dot_kernel

            dot_kernel.reserve(dev, m, n, k, pick_dot_tile(m, n, k, block is not None, name))
    skinny = ", ".join(f"{m}: {p}" for m, p in buckets.items())
    layer.path = (f"w8a16 (< {DOT_MIN_ROWS} rows) + {{{skinny}}} (rows up to) + "
                  f"{_MODE_NAMES[mode]}")


def _fused(weight: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor | None,
           block: tuple[int, int] | None, mode: int
           ) -> tuple[Callable[..., tuple[torch.Tensor, torch.Tensor | None] | None],
                      Callable[[torch.Tensor], torch.Tensor | None],
                      Callable[..., tuple[torch.Tensor, torch.Tensor | None] | None]]:
    """The layer's GEMMs with the RMSNorm (residual-add + RMSNorm) or the SiLU-and-mul
    before it fused in. Fewer than ``DOT_MIN_ROWS`` rows: one w8a16 launch instead of two
    (as the bf16 skinny GEMM fuses them), not where the sweep found cuBLAS FP8 faster.
    More rows, where the path quantizes its activations per token (the FP8 x FP8 kernel,
    cuBLAS FP8 row-wise): the norm or SiLU-and-mul writes e4m3 rows and their scales, which
    the GEMM takes, instead of a separate quantization pass (equal results). The third,
    for a gate|up weight: the norm fused in and the gated epilogue after it
    (``launch.w8a16_glu``), where the w8a16 norm GEMM runs and the kernel switches allow
    it (``KernelSwitches.fp8_glu``). Outside a Dynamo trace only (the fused launches are no
    custom ops)."""
    from executor.kernels import switches
    from executor.kernels.skinny.tiles import device_name
    from executor.quant import launch
    from executor.quant.tiles import ADD_RMS_NORM, RMS_NORM, SILU_MUL

    blocks = block is not None

    def path(x: torch.Tensor) -> str | None:
        """The fused path ``x`` takes: "w8a16" (one launch), "quantized", or None."""
        if torch.compiler.is_compiling() or x.dim() != 2 or x.stride(-1) != 1 \
                or x.shape[0] == 0:
            return None
        m, (n, k) = x.shape[0], weight.shape
        name = device_name(x.device) if x.is_cuda else ""
        route = _route(m, n, k, blocks, mode, input_scale, name)
        if m < DOT_MIN_ROWS:  # one w8a16 launch (not where cuBLAS FP8 was faster)
            return route if route == W8A16_KERNEL else None
        return None if route == W8A16_KERNEL or input_scale is not None else route

    def norm_route(x: torch.Tensor, residual: torch.Tensor | None,
                   norm_weight: torch.Tensor) -> str | None:
        """``path(x)`` where the norm's operands fuse too."""
        route = path(x)  # (first: it asks whether Dynamo traces before anything else)
        if route is None or norm_weight.dtype != x.dtype or not norm_weight.is_contiguous() \
                or (residual is not None and (residual.dtype != x.dtype
                                              or residual.stride(-1) != 1)):
            return None
        return route

    def norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        route = norm_route(x, residual, norm_weight)
        if route is None:
            return None
        if route == W8A16_KERNEL:
            op = RMS_NORM if residual is None else ADD_RMS_NORM
            return launch.w8a16_fused(x, weight, scale, block, op, residual, norm_weight, eps)
        from executor.kernels.norm import rms_norm_quant

        q, s, res = rms_norm_quant(x, residual, norm_weight, eps)
        return _quantized(q, s, weight, scale, None, block, mode, route, x.dtype), res

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
        route = path(gate_up)
        if route is None:
            return None
        if route == W8A16_KERNEL:
            return launch.w8a16_fused(gate_up, weight, scale, block, SILU_MUL, None, None,
                                      0.0)[0]
        from executor.kernels.activation import silu_and_mul_quant

        q, s = silu_and_mul_quant(gate_up)
        return _quantized(q, s, weight, scale, None, block, mode, route, gate_up.dtype)

    def norm_glu(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        # (the cheap tests first: at 8 rows and more the norm GEMM decides the route again;
        # under Dynamo nothing fuses, and no shape is read there: it would guard on it)
        if torch.compiler.is_compiling() or x.shape[0] >= DOT_MIN_ROWS or weight.shape[0] % 2 \
                or not switches.active().fp8_glu \
                or norm_route(x, residual, norm_weight) != W8A16_KERNEL:
            return None
        op = RMS_NORM if residual is None else ADD_RMS_NORM
        return launch.w8a16_glu(x, weight, scale, block, op, residual, norm_weight, eps)

    return norm, silu_mul, norm_glu


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
    from executor.kernels.skinny.tiles import device_name
    from executor.quant import launch

    block = (block_n, block_k) if block_n else None
    name = device_name(x.device) if x.is_cuda else ""
    n, k = weight.shape
    route = _route(x.shape[0], n, k, block is not None, mode, input_scale, name)
    if route == W8A16_KERNEL:
        return launch.w8a16(x, weight, scale, block)
    q, row_scales = launch.act_quant(x, input_scale)
    return _quantized(q, row_scales, weight, scale, input_scale, block, mode, route, x.dtype)


def _route(m: int, n: int, k: int, blocks: bool, mode: int,
           input_scale: torch.Tensor | None, device: str) -> str:
    """The path of ``m`` rows (see the module docstring): from ``DOT_MIN_ROWS`` to
    ``SKINNY_MAX_ROWS`` rows ``tiles.skinny_kernel``'s where the layer's scales allow it
    (per-tensor scales take w8a16 or cuBLAS FP8 as fewer rows do; cuBLAS FP8 needs the
    row-wise mode)."""
    if m < DOT_MIN_ROWS or m > SKINNY_MAX_ROWS:
        cublas = mode != W8A16 and (m > SKINNY_MAX_ROWS or scaled_mm_faster(m, n, k, device))
        return SCALED_MM_KERNEL if cublas else W8A16_KERNEL
    if mode == PER_TENSOR or input_scale is not None:
        faster = mode == PER_TENSOR and scaled_mm_faster(m, n, k, device)
        return SCALED_MM_KERNEL if faster else W8A16_KERNEL
    route = skinny_kernel(m, n, k, blocks, device)
    return W8A16_KERNEL if route == SCALED_MM_KERNEL and mode != ROWWISE else route


def _quantized(q: torch.Tensor, row_scales: torch.Tensor, weight: torch.Tensor,
               scale: torch.Tensor, input_scale: torch.Tensor | None,
               block: tuple[int, int] | None, mode: int, route: str, dtype: torch.dtype
               ) -> torch.Tensor:
    """The GEMM of activations already quantized (``q`` e4m3, ``row_scales`` (M, 1))."""
    if route == DOT_KERNEL:
        from executor.quant.dot_kernel import fp8_dot

        return fp8_dot(q, row_scales, weight, scale, block, dtype)
    if mode == PER_TENSOR:
        assert input_scale is not None
        return torch._scaled_mm(q, weight.t(), scale_a=input_scale, scale_b=scale[:1],
                                out_dtype=dtype)
    return torch._scaled_mm(q, weight.t(), scale_a=row_scales, scale_b=scale.view(1, -1),
                            out_dtype=dtype)


def cublas_here(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this GPU's tile sweep found cuBLAS FP8 faster for these few rows."""
    from executor.kernels.skinny.tiles import device_name

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
