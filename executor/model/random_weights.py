"""Write random-weight checkpoints in Hugging Face format (for tests, benchmarks, ``tiny``).

Weights cannot be downloaded here, so every model we run is written by this module and
then loaded through the real loader. Scales are chosen so logits are well spread (no
near-ties that would make greedy comparisons flaky) and activations stay bounded.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def random_state_dict(cfg: Any, seed: int, dtype: torch.dtype = torch.float32
                      ) -> dict[str, torch.Tensor]:
    """HF-named random tensors for a Llama-family ``PretrainedConfig``."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    qkv_bias = getattr(cfg, "attention_bias", False) or cfg.model_type == "qwen2"
    qk_norm = cfg.model_type == "qwen3"

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def norm_weight(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(dtype)

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab, h, std=1.0)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm_weight(h)
        sd[p + "post_attention_layernorm.weight"] = norm_weight(h)
        for name, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim),
                           ("v", kv_heads * head_dim)):
            sd[p + f"self_attn.{name}_proj.weight"] = normal(rows, h, std=1 / math.sqrt(h))
            if qkv_bias:
                sd[p + f"self_attn.{name}_proj.bias"] = normal(rows, std=0.1)
        sd[p + "self_attn.o_proj.weight"] = normal(h, heads * head_dim,
                                                   std=1 / math.sqrt(heads * head_dim))
        if qk_norm:
            sd[p + "self_attn.q_norm.weight"] = norm_weight(head_dim)
            sd[p + "self_attn.k_norm.weight"] = norm_weight(head_dim)
        sd[p + "mlp.gate_proj.weight"] = normal(inter, h, std=1 / math.sqrt(h))
        sd[p + "mlp.up_proj.weight"] = normal(inter, h, std=1 / math.sqrt(h))
        sd[p + "mlp.down_proj.weight"] = normal(h, inter, std=1 / math.sqrt(inter))
    sd["model.norm.weight"] = norm_weight(h)
    if not getattr(cfg, "tie_word_embeddings", False):
        sd["lm_head.weight"] = normal(vocab, h, std=3 / math.sqrt(h))
    return sd


def write_random_model(path: Path, cfg: Any, seed: int = 0, dtype: torch.dtype = torch.float32,
                       max_shard_bytes: int | None = None) -> Path:
    """Write ``cfg`` and random weights to ``path`` atomically (a temp dir, then rename).

    ``max_shard_bytes`` splits the weights into several files with an index, as large HF
    checkpoints are.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        cfg.save_pretrained(str(tmp))
        sd = random_state_dict(cfg, seed, dtype)
        if max_shard_bytes is None:
            save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            _save_sharded(sd, tmp, max_shard_bytes)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _save_sharded(sd: dict[str, torch.Tensor], out: Path, max_bytes: int) -> None:
    import json

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in sd.items():
        if size + t.nbytes > max_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.nbytes for t in sd.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
