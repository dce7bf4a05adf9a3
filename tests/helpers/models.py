"""Small random-weight HF checkpoints of each supported architecture, for tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ARCHS = ("llama", "qwen2", "qwen3", "mistral")  # one tiny checkpoint each (``write_model``)

COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}


def hf_config(kind: str) -> Any:
    import transformers as tf

    if kind == "llama":  # Llama 3 style: RoPE scaling and explicit head_dim
        cfg = tf.LlamaConfig(**COMMON, head_dim=16, rope_theta=50000.0, rope_scaling={
            "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
        arch = "LlamaForCausalLM"
    elif kind == "qwen2":  # qkv bias, tied embeddings
        cfg = tf.Qwen2Config(**COMMON, tie_word_embeddings=True, rope_theta=10000.0)
        arch = "Qwen2ForCausalLM"
    elif kind == "qwen3":  # per-head q/k RMSNorm, head_dim != hidden / heads
        cfg = tf.Qwen3Config(**COMMON, head_dim=32, rope_theta=1000000.0)
        arch = "Qwen3ForCausalLM"
    elif kind == "mistral":  # no sliding window
        cfg = tf.MistralConfig(**COMMON, sliding_window=None)
        arch = "MistralForCausalLM"
    else:
        raise ValueError(kind)
    cfg.architectures = [arch]
    return cfg


def write_model(root: Path, kind: str, seed: int = 0, **kwargs: Any) -> Path:
    from executor.weights.random_weights import write_random_model

    return write_random_model(root / kind, hf_config(kind), seed=seed, **kwargs)
