"""Write random-weight checkpoints in Hugging Face format (for tests, benchmarks, ``tiny``).

Weights cannot be downloaded here, so every model we run is written by this module and
then loaded through the real loader. Scales are chosen so logits are well spread (no
near-ties that would make greedy comparisons flaky) and activations stay bounded.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from executor.weights.experts import moe_layer_recipe


@dataclass(frozen=True)
class RandomTensor:
    """One tensor of the recipe: ``shape`` drawn as ``std * N(0, 1)`` around ``mean``."""

    shape: tuple[int, ...]
    std: float
    mean: float = 0.0


def random_recipe(cfg: Any) -> dict[str, RandomTensor]:
    """HF name -> how its random values are drawn, for a ``PretrainedConfig`` of a family
    we serve (the Llama family, Phi-3's fused tensors, Gemma's extra norms)
    (in checkpoint order: ``random_state_dict`` draws them from one generator in it)."""
    h, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    from executor.model.spec import ARCHITECTURES, ArchFeatures

    archs = list(getattr(cfg, "architectures", None) or [""])
    features = ARCHITECTURES.get(archs[0], ArchFeatures())
    qkv_bias = getattr(cfg, "attention_bias", False) or cfg.model_type == "qwen2"
    qk_norm = cfg.model_type in ("qwen3", "qwen3_moe") or features.qk_norm
    fused = features.fused_checkpoint  # q/k/v and gate/up stored as one tensor each
    # Gemma's norms scale by 1 + weight: weights around 0, not 1.
    norm_mean = 0.0 if features.gemma_norms else 1.0
    layer_norms = ("input_layernorm", "post_attention_layernorm") + (
        ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        if features.gemma_norms else ())

    def norm(n: int) -> RandomTensor:
        return RandomTensor((n,), 0.1, norm_mean)

    out: dict[str, RandomTensor] = {"model.embed_tokens.weight": RandomTensor((vocab, h), 1.0)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for layer_norm in layer_norms:
            out[p + f"{layer_norm}.weight"] = norm(h)
        qkv_rows = (("q", heads * head_dim), ("k", kv_heads * head_dim),
                    ("v", kv_heads * head_dim))
        if fused:
            out[p + "self_attn.qkv_proj.weight"] = RandomTensor(
                (sum(rows for _, rows in qkv_rows), h), 1 / math.sqrt(h))
        for name, rows in () if fused else qkv_rows:
            out[p + f"self_attn.{name}_proj.weight"] = RandomTensor((rows, h), 1 / math.sqrt(h))
            if qkv_bias:
                out[p + f"self_attn.{name}_proj.bias"] = RandomTensor((rows,), 0.1)
        out[p + "self_attn.o_proj.weight"] = RandomTensor(
            (h, heads * head_dim), 1 / math.sqrt(heads * head_dim))
        if qk_norm:
            out[p + "self_attn.q_norm.weight"] = norm(head_dim)
            out[p + "self_attn.k_norm.weight"] = norm(head_dim)
        sparse = moe_layer_recipe(cfg, i)  # a mixture-of-experts layer's router and experts
        if sparse is not None:
            out.update({name: RandomTensor(shape, std) for name, (shape, std) in sparse.items()})
            continue
        if fused:
            out[p + "mlp.gate_up_proj.weight"] = RandomTensor((2 * inter, h), 1 / math.sqrt(h))
        else:
            out[p + "mlp.gate_proj.weight"] = RandomTensor((inter, h), 1 / math.sqrt(h))
            out[p + "mlp.up_proj.weight"] = RandomTensor((inter, h), 1 / math.sqrt(h))
        out[p + "mlp.down_proj.weight"] = RandomTensor((h, inter), 1 / math.sqrt(inter))
    out["model.norm.weight"] = norm(h)
    if not getattr(cfg, "tie_word_embeddings", False):
        out["lm_head.weight"] = RandomTensor((vocab, h), 3 / math.sqrt(h))
    return out


def random_state_dict(cfg: Any, seed: int, dtype: torch.dtype = torch.float32
                      ) -> dict[str, torch.Tensor]:
    """HF-named random tensors for a Llama-family ``PretrainedConfig`` (on the CPU, one
    generator drawn in checkpoint order)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: (t.mean + torch.randn(*t.shape, generator=gen) * t.std).to(dtype)
            for name, t in random_recipe(cfg).items()}


class RandomCheckpoint:
    """A checkpoint that exists only as ``random_recipe(cfg)``: ``--load-format random``.

    Reads like an open ``safetensors.safe_open`` (``keys``, ``get_slice``), so the loader
    and tensor-parallel sharding treat it as a file. Each tensor is drawn on ``device``
    from its own generator, seeded by ``seed`` and the tensor's name, whole and then
    sliced: a rank gets the same values as the same rows of a TP = 1 load, and nothing is
    written to or read from disk (a 70B shape loads in seconds). The values are not
    those ``write_random_model`` writes (that draws all tensors from one CPU generator).
    """

    def __init__(self, cfg: Any, seed: int, device: torch.device) -> None:
        self.recipe = random_recipe(cfg)
        self.seed = seed
        self.device = device

    def keys(self) -> list[str]:
        return list(self.recipe)

    def get_slice(self, name: str) -> _RandomSlice:
        return _RandomSlice(self, name)

    def draw(self, name: str) -> torch.Tensor:
        """The whole of tensor ``name`` (float32, on the device)."""
        t = self.recipe[name]
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        gen = torch.Generator(device=self.device).manual_seed(
            int.from_bytes(digest[:8], "little") >> 1)
        values = torch.randn(t.shape, generator=gen, device=self.device)
        values.mul_(t.std)
        if t.mean:
            values.add_(t.mean)
        return values


class _RandomSlice:
    """``get_slice``'s answer: the shape without drawing, values when indexed."""

    def __init__(self, checkpoint: RandomCheckpoint, name: str) -> None:
        self.checkpoint, self.name = checkpoint, name

    def get_shape(self) -> list[int]:
        return list(self.checkpoint.recipe[self.name].shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.checkpoint.draw(self.name)[index]


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
