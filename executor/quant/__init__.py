"""Quantized weights as a weight format of the projections, not a model.

``scheme`` reads which FP8 format a checkpoint uses (or ``--quantization fp8``) and refuses
the rest in one line; ``linear.Fp8Linear`` holds a projection's FP8 weight and scales and
loads its slice of them; ``install`` swaps projections in before loading and finishes
them after (GEMM paths on FP8 GPUs, dequantization once elsewhere); ``gemm`` chooses and
runs the GEMMs; ``kernels``/``launch`` are the Triton kernels; ``fp8`` the plain-torch
reference arithmetic. The layouts and rules: docs/quantization.md.
"""

from executor.quant.install import QuantInfo, finalize, info_of, install, quantize_at_load
from executor.quant.linear import Fp8Linear
from executor.quant.scheme import (
    QUANTIZATION_CHOICES,
    Fp8Scheme,
    quantization_config,
    read_scheme,
)

__all__ = ["QUANTIZATION_CHOICES", "Fp8Linear", "Fp8Scheme", "QuantInfo", "finalize",
           "info_of", "install", "quantization_config", "quantize_at_load", "read_scheme"]
