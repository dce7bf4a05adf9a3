"""FP8 checkpoints written from random weights, in each published layout, for tests.

``write_fp8_model`` quantizes a random Llama's projections (q/k/v/o, gate/up/down) in one
format and writes them as the format's producers do: ``weight`` in float8_e4m3fn plus its
scale tensors, and the ``quantization_config`` in config.json (ModelOpt's ``modelopt``
also as that). ``write_dequantized`` writes the same FP8 values dequantized to float32 as
a plain checkpoint: the reference every FP8 path is compared with.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file

from executor.quant.fp8 import dequantize, quantize_blocks, quantize_rows, quantize_tensor
from executor.weights.random_weights import random_state_dict

Format = Literal["block", "channel", "tensor", "modelopt", "fp8_tensor"]
FORMATS: tuple[Format, ...] = ("block", "channel", "tensor", "modelopt")
# (the MoE experts' too: Qwen3-MoE's per-expert gate/up/down_proj, Mixtral's w1/w3/w2)
_PROJ = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)"
                   r"\.weight$")
#: The static input scale written for per-tensor formats (activations up to ~8).
INPUT_SCALE = 8.0 / 448.0


def fp8_config(cfg: dict[str, Any]) -> Any:
    """A tiny Llama whose fused shards and TP = 2 slices keep whole 128x128 blocks
    (``cfg`` overrides its fields)."""
    from transformers import LlamaConfig

    fields: dict[str, Any] = dict(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    c = LlamaConfig(**{**fields, **cfg})
    c.architectures = ["LlamaForCausalLM"]
    return c


def _ct_group(strategy: str, acts: dict[str, Any] | None) -> dict[str, Any]:
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
               "dynamic": False, "group_size": None,
               "block_structure": [128, 128] if strategy == "block" else None}
    return {"targets": ["Linear"], "weights": weights, "input_activations": acts}


def quantization_config(fmt: Format) -> dict[str, Any]:
    if fmt == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}
    if fmt == "fp8_tensor":
        return {"quant_method": "fp8", "activation_scheme": "static"}
    if fmt == "modelopt":
        return {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"]}
    token = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
             "symmetric": True}
    tensor = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
              "symmetric": True}
    group = _ct_group("channel", token) if fmt == "channel" else _ct_group("tensor", tensor)
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": group}, "kv_cache_scheme": None}


def quantize_state_dict(sd: dict[str, torch.Tensor], fmt: Format) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if not _PROJ.search(name):
            out[name] = t
            continue
        base = name.removesuffix("weight")
        if fmt == "block":
            q, s = quantize_blocks(t)
            out[name], out[base + "weight_scale_inv"] = q, s
        elif fmt == "channel":
            q, s = quantize_rows(t)
            out[name], out[base + "weight_scale"] = q, s  # (N, 1)
        else:
            q, s = quantize_tensor(t)
            out[name] = q
            # compressed-tensors writes (1,), ModelOpt and AutoFP8 a scalar
            out[base + "weight_scale"] = s.reshape(1) if fmt == "tensor" else s.reshape(())
            out[base + "input_scale"] = torch.tensor(INPUT_SCALE).reshape(s.reshape(
                1 if fmt == "tensor" else ()).shape)
    return out


def fp8_moe_config(kind: str, cfg: dict[str, Any]) -> Any:
    """A tiny Qwen3-MoE (layer 1 dense) or Mixtral whose projections, experts and their
    TP = 2 slices keep whole 128x128 blocks (``cfg`` overrides its fields)."""
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=1024,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2)
    if kind == "qwen3_moe":
        c = tf.Qwen3MoeConfig(**{**common, "intermediate_size": 512,
                                 "moe_intermediate_size": 256, "num_experts": 4,
                                 "num_experts_per_tok": 2, "norm_topk_prob": True,
                                 "mlp_only_layers": [1], **cfg})
        c.architectures = ["Qwen3MoeForCausalLM"]
    else:
        c = tf.MixtralConfig(**{**common, "intermediate_size": 256, "num_local_experts": 4,
                                "num_experts_per_tok": 2, "sliding_window": None, **cfg})
        c.architectures = ["MixtralForCausalLM"]
    return c


def write_fp8_model(path: Path, fmt: Format, seed: int = 7, moe: str | None = None,
                    **cfg: Any) -> Path:
    """An FP8 checkpoint in ``fmt``: a tiny Llama, or with ``moe`` ("qwen3_moe",
    "mixtral") a tiny mixture of experts (its experts quantized too, the routers not)."""
    config = fp8_config(cfg) if moe is None else fp8_moe_config(moe, cfg)
    config.quantization_config = quantization_config(fmt)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(path))
    sd = random_state_dict(config, seed, torch.bfloat16)
    save_file(quantize_state_dict(sd, fmt), str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


def write_fp8_copy(src: Path, path: Path, fmt: Format) -> Path:
    """``src`` (an unquantized checkpoint, one file) quantized in ``fmt`` at ``path``."""
    import json

    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt)
    (path / "config.json").write_text(json.dumps(config))
    sd = load_file(str(src / "model.safetensors"))
    save_file(quantize_state_dict(sd, fmt), str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


def dequantized_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint at ``path`` with every projection dequantized to float32."""
    sd = load_file(str(path / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if re.search(r"\.(weight_scale|weight_scale_inv|input_scale)$", name):
            continue
        if _PROJ.search(name):
            base = name.removesuffix("weight")
            if base + "weight_scale_inv" in sd:
                out[name] = dequantize(t, sd[base + "weight_scale_inv"], (128, 128),
                                       torch.float32)
            else:
                scale = sd[base + "weight_scale"]
                out[name] = dequantize(t, scale.reshape(-1, 1) if scale.numel() > 1
                                       else scale.reshape(()), None, torch.float32)
        else:
            out[name] = t.float()
    return out


def write_dequantized(fp8_path: Path, path: Path) -> Path:
    """A plain float32 checkpoint of ``fp8_path``'s dequantized values."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(fp8_path))
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(path))
    save_file(dequantized_state_dict(fp8_path), str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path
