"""Fused Triton kernels of the decoder layer (one concept per module).

* ``norm``: RMSNorm, and residual-add + RMSNorm in one launch (``(hidden, residual)``
  threading through the layers, vLLM-style).
* ``rope``: rotate-half RoPE on q and k in one launch, with Qwen3's per-head q/k norm
  fused in when the model has one.
* ``activation``: SiLU-and-mul over the fused gate/up output.
* ``skinny_gemm``: the projections at one row (decode at batch 1), with the RMSNorm
  before qkv and gate_up and the SiLU-and-mul before down fused into their input.
* ``embedding``: a tensor-parallel rank's embedding lookup (its rows, zeros elsewhere).

Every kernel reproduces Hugging Face's fp16/bf16 op-by-op rounding (see each module), so
the fused path stays close to the torch path that ``executor.model.layers`` keeps as the
reference. All of them return new tensors and never write their inputs.

Eager calls launch the kernels directly; under Dynamo (``torch.compiler.is_compiling()``)
the same functions call the custom ops ``torch.ops.model_executor.{rms_norm,
add_rms_norm, rope_qk, silu_and_mul}``, which have fake impls, so a compiled forward
records one opaque node per kernel. (Going through the op in eager too would add about
10 us of dispatcher work per call on the host.)

Importing this package imports Triton: the model imports it only when it takes the fused
path (see ``executor.model.layers.select_ops``).
"""

from executor.kernels.activation import silu_and_mul
from executor.kernels.embedding import shard_embedding
from executor.kernels.norm import add_rms_norm, rms_norm
from executor.kernels.rope import rope_qk
from executor.kernels.skinny_gemm import add_rms_norm_linear, linear, silu_and_mul_linear

__all__ = ["add_rms_norm", "add_rms_norm_linear", "linear", "rms_norm", "rope_qk",
           "shard_embedding", "silu_and_mul", "silu_and_mul_linear"]
