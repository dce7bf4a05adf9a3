"""Real model shapes with random weights: the benchmarks measure shapes, not checkpoints, so
no download is needed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

LLAMA_3_2_1B: dict[str, Any] = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
LLAMA_3_1_8B: dict[str, Any] = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
# Served only at tensor parallel sizes >= 4 (140 GB of bf16 weights), with
# ``--load-format random`` (``write_config``): too large to write here.
# (the 8B's vocabulary, KV heads, head size and RoPE; wider and deeper)
LLAMA_3_1_70B: dict[str, Any] = {**LLAMA_3_1_8B, "hidden_size": 8192,
                                 "intermediate_size": 28672, "num_hidden_layers": 80,
                                 "num_attention_heads": 64}
# SmolLM2-135M (the default served model) with random weights: small and odd (hidden
# 576, 9 query and 3 KV heads), where the step is kernel count rather than bytes.
SMOLLM2_135M: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_theta=100000.0,
)
SHAPES = {"llama-3.2-1b": LLAMA_3_2_1B, "llama-3.1-8b": LLAMA_3_1_8B,
          "llama-3.1-70b": LLAMA_3_1_70B, "smollm2-135m": SMOLLM2_135M}
# Shapes of other families, from the executor's catalog of random shapes (served there by
# name with ``--load-format random``): Gemma 3 12B (sliding and global layers, head_dim
# 256), Qwen3-30B-A3B (128 experts, 8 active).
for _name in ("gemma-3-12b", "qwen3-30b-a3b"):
    SHAPES[_name] = {}


def hf_config(name: str) -> Any:
    from executor.weights.catalog import RANDOM_SHAPES, shape_config

    if name in RANDOM_SHAPES:
        return shape_config(name)
    from transformers import LlamaConfig

    cfg = LlamaConfig(**SHAPES[name])
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def write_shape(name: str, root: Path) -> Path:
    """Write ``name`` in HF format (bf16 random weights) under ``root`` unless present."""
    import torch

    from executor.weights.random_weights import write_random_model

    path = root / name
    if not (path / "config.json").is_file():
        write_random_model(path, hf_config(name), seed=0, dtype=torch.bfloat16,
                           max_shard_bytes=2 * 2**30)
    return path


def write_config(name: str, root: Path) -> Path:
    """Only ``name``'s config.json under ``root/<name>-config`` (for ``--load-format
    random``, which draws the weights on the device)."""
    path = root / f"{name}-config"
    if not (path / "config.json").is_file():
        hf_config(name).save_pretrained(str(path))
    return path


def weight_bytes(name: str) -> int:
    """Bytes of bf16 weights read per decode step (embedding rows excluded but lm_head in)."""
    return spec_weight_bytes(spec(name))


def spec_weight_bytes(spec: Any) -> int:
    """``weight_bytes`` of a ``ModelSpec``."""
    n = spec.num_params()
    if spec.tie_word_embeddings:  # embedding table is read once as lm_head; lookups are tiny
        return 2 * n
    return 2 * (n - spec.vocab_size * spec.hidden_size)


def moe_step_weight_bytes(spec: Any, experts_per_layer: Sequence[int], fp8: bool = False
                          ) -> int:
    """Bytes of bf16 weights a mixture-of-experts step reads: everything but the experts
    (attention, norms, routers, dense layers' MLPs, the LM head; embedding rows excluded)
    plus ``experts_per_layer[j]`` experts of the ``j``-th sparse layer (``top_k`` each at
    batch 1; the distinct experts a batch's tokens were routed to). ``fp8``: the attention
    projections, dense MLPs and experts at one byte a weight (routers, norms and the LM head
    stay bf16)."""
    moe = spec.moe
    sparse = [layer for layer in range(spec.num_layers) if moe.sparse(layer)]
    if len(experts_per_layer) != len(sparse):
        raise ValueError(f"{len(experts_per_layer)} expert counts for {len(sparse)} sparse "
                         "layers")
    per_expert = 3 * spec.hidden_size * moe.intermediate_size
    rest = spec.num_params() - len(sparse) * moe.num_experts * per_expert
    if not spec.tie_word_embeddings:  # the embedding table is looked up, not read
        rest -= spec.vocab_size * spec.hidden_size
    if not fp8:
        return 2 * (rest + per_expert * sum(experts_per_layer))
    h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
    proj = spec.num_layers * (h * (q + 2 * kv) + q * h) \
        + (spec.num_layers - len(sparse)) * 3 * h * spec.intermediate_size
    return 2 * (rest - proj) + proj + per_expert * sum(experts_per_layer)


def spec(name: str) -> Any:
    from executor.model.spec import spec_from_hf_config

    return spec_from_hf_config(hf_config(name))


def projections(spec: Any) -> dict[str, tuple[int, int]]:
    """``name -> (in_features, out_features)`` of one decoder layer's GEMMs and the head;
    a mixture of experts' layer has its router (``router``) for an MLP (its experts are
    ``bench.kernels.moe_decode``'s)."""
    if getattr(spec, "moe", None) is not None:
        return {"qkv": (spec.hidden_size, spec.q_size + 2 * spec.kv_size),
                "o": (spec.q_size, spec.hidden_size),
                "router": (spec.hidden_size, spec.moe.num_experts),
                "lm_head": (spec.hidden_size, spec.vocab_size)}
    return {
        "qkv": (spec.hidden_size, spec.q_size + 2 * spec.kv_size),
        "o": (spec.q_size, spec.hidden_size),
        "gate_up": (spec.hidden_size, 2 * spec.intermediate_size),
        "down": (spec.intermediate_size, spec.hidden_size),
        "lm_head": (spec.hidden_size, spec.vocab_size),
    }


def model(name: str, root: Path, load_format: str = "safetensors") -> tuple[Path, Any]:
    """``(directory, ModelSpec)`` of a bench shape written under ``root`` (only its
    config.json for ``load_format`` "random", whose weights the executor draws), or of
    the embedded ``tiny`` model (the smoke profile), loaded through the real loader."""
    if name == "tiny":
        from executor.weights.loader import load_hf_config
        from executor.weights.tiny import ensure_tiny_model

        path = ensure_tiny_model()
        return path, load_hf_config(path)
    if load_format == "random":
        return write_config(name, root), spec(name)
    return write_shape(name, root), spec(name)


def label(name: str) -> str:
    """Short name in tables: ``1B``, ``8B``, ``tiny``."""
    return {"llama-3.2-1b": "1B", "llama-3.1-8b": "8B", "llama-3.1-70b": "70B",
            "smollm2-135m": "135M", "gemma-3-12b": "G3-12B"}.get(name, name)


def title(name: str) -> str:
    return {"llama-3.2-1b": "Llama-3.2-1B shape", "llama-3.1-8b": "Llama-3.1-8B shape",
            "llama-3.1-70b": "Llama-3.1-70B shape",
            "smollm2-135m": "SmolLM2-135M shape", "gemma-3-12b": "Gemma-3-12B shape",
            "tiny": "embedded tiny model"}.get(name, name)
