"""The embedded default model ``tiny``: a small random-weight Llama in HF format.

It is written once to a cache directory and loaded through the same loader as any real
checkpoint, so the default path exercises the real one.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from executor.weights.random_weights import write_random_model

TINY_LLAMA: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TINY_SEED = 1234
# Bump when the config or the weight recipe changes, so stale caches are not reused.
_TINY_VERSION = "1"


def default_cache_dir() -> Path:
    """``$MODEL_EXECUTOR_CACHE`` or ``$XDG_CACHE_HOME/model-executor`` (read at call time)."""
    explicit = os.environ.get("MODEL_EXECUTOR_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "model-executor"


def tiny_config() -> Any:
    from transformers import LlamaConfig

    cfg = LlamaConfig(**TINY_LLAMA)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def ensure_tiny_model(path: Path | None = None) -> Path:
    """Return the HF directory of ``tiny``, writing it first if it is not there yet."""
    if path is None:
        digest = hashlib.sha256(f"{_TINY_VERSION}{sorted(TINY_LLAMA.items())}{TINY_SEED}"
                                .encode()).hexdigest()[:12]
        path = default_cache_dir() / f"tiny-llama-{digest}"
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        write_random_model(path, tiny_config(), seed=TINY_SEED)
    return path
