"""Random-weight shapes served by name (``--model gemma-3-12b --load-format random``), and
``--load-format random`` for the Gemma and Phi-3 families (their own tensor names)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from executor.weights.catalog import RANDOM_SHAPES, model_name, resolve_model_source
from executor.weights.loader import load_hf_config, load_model
from tests.helpers.models import write_model


def test_gemma_3_12b_shape_resolves_to_its_published_config(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    monkeypatch.setenv("MODEL_EXECUTOR_CACHE", str(tmp_path))
    assert "gemma-3-12b" in RANDOM_SHAPES
    path = resolve_model_source("gemma-3-12b")
    assert sorted(p.name for p in path.iterdir()) == ["RANDOM_SHAPE", "config.json"]
    assert resolve_model_source("gemma-3-12b") == path  # written once
    assert model_name("gemma-3-12b", path) == "gemma-3-12b"
    spec = load_hf_config(path)
    assert spec.architecture == "Gemma3ForCausalLM"
    assert (spec.num_layers, spec.hidden_size, spec.intermediate_size) == (48, 3840, 15360)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (16, 8, 256)
    # five sliding layers (window 1024, local base 10k) to each global one (1M, linear 8)
    assert spec.layer_windows == ((1024,) * 5 + (0,)) * 8
    assert spec.rope_local is not None and spec.rope_local.theta == 10000.0
    assert (spec.rope.theta, spec.rope.rope_type, spec.rope.factor) == (1e6, "linear", 8.0)
    assert spec.attn_scale == 256**-0.5 and spec.tie_word_embeddings
    assert spec.activation == "gelu_pytorch_tanh" and not spec.final_softcap


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "phi3"])
def test_random_load_format_draws_every_tensor_of_the_family(tmp_path: Path,
                                                             kind: str) -> None:
    """Only config.json: every parameter is drawn (the loader's every-tensor-once check
    passes with the family's names), Gemma's norms around 0 (their scale is 1 + w)."""
    src = write_model(tmp_path, kind)
    cfg_only = tmp_path / f"{kind}-config"
    cfg_only.mkdir()
    shutil.copy(src / "config.json", cfg_only / "config.json")
    model, spec = load_model(cfg_only, torch.float32, torch.device("cpu"), 64,
                             load_format="random", seed=1)
    params = dict(model.named_parameters())  # type: ignore[attr-defined]
    norm = params["layers.0.input_layernorm.weight"]
    if spec.features.gemma_norms:
        assert abs(float(norm.mean())) < 0.5
    else:
        assert abs(float(norm.mean()) - 1.0) < 0.5
