"""Convert a Llama GGUF file into a Hugging Face model directory.

The ``gguf`` package (the optional ``demo`` extra) reads the file and dequantizes each
tensor to float32; this module only renames tensors, undoes the rotary permutation that
llama.cpp's converter applies to the q/k projections, and writes ``config.json``,
``model.safetensors`` (float32: the dequantized values exactly, no second rounding),
``generation_config.json`` and the tokenizer with its chat template, which transformers
builds from the GGUF's own vocabulary. The result loads through our normal loader and
through transformers' ``from_pretrained``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from executor.errors import ModelLoadError


class GGUFConversionError(ModelLoadError):
    """The GGUF cannot become a Llama HF directory; the message says why, in one line."""


# GGUF tensor name (after ``blk.N.``) -> HF name (after ``model.layers.N.``).
_LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def import_gguf() -> Any:
    """The ``gguf`` module, or a one-line error naming the extra that provides it."""
    try:
        import gguf
    except ImportError as exc:
        raise GGUFConversionError(
            "converting a GGUF model needs the 'gguf' package, which is not installed: "
            "pip install 'model-executor[demo]' (scripts/serve.sh does this)") from exc
    return gguf


def hf_tensor_name(gguf_name: str) -> str:
    """``blk.3.attn_k.weight`` -> ``model.layers.3.self_attn.k_proj.weight``."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        raise GGUFConversionError(f"GGUF tensor {gguf_name!r} has no counterpart in a Llama "
                                  "checkpoint (unsupported GGUF variant)")
    return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation. (num_heads * head_dim, hidden) either way.

    HF Llama rotates the two halves of each head's dimensions against each other
    (``rotate_half``); GGML rotates adjacent pairs. llama.cpp's converter therefore
    reorders each head's rows from [x0..x{d/2-1}, y0..y{d/2-1}] to [x0, y0, x1, y1, ...].
    Reading rows as (head, pair index, half) and swapping the last two axes restores HF's
    (head, half, pair index) order.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    # NOTE: the permutation is per head, so k uses the KV head count, not the query's.
    pairs = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


class _Fields:
    """Typed access to a GGUF's metadata (``GGUFReader.fields``)."""

    def __init__(self, reader: Any, path: Path) -> None:
        self._fields = reader.fields
        self._path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFConversionError(f"{self._path.name} lacks the metadata key {key!r}")
        return value


def hf_config(fields: _Fields, vocab_size: int, tied: bool) -> dict[str, Any]:
    """``config.json`` for a Llama GGUF's metadata (``llama.*`` keys)."""
    heads = int(fields.require("llama.attention.head_count"))
    hidden = int(fields.require("llama.embedding_length"))
    head_dim = int(fields.get("llama.attention.key_length",
                              fields.get("llama.rope.dimension_count", hidden // heads)))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(fields.require("llama.feed_forward_length")),
        "num_hidden_layers": int(fields.require("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(fields.get("llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(fields.require("llama.context_length")),
        # The float32 value the file holds (1e-5 reads back as 9.9999997e-06), as
        # transformers' own GGUF loading uses it.
        "rms_norm_eps": float(fields.require("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(fields.get("llama.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
    }
    scaling = fields.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GGUFConversionError(f"GGUF RoPE scaling {scaling!r} is not supported "
                                      "(supported: none, linear)")
        config["rope_scaling"] = {"rope_type": "linear",
                                  "factor": float(fields.require("llama.rope.scaling.factor"))}
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
        value = fields.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[hf_key] = int(value)
    return config


def convert_llama_gguf(gguf_path: Path, out_dir: Path, progress: bool = False) -> None:
    """Write the HF directory for ``gguf_path`` into ``out_dir`` (which must exist).

    Raises ``GGUFConversionError`` (one line) if the file is not a Llama GGUF or holds a
    tensor we cannot place. Peak memory is about the float32 model (4 bytes a parameter).
    """
    gguf = import_gguf()
    from safetensors.torch import save_file
    from tqdm import tqdm

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except (ValueError, OSError) as exc:
        raise GGUFConversionError(f"{gguf_path.name} is not a readable GGUF file: {exc}"
                                  ) from exc
    fields = _Fields(reader, gguf_path)
    arch = fields.require("general.architecture")
    if arch != "llama":
        raise GGUFConversionError(f"{gguf_path.name} holds a {arch!r} model; only Llama "
                                  "GGUFs (general.architecture = 'llama') can be converted")
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise GGUFConversionError(f"{gguf_path.name} has no token_embd.weight tensor")
    config = hf_config(fields, vocab_size=int(embed.shape[-1]), tied=tied)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    weights: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc="converting GGUF", unit="tensor",
                       disable=not progress):
        name = hf_tensor_name(tensor.name)
        # GGUF lists dimensions fastest first; numpy wants them slowest first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if name.endswith("q_proj.weight"):
            values = unpermute_rotary(values, heads)
        elif name.endswith("k_proj.weight"):
            values = unpermute_rotary(values, kv_heads)
        weights[name] = torch.from_numpy(np.array(values, dtype=np.float32))  # a copy
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del weights
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if key in config}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _write_tokenizer(gguf_path, out_dir)


def _write_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """The tokenizer files and chat template, built by transformers from the GGUF."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent),
                                                  gguf_file=gguf_path.name)
    except Exception as exc:  # transformers raises many types for an odd vocabulary
        raise GGUFConversionError(f"cannot build a tokenizer from {gguf_path.name}: {exc}"
                                  ) from exc
    tokenizer.save_pretrained(str(out_dir))
