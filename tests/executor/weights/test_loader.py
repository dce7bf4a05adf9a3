"""The HF-directory loader: layouts, dtypes, tied embeddings, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor.errors import ModelLoadError
from executor.weights.loader import load_model
from executor.weights.tiny import ensure_tiny_model
from tests.helpers.models import hf_config, write_model

CPU = torch.device("cpu")


def load(path: Path, dtype: torch.dtype = torch.float32, ctx: int = 128):  # type: ignore[no-untyped-def]
    return load_model(path, dtype, CPU, ctx)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_sharded_with_index_equals_single_file(tmp_path: Path) -> None:
    single = write_model(tmp_path / "one", "llama", seed=3)
    sharded = write_model(tmp_path / "many", "llama", seed=3, max_shard_bytes=40_000)
    assert len(list(sharded.glob("*.safetensors"))) > 2
    assert (sharded / "model.safetensors.index.json").is_file()
    assert same_weights(load(single)[0], load(sharded)[0])


def test_sharded_without_index(tmp_path: Path) -> None:
    sharded = write_model(tmp_path / "many", "qwen3", seed=1, max_shard_bytes=40_000)
    (sharded / "model.safetensors.index.json").unlink()
    single = write_model(tmp_path / "one", "qwen3", seed=1)
    assert same_weights(load(single)[0], load(sharded)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes(model_dirs: dict[str, Path], dtype: torch.dtype) -> None:
    model, _ = load(model_dirs["llama"], dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.rotary.cos.dtype == torch.float32  # RoPE tables stay float32


def test_tied_embeddings_share_storage(model_dirs: dict[str, Path]) -> None:
    model, spec = load(model_dirs["qwen2"])
    assert spec.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()


def test_fused_projections_hold_the_hf_shards(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["qwen2"]
    model, _spec = load(path)
    sd = load_file(str(path / "model.safetensors"))
    qkv = model.layers[1].self_attn.qkv_proj
    ref_w = torch.cat([sd[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    ref_b = torch.cat([sd[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv"])
    assert torch.equal(qkv.weight, ref_w) and torch.equal(qkv.bias, ref_b)


def test_tiny_is_written_once_and_loads(tmp_path: Path) -> None:
    path = ensure_tiny_model(tmp_path / "tiny")
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path / "tiny") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    _model, spec = load(path)
    assert spec.architecture == "LlamaForCausalLM" and spec.num_kv_heads < spec.num_heads


def test_unknown_architecture(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    path = Path(shutil.copytree(model_dirs["llama"], tmp_path / "m"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'GPT2LMHeadModel'.*Llama"):
        load(path)


def test_missing_directory_config_and_weights(tmp_path: Path, model_dirs: dict[str, Path]
                                              ) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load(tmp_path / "empty")
    path = Path(shutil.copytree(model_dirs["llama"], tmp_path / "m"))
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors"):
        load(path)


def test_missing_shard_listed_in_index(tmp_path: Path) -> None:
    path = write_model(tmp_path, "llama", max_shard_bytes=40_000)
    next(iter(sorted(path.glob("*.safetensors")))).unlink()
    with pytest.raises(ModelLoadError, match="missing shard"):
        load(path)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path: Path, model_dirs: dict[str, Path]
                                                ) -> None:
    path = Path(shutil.copytree(model_dirs["llama"], tmp_path / "m"))
    sd = load_file(str(path / "model.safetensors"))
    sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError,
                       match=r"model.layers.0.mlp.up_proj.weight.*expected \(128, 64\), got "
                             r"\(100, 64\)"):
        load(path)


def test_missing_and_unexpected_tensors(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    path = Path(shutil.copytree(model_dirs["llama"], tmp_path / "m"))
    sd = load_file(str(path / "model.safetensors"))
    del sd["model.layers.1.self_attn.k_proj.weight"]
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensors: layers.1.self_attn.qkv_proj"):
        load(path)
    sd["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    sd["model.extra.weight"] = torch.zeros(3)
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.extra\.weight'"):
        load(path)


def test_sliding_window_is_served_at_any_context(tmp_path: Path) -> None:
    """A window shorter than the context is served (the attention kernels read only the
    window), whatever max_context is."""
    cfg = hf_config("mistral")
    cfg.sliding_window = 64
    from executor.weights.random_weights import write_random_model

    path = write_random_model(tmp_path / "sw", cfg)
    _, spec = load(path, ctx=128)
    assert spec.layer_windows == (64, 64) and spec.sliding_window == 64


@pytest.mark.parametrize(("kind", "edit", "message"), [
    ("phi3", {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4,
                               "long_factor": [2.0] * 4},
              "original_max_position_embeddings": 256},
     r"Phi3ForCausalLM: unsupported RoPE type 'longrope'; supported: default, linear"),
    ("gemma3", {"use_bidirectional_attention": True},
     r"Gemma3ForCausalLM: use_bidirectional_attention=True is not supported"),
    ("llama", {"hidden_act": "gelu_pytorch_tanh"},
     r"LlamaForCausalLM: unsupported hidden activation 'gelu_pytorch_tanh'; supported: silu"),
    ("gemma2", {"hidden_activation": "relu"},
     r"Gemma2ForCausalLM: unsupported hidden activation 'relu'; supported: silu, gelu"),
    ("qwen2_window", {"layer_types": ["full_attention", "chunked_attention",
                                      "sliding_attention"]},
     r"Qwen2ForCausalLM: unsupported layer types chunked_attention; supported: "
     r"full_attention, sliding_attention"),
])
def test_unservable_features_refused_in_one_line(tmp_path: Path, kind: str,
                                                 edit: dict[str, object],
                                                 message: str) -> None:
    """What the loader cannot serve: the architecture, the feature and what is supported,
    one line (a ModelLoadError), before any weight is read."""
    from executor.weights.random_weights import write_random_model

    path = write_random_model(tmp_path / kind, hf_config(kind))
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(edit)
    if "rope_scaling" in edit:
        cfg.pop("rope_parameters", None)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message) as err:
        load(path)
    assert "\n" not in str(err.value)


def test_unsupported_rope_type(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    path = Path(shutil.copytree(model_dirs["llama"], tmp_path / "m"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                              "original_max_position_embeddings": 256}
    cfg.pop("rope_scaling", None)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported RoPE type 'yarn'"):
        load(path)
