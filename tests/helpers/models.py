"""Small random-weight HF checkpoints of each supported architecture, for tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ARCHS = ("llama", "qwen2", "qwen3", "mistral")  # one tiny checkpoint each (``write_model``)
#: Families with sliding windows, soft-caps or fused checkpoints (``hf_config`` kinds):
#: every window (8) is shorter than the parity prompts.
WINDOWED_ARCHS = ("mistral_window", "qwen2_window", "gemma2", "gemma3", "phi3")
WINDOW = 8

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


#: GPU tests' sizes for ``hf_config(kind, **GPU_SIZES)``: vocabulary 1024 (the GPU
#: helpers' random tokens), Gemma's head_dim 256, a window (64) shorter than the prompts.
GPU_SIZES: dict[str, Any] = {"vocab_size": 1024, "hidden_size": 512,
                             "intermediate_size": 1024, "num_attention_heads": 8,
                             "num_key_value_heads": 2, "max_position_embeddings": 4096}
GPU_WINDOW = 64


def hf_config(kind: str, window: int | None = None, **sizes: Any) -> Any:
    """``kind``'s tiny config; ``sizes`` override ``COMMON`` (and the kinds' own sizes),
    ``window`` the windowed kinds' window."""
    import transformers as tf

    def args(**own: Any) -> dict[str, Any]:
        return {**COMMON, **own, **sizes}

    w = window or WINDOW
    big_head = 256 if "hidden_size" in sizes else None  # Gemma's real head size

    if kind == "llama":  # Llama 3 style: RoPE scaling and explicit head_dim
        cfg = tf.LlamaConfig(**args(head_dim=16), rope_theta=50000.0, rope_scaling={
            "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
        arch = "LlamaForCausalLM"
    elif kind == "qwen2":  # qkv bias, tied embeddings
        cfg = tf.Qwen2Config(**args(), tie_word_embeddings=True, rope_theta=10000.0)
        arch = "Qwen2ForCausalLM"
    elif kind == "qwen3":  # per-head q/k RMSNorm, head_dim != hidden / heads
        cfg = tf.Qwen3Config(**args(head_dim=32), rope_theta=1000000.0)
        arch = "Qwen3ForCausalLM"
    elif kind == "mistral":  # no sliding window
        cfg = tf.MistralConfig(**args(), sliding_window=None)
        arch = "MistralForCausalLM"
    elif kind == "mistral_window":  # every layer windowed
        cfg = tf.MistralConfig(**args(), sliding_window=w)
        arch = "MistralForCausalLM"
    elif kind == "qwen2_window":  # windowed from layer max_window_layers on
        cfg = tf.Qwen2Config(**args(num_hidden_layers=3), use_sliding_window=True,
                             sliding_window=w, max_window_layers=1)
        arch = "Qwen2ForCausalLM"
    elif kind == "gemma2":  # sliding/global alternating, both soft-caps
        cfg = tf.Gemma2Config(**args(num_hidden_layers=3, head_dim=big_head or 16),
                              sliding_window=w, query_pre_attn_scalar=24,
                              attn_logit_softcapping=5.0, final_logit_softcapping=4.0)
        arch = "Gemma2ForCausalLM"
    elif kind == "gemma3":  # q/k norm, a local RoPE base, one global layer in three
        cfg = tf.Gemma3TextConfig(**args(num_hidden_layers=3, head_dim=big_head or 32),
                                  sliding_window=w, sliding_window_pattern=3,
                                  query_pre_attn_scalar=32, rope_theta=1000000.0,
                                  rope_local_base_freq=10000.0,
                                  rope_scaling={"rope_type": "linear", "factor": 2.0})
        arch = "Gemma3ForCausalLM"
    elif kind == "phi3":  # fused qkv / gate_up in the checkpoint, a window, partial RoPE
        cfg = tf.Phi3Config(**args(), sliding_window=w, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2,
                            partial_rotary_factor=0.5)
        arch = "Phi3ForCausalLM"
    else:
        raise ValueError(kind)
    cfg.architectures = [arch]
    return cfg


def write_model(root: Path, kind: str, seed: int = 0, **kwargs: Any) -> Path:
    from executor.weights.random_weights import write_random_model

    return write_random_model(root / kind, hf_config(kind), seed=seed, **kwargs)


def write_gpu_model(root: Path, kind: str, seed: int = 0) -> Path:
    """``kind`` at the GPU tests' sizes (``GPU_SIZES``, window ``GPU_WINDOW``)."""
    from executor.weights.random_weights import write_random_model

    return write_random_model(root / f"gpu-{kind}", hf_config(kind, GPU_WINDOW, **GPU_SIZES),
                              seed=seed)
