"""FP8 mixture-of-experts checkpoints loaded on CPU: the experts' weights and scales.

Qwen3-MoE-FP8 and Mixtral FP8 checkpoints quantize every expert's gate/up/down (w1/w3/w2)
with the projections' format; the experts load into ``Fp8Experts`` (their scales cut with
their rows and columns under tensor parallelism) and, on CPU, are dequantized once: the
model must hold exactly the float32 values of the FP8 weights times their scales (the
reference ``write_dequantized`` writes). Served tokens against Hugging Face, TP = 1 and 2:
tests/system/tp_serving/test_tp_fp8.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor.errors import ConfigError, ModelLoadError
from executor.quant import info_of, read_scheme
from executor.quant.experts import Fp8Experts, check_expert_blocks
from executor.quant.fp8 import dequantize, quantize_rows
from executor.quant.scheme import AT_LOAD
from executor.weights.loader import load_model
from tests.helpers.fp8_models import quantization_config, write_dequantized, write_fp8_model
from tests.helpers.moe_models import write_moe_model

CPU = torch.device("cpu")


@pytest.mark.parametrize(("moe", "fmt"), [("qwen3_moe", "block"), ("qwen3_moe", "channel"),
                                          ("qwen3_moe", "tensor"), ("mixtral", "block")])
def test_each_format_loads_the_experts_dequantized_values(moe: str, fmt: Any,
                                                          tmp_path: Path) -> None:
    fp8 = write_fp8_model(tmp_path / "fp8", fmt, moe=moe)
    model, _ = load_model(fp8, torch.float32, CPU, 128)
    ref, _ = load_model(write_dequantized(fp8, tmp_path / "ref"), torch.float32, CPU, 128)
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    experts = model.layers[0].mlp.experts  # type: ignore[index, union-attr]
    # dequantized: the unquantized experts module, which every path takes
    assert not isinstance(experts, Fp8Experts) and experts.gate_up_proj.dtype == torch.float32
    sd = load_file(str(fp8 / "model.safetensors"))
    assert sd["model.layers.0." + ("mlp.experts.1.down_proj.weight" if moe == "qwen3_moe"
                                   else "block_sparse_moe.experts.1.w2.weight")
              ].dtype == torch.float8_e4m3fn
    info = info_of(model, torch.float32)
    assert info.paths["experts"] == "dequantized at load to float32"


def test_experts_the_checkpoint_left_unquantized_load_as_they_are(tmp_path: Path) -> None:
    """An ``ignore`` pattern covering the experts: they are bf16 in the checkpoint, without
    scales; a scale of such an expert is refused, naming what takes FP8."""
    fp8 = write_fp8_model(tmp_path / "fp8", "channel", moe="qwen3_moe")
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head", "re:.*mlp\\.experts\\..*"]
    (fp8 / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(fp8 / "model.safetensors"))
    name = "model.layers.0.mlp.experts.2.up_proj."
    for key in [k for k in sd if ".mlp.experts." in k and k.endswith(".weight")]:
        scale = sd.pop(key.removesuffix("weight") + "weight_scale")
        sd[key] = dequantize(sd[key], scale, None, torch.bfloat16)
    save_file(sd, str(fp8 / "model.safetensors"))
    model, _ = load_model(fp8, torch.float32, CPU, 128)
    experts = model.layers[0].mlp.experts  # type: ignore[index, union-attr]
    assert torch.equal(experts.gate_up_proj[2, 256:], sd[name + "weight"].float())
    assert "experts" not in info_of(model, torch.float32).paths
    sd[name + "weight_scale"] = torch.ones(256, 1)
    save_file(sd, str(fp8 / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.0\.mlp\."
                       r"experts\.2\.up_proj\.weight_scale' .* the MoE experts do"):
        load_model(fp8, torch.float32, CPU, 128)


def test_quantization_flag_quantizes_the_experts_per_row(tmp_path: Path) -> None:
    path = write_moe_model(tmp_path, "mixtral")
    plain, _ = load_model(path, torch.float32, CPU, 64)
    model, _ = load_model(path, torch.float32, CPU, 64, quantization="fp8")
    assert info_of(model, torch.float32).paths["experts"] == "dequantized at load to float32"
    for param in ("gate_up_proj", "down_proj"):
        w = getattr(plain.layers[1].mlp.experts, param)  # type: ignore[index, union-attr]
        got = getattr(model.layers[1].mlp.experts, param)  # type: ignore[index, union-attr]
        for e in range(w.shape[0]):
            q, s = quantize_rows(w[e])
            assert torch.equal(got[e], dequantize(q, s, None, torch.float32))
        assert not torch.equal(got, w)


def test_expert_width_that_cuts_blocks_refused() -> None:
    scheme = read_scheme(quantization_config("block"), None)
    assert scheme is not None
    check_expert_blocks(scheme, 384, 1)
    check_expert_blocks(AT_LOAD, 96, 2)  # per-row scales: any width
    with pytest.raises(ConfigError) as err:
        check_expert_blocks(scheme, 192, 2)
    assert str(err.value) == (
        "--tensor-parallel-size 2 would cut the checkpoint's 128x128 FP8 blocks of the "
        "experts (per rank: expert width 192); sizes that keep whole blocks: 1, 3")


def test_fp8_experts_keep_their_dtypes_when_the_model_moves() -> None:
    scheme = read_scheme(quantization_config("block"), None)
    assert scheme is not None
    with torch.device("meta"):
        experts = Fp8Experts(4, 256, 384, scheme)
    experts.to(torch.bfloat16).to_empty(device=CPU)
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn
    assert experts.gate_up_scale.shape == (4, 4, 3) and experts.down_scale.shape == (4, 3, 2)
    assert experts.gate_up_scale.dtype == experts.down_scale.dtype == torch.float32
    assert set(experts.kernel_args()) == {"w13_scale", "w2_scale", "block"}
