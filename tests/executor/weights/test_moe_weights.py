"""Mixture-of-experts weights drawn at random (``--load-format random``) and the
``qwen3-30b-a3b`` random shape of the catalog.

The drawn checkpoint fills the stacked experts exactly as the same values written to
safetensors (the per-expert layout) do, and a tensor-parallel rank gets each expert's
rows and columns of the TP = 1 tensors; the catalog's shape is the published config, and
asking for its weights is refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from executor.errors import ModelLoadError
from executor.weights.catalog import RANDOM_SHAPES, model_name, resolve_model_source
from executor.weights.experts import copy_expert, match
from executor.weights.loader import load_hf_config, load_model
from executor.weights.random_weights import RandomCheckpoint
from tests.helpers.moe_models import moe_config

CPU = torch.device("cpu")


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_random_load_equals_the_same_values_from_safetensors(kind: str, tmp_path: Path
                                                             ) -> None:
    cfg = moe_config(kind)
    cfg.save_pretrained(str(tmp_path / "cfg"))
    drawn, _ = load_model(tmp_path / "cfg", torch.float32, CPU, 64, load_format="random",
                          seed=4)
    ckpt = RandomCheckpoint(cfg, 4, CPU)
    names = ckpt.keys()
    assert any(".experts.7." in n for n in names)  # the per-expert layout
    written = tmp_path / "written"
    cfg.save_pretrained(str(written))
    save_file({n: ckpt.draw(n) for n in names}, str(written / "model.safetensors"))
    loaded, _ = load_model(written, torch.float32, CPU, 64)
    a, b = drawn.state_dict(), loaded.state_dict()  # type: ignore[attr-defined]
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_random_rank_slices_are_the_tp1_rows() -> None:
    cfg = moe_config("qwen3_moe")
    ckpt = RandomCheckpoint(cfg, 0, CPU)
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    src = match(name)
    assert src is not None
    full = ckpt.draw(name)  # (I, H)
    i = full.shape[0] // 2
    for rank in (0, 1):
        target = torch.zeros(8, 2 * i, cfg.hidden_size)
        copy_expert(ckpt, name, src, target, rank, 2, "random weights")
        assert torch.equal(target[3, i:], full[rank * i : (rank + 1) * i])
        assert not target[3, :i].any()  # the gate half is another tensor's


def test_qwen3_30b_a3b_shape() -> None:
    path = resolve_model_source("qwen3-30b-a3b")
    assert path == resolve_model_source("qwen3-30b-a3b")  # written once
    assert model_name("qwen3-30b-a3b", path) == "qwen3-30b-a3b"
    spec = load_hf_config(path)
    assert spec.architecture == "Qwen3MoeForCausalLM" and spec.moe is not None
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads,
            spec.head_dim, spec.vocab_size) == (48, 2048, 32, 4, 128, 151936)
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.intermediate_size) == (128, 8, 768)
    assert spec.moe.renormalize and not spec.moe.dense_layers and spec.features.qk_norm
    # the published sizes: 30.5B parameters, 3.3B active per token
    assert round(spec.num_params() / 1e9, 1) == 30.5
    assert round(spec.num_params(active=True) / 1e9, 1) == 3.4
    assert RANDOM_SHAPES["qwen3-30b-a3b"][2]["max_position_embeddings"] == spec.max_position
    with pytest.raises(ModelLoadError, match=r"^qwen3-30b-a3b: a published config without "
                                             r"weights; serve it with --load-format random$"):
        load_model(path, torch.float32, torch.device("meta"), 64)
