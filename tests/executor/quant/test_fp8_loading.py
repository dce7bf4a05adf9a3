"""FP8 formats read and loaded on CPU: the scheme each config gives, every refusal in one
line, each format's weights equal to its dequantized values, ``--quantization fp8``.

The loaded model must hold exactly the float32 values of the FP8 weights times their
scales (the reference checkpoint ``write_dequantized`` writes); served tokens against Hugging
Face on those values: tests/system/tp_serving/test_tp_fp8.py.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from executor.config import CacheConfig, ExecutorConfig, ModelConfig
from executor.errors import ConfigError, ModelLoadError, StateConflict
from executor.executor import Executor
from executor.quant import Fp8Linear, info_of, read_scheme
from executor.quant.fp8 import dequantize, quantize_rows
from executor.quant.install import check_blocks
from executor.quant.scheme import AT_LOAD
from executor.weights.loader import load_hf_config, load_model
from executor.weights.sharding import local_spec
from executor.weights.tiny import ensure_tiny_model
from tests.helpers.fp8_models import (
    quantization_config,
    write_dequantized,
    write_fp8_model,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize(("fmt", "kind", "name", "static"), [
    ("block", "fp8_block", "fp8_block_128x128", False),
    ("channel", "fp8_per_channel", "fp8_per_channel_dynamic", False),
    ("tensor", "fp8_per_tensor", "fp8_per_tensor", True),
    ("modelopt", "fp8_per_tensor", "fp8_per_tensor", True),
    ("fp8_tensor", "fp8_per_tensor", "fp8_per_tensor", True),
])
def test_scheme_of_each_format(fmt: Any, kind: str, name: str, static: bool) -> None:
    scheme = read_scheme(quantization_config(fmt), None)
    assert scheme is not None
    assert (scheme.kind, scheme.name, scheme.static_input) == (kind, name, static)
    assert scheme.scale_name == ("weight_scale_inv" if fmt == "block" else "weight_scale")
    assert read_scheme(None, None) is None
    assert read_scheme(None, "fp8") == AT_LOAD


def _ct(weights: dict[str, Any], acts: dict[str, Any] | None = None,
        **top: Any) -> dict[str, Any]:
    w = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
         "dynamic": False, **weights}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"g": {"weights": w, "input_activations": acts}}, **top}


@pytest.mark.parametrize(("qcfg", "names"), [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({"quant_method": "gptq"}, "quant_method 'gptq'"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size [64, 64]"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_algo 'NVFP4'"),
    (_ct({"type": "int"}), "compressed-tensors weights"),
    (_ct({"strategy": "group", "group_size": 128}), "weight strategy 'group'"),
    (_ct({}, format="pack-quantized"), "format 'pack-quantized'"),
    (_ct({}, {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": False}),
     "static input_activations strategy 'token'"),
])
def test_unservable_formats_refused_in_one_line(qcfg: dict[str, Any], names: str) -> None:
    with pytest.raises(ModelLoadError) as err:
        read_scheme(qcfg, None)
    msg = str(err.value)
    assert "\n" not in msg and names in msg and "; supported: " in msg


def test_quantization_flag_on_a_quantized_checkpoint_refused() -> None:
    with pytest.raises(ModelLoadError, match=r"already quantized .*drop --quantization"):
        read_scheme(quantization_config("block"), "fp8")
    with pytest.raises(ModelLoadError, match="--quantization 'int8' is not supported"):
        read_scheme(None, "int8")
    with pytest.raises(ConfigError, match="quantization must be one of"):
        ModelConfig(quantization="int8")  # type: ignore[arg-type]


def test_unknown_method_refused_before_any_weight_is_read(tmp_path: Path) -> None:
    """Before: a quantized checkpoint's FP8 weights were cast to the serving dtype without
    their scales until the first scale tensor came up as "unexpected"; now the config is
    refused before the model is built."""
    path = write_fp8_model(tmp_path / "m", "block")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"^unsupported quantization: quant_method "
                       r"'bitsandbytes'; supported: "):
        load_model(path, torch.float32, CPU, 128)


@pytest.mark.parametrize("fmt", ["block", "channel", "tensor", "modelopt", "fp8_tensor"])
def test_each_format_loads_its_dequantized_values(fmt: Any, tmp_path: Path) -> None:
    fp8 = write_fp8_model(tmp_path / "fp8", fmt)
    model, _ = load_model(fp8, torch.float32, CPU, 128)
    ref, _ = load_model(write_dequantized(fp8, tmp_path / "ref"), torch.float32, CPU, 128)
    assert isinstance(model, nn.Module) and isinstance(ref, nn.Module)
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # CPU has no FP8: plain Linear projections (the fast paths take them), said in Health
    assert type(model.layers[0].mlp.down_proj) is nn.Linear  # type: ignore[index, union-attr]
    info = info_of(model, torch.float32)
    assert info.weight_format == "float32" and info.dequantized
    assert set(info.paths) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def test_modelopt_hf_quant_config_and_kv_scales(tmp_path: Path) -> None:
    """ModelOpt's older layout: the config in hf_quant_config.json, KV-cache scales among
    the tensors (read past: the KV cache stays in the serving dtype)."""
    fp8 = write_fp8_model(tmp_path / "fp8", "modelopt")
    cfg = json.loads((fp8 / "config.json").read_text())
    del cfg["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(cfg))
    (fp8 / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"},
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                         "exclude_modules": ["lm_head"]}}))
    sd = load_file(str(fp8 / "model.safetensors"))
    sd["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(1.0)
    sd["model.layers.0.self_attn.v_proj.v_scale"] = torch.tensor(1.0)
    save_file(sd, str(fp8 / "model.safetensors"))
    model, _ = load_model(fp8, torch.float32, CPU, 128)
    assert info_of(model, torch.float32).quantization == "fp8_per_tensor"


def test_ignored_modules_stay_unquantized(tmp_path: Path) -> None:
    """compressed-tensors ``ignore`` (a ``re:`` pattern here): those projections are bf16
    in the checkpoint, with no scales, and load as plain weights."""
    fp8 = write_fp8_model(tmp_path / "fp8", "channel")
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj"]
    (fp8 / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(fp8 / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj."
    sd[name + "weight"] = dequantize(sd[name + "weight"], sd.pop(name + "weight_scale"), None,
                                     torch.bfloat16)
    save_file(sd, str(fp8 / "model.safetensors"))
    model, _ = load_model(fp8, torch.float32, CPU, 128)
    assert torch.equal(model.layers[1].mlp.down_proj.weight,  # type: ignore[index, union-attr]
                       sd[name + "weight"].float())
    # q/k/v are fused: quantized in part is refused
    cfg["quantization_config"]["ignore"] = ["model.layers.0.self_attn.k_proj"]
    (fp8 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="quantized only in part"):
        load_model(fp8, torch.float32, CPU, 128)


def test_tensor_parallel_size_that_cuts_blocks_refused(tmp_path: Path) -> None:
    scheme = read_scheme(quantization_config("block"), None)
    assert scheme is not None
    spec = load_hf_config(write_fp8_model(tmp_path / "m", "block"))  # kv 256, gate/up 512
    check_blocks(scheme, local_spec(spec, 2), 2)  # 128-row slices: fine
    narrow = dataclasses.replace(spec, num_heads=8, num_kv_heads=2, head_dim=64)
    check_blocks(scheme, narrow, 1)  # k/v 128 rows at TP = 1
    with pytest.raises(ConfigError) as err:  # 64 at TP = 2
        check_blocks(scheme, local_spec(narrow, 2), 2)
    assert str(err.value) == (
        "--tensor-parallel-size 2 would cut the checkpoint's 128x128 FP8 weight blocks (per "
        "rank: k/v 64 rows); sizes that keep whole blocks: 1")


def test_random_weights_with_a_quantized_config_refused(tmp_path: Path) -> None:
    fp8 = write_fp8_model(tmp_path / "fp8", "block")
    with pytest.raises(ModelLoadError, match="--load-format random draws unquantized"):
        load_model(fp8, torch.float32, CPU, 128, load_format="random")


def test_fp8_layer_keeps_its_dtypes_when_the_model_moves() -> None:
    with torch.device("meta"):
        layer = Fp8Linear(256, 128, AT_LOAD, (128,), 0, bias=True)
    layer.to(torch.bfloat16).to_empty(device=CPU)
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert layer.scales.dtype == torch.float32 and layer.scales.shape == (128, 1)
    assert layer.bias is not None and layer.bias.dtype == torch.bfloat16


def test_quantization_flag_quantizes_at_load_and_health_says_so(tmp_path: Path) -> None:
    tiny = ensure_tiny_model()
    cfg = ExecutorConfig(model=ModelConfig(source=str(tiny), quantization="fp8"),
                         cache=CacheConfig(kv_tokens=256, max_sequences=2, max_context=64))
    ex = Executor(cfg)
    try:
        info = ex.status().model
        assert (info.quantization, info.weight_format) == ("fp8_at_load", "float32")
        plain, _ = load_model(tiny, torch.float32, CPU, 64)
        for name in ("qkv_proj", "o_proj"):
            w = getattr(plain.layers[0].self_attn, name).weight  # type: ignore[index, union-attr]
            got = getattr(ex.model.layers[0].self_attn, name).weight  # type: ignore[attr-defined]
            q, s = quantize_rows(w)
            assert torch.equal(got, dequantize(q, s, None, torch.float32))
            assert not torch.equal(got, w)
        # An in-place update does not cover FP8 weights yet: refused, nothing applied.
        with pytest.raises(StateConflict, match=r"FP8 weights \(fp8_at_load\)"):
            ex.weights.update_from_disk("v2", str(tiny))
        assert ex.status().model.weight_version == "initial"
        # So Sleep may not discard them (nothing could refill them): refused, awake or
        # already asleep with a host backup, and the backup still wakes.
        qkv = ex.model.layers[0].self_attn.qkv_proj.weight  # type: ignore[attr-defined]
        kept = qkv.clone()
        for asleep in (False, True):
            with pytest.raises(StateConflict, match="Sleep would discard FP8 weights") as err:
                ex.weights.sleep(["weights"], True, False)
            assert err.value.reason == "UPDATE_UNSUPPORTED"
            assert ex.weights.sleeping == (("weights",) if asleep else ())
            assert not ex.status().model.weights_discarded
            if not asleep:
                ex.weights.sleep(["weights"], False, False)
        ex.weights.wake(["weights"])
        assert torch.equal(qkv, kept) and ex.weights.sleeping == ()
    finally:
        ex.close()
    ex = Executor(dataclasses.replace(cfg, model=ModelConfig(source=str(tiny))))
    try:
        assert (ex.status().model.quantization, ex.status().model.weight_format) == \
            ("", "float32")
    finally:
        ex.close()
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_scales_of_a_module_without_fp8_name_it(tmp_path: Path) -> None:
    """A quantized LM head: refused naming what takes FP8 here."""
    fp8 = write_fp8_model(tmp_path / "fp8", "channel")
    sd = load_file(str(fp8 / "model.safetensors"))
    sd["lm_head.weight_scale"] = torch.ones(512, 1)
    save_file(sd, str(fp8 / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'lm_head.weight_scale' .* "
                       r"quantized a module that takes no FP8 here: .*the LM head do not"):
        load_model(fp8, torch.float32, CPU, 128)
