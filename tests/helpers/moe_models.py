"""Small random-weight mixture-of-experts checkpoints (Qwen3-MoE, Mixtral), for tests.

``write_moe_model`` draws our recipe (``random_weights``: the per-expert layout), loads it
into transformers and writes it back with ``save_pretrained``, so what is served is what
transformers itself writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}
# kind -> what it covers
MOE_KINDS = {
    "qwen3_moe": "8 experts, top 2, renormalized, layer 1 dense (mlp_only_layers)",
    "qwen3_moe_raw": "4 experts, top 2, not renormalized (norm_topk_prob false), all sparse",
    "mixtral": "8 experts, top 2 (always renormalized)",
}


def moe_config(kind: str) -> Any:
    import transformers as tf

    if kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**COMMON, head_dim=32, intermediate_size=96,
                                moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=True, mlp_only_layers=[1], rope_theta=1e6)
        arch = "Qwen3MoeForCausalLM"
    elif kind == "qwen3_moe_raw":
        cfg = tf.Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=48,
                                num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)
        arch = "Qwen3MoeForCausalLM"
    elif kind == "mixtral":
        cfg = tf.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=8,
                               num_experts_per_tok=2, sliding_window=None, rope_theta=1e6)
        arch = "MixtralForCausalLM"
    else:
        raise ValueError(kind)
    cfg.architectures = [arch]
    return cfg


def write_moe_model(root: Path, kind: str, seed: int = 0) -> Path:
    """``root/kind``: our random recipe, round-tripped through transformers'
    ``from_pretrained`` and ``save_pretrained`` (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from executor.weights.random_weights import write_random_model

    drawn = write_random_model(root / f"{kind}-drawn", moe_config(kind), seed=seed)
    model = AutoModelForCausalLM.from_pretrained(str(drawn), dtype=torch.float32)
    out = root / kind
    model.save_pretrained(str(out))
    return out
