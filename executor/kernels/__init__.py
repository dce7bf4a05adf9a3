"""Fused Triton kernels of the decoder layer (one concept per module).

``norm`` (RMSNorm; residual-add + RMSNorm), ``rope`` (q and k, with Qwen3's q/k norm),
``activation`` (SiLU-and-mul), ``skinny`` (the one-row projections with the norm or
SiLU-and-mul fused into their input, and the LM head's), ``embedding`` (the token lookup,
whole or a tensor-parallel rank's share).
Every kernel reproduces Hugging Face's fp16/bf16 op-by-op rounding, so the fused path stays
close to the torch path ``executor.model.layers`` keeps as the reference; all return new
tensors. Under Dynamo the same functions call custom ops with fake impls
(``torch.ops.model_executor.*``), so a compiled forward records one opaque node per kernel.

The face's names import Triton on first use (``__getattr__``), so a CPU process may import
``executor.kernels.switches`` without it; the model takes the fused path only where it runs
(``executor.model.layers.select_ops``). Why each kernel exists: ``docs/kernels.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from executor.kernels.activation import silu_and_mul
    from executor.kernels.embedding import shard_embedding, token_embedding
    from executor.kernels.norm import add_rms_norm, rms_norm
    from executor.kernels.rope import rope_qk
    from executor.kernels.skinny.linear import (
        add_rms_norm_linear,
        linear,
        logits_into,
        silu_and_mul_linear,
    )

_FACE = {"silu_and_mul": "activation", "token_embedding": "embedding",
         "shard_embedding": "embedding",
         "add_rms_norm": "norm", "rms_norm": "norm", "rope_qk": "rope",
         "add_rms_norm_linear": "skinny.linear", "linear": "skinny.linear",
         "logits_into": "skinny.linear", "silu_and_mul_linear": "skinny.linear"}
__all__ = ["add_rms_norm", "add_rms_norm_linear", "linear", "logits_into",
           "rms_norm", "rope_qk", "shard_embedding", "silu_and_mul", "silu_and_mul_linear",
           "token_embedding"]


def __getattr__(name: str) -> Any:
    if name not in _FACE:
        raise AttributeError(f"module 'executor.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"executor.kernels.{_FACE[name]}"), name)
