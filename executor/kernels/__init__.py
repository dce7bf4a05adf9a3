"""Fused Triton kernels of the decoder layer (one concept per module).

* ``norm``: RMSNorm, and residual-add + RMSNorm in one launch (``(hidden, residual)``
  threading through the layers, vLLM-style).
* ``rope``: rotate-half RoPE on q and k in one launch, with Qwen3's per-head q/k norm
  fused in when the model has one.
* ``activation``: SiLU-and-mul over the fused gate/up output.
* ``skinny``: the projections at one row (decode at batch 1), with the RMSNorm
  before qkv and gate_up and the SiLU-and-mul before down fused into their input.
* ``embedding``: a tensor-parallel rank's embedding lookup (its rows, zeros elsewhere).

Every kernel reproduces Hugging Face's fp16/bf16 op-by-op rounding (see each module), so
the fused path stays close to the torch path that ``executor.model.layers`` keeps as the
reference. All of them return new tensors and never write their inputs.

Eager calls launch the kernels directly; under Dynamo (``torch.compiler.is_compiling()``)
the same functions call the custom ops ``torch.ops.model_executor.{rms_norm,
add_rms_norm, rope_qk, silu_and_mul}``, which have fake impls, so a compiled forward
records one opaque node per kernel. (Eager calls skip the op: its dispatcher work on the
host would cost more than some of these kernels take on the device.)

The face's names import Triton on first use (``__getattr__``), so a CPU process may import
``executor.kernels.switches`` without it; the model takes the fused path only where it runs
(see ``executor.model.layers.select_ops``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from executor.kernels.activation import silu_and_mul
    from executor.kernels.embedding import shard_embedding
    from executor.kernels.norm import add_rms_norm, rms_norm
    from executor.kernels.rope import rope_qk
    from executor.kernels.skinny.linear import add_rms_norm_linear, linear, silu_and_mul_linear

_FACE = {"silu_and_mul": "activation", "shard_embedding": "embedding",
         "add_rms_norm": "norm", "rms_norm": "norm", "rope_qk": "rope",
         "add_rms_norm_linear": "skinny.linear", "linear": "skinny.linear",
         "silu_and_mul_linear": "skinny.linear"}
__all__ = ["add_rms_norm", "add_rms_norm_linear", "linear", "rms_norm", "rope_qk",
           "shard_embedding", "silu_and_mul", "silu_and_mul_linear"]


def __getattr__(name: str) -> Any:
    if name not in _FACE:
        raise AttributeError(f"module 'executor.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"executor.kernels.{_FACE[name]}"), name)
