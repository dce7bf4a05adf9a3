"""``--load-format random``: weights drawn on the device from config.json alone.

The drawn checkpoint must fill the model exactly as the same values written to
safetensors do (every tensor, fused q/k/v and gate/up in the right rows, for each
architecture), give every rank of a tensor-parallel group the rows of the TP = 1 tensor,
depend on the seed, and serve through the CLI from a directory holding only config.json.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from executor.config import ModelConfig
from executor.errors import ConfigError, ModelLoadError
from executor.weights.loader import load_model
from executor.weights.random_weights import RandomCheckpoint, random_recipe
from executor.weights.sharding import VocabShard, copy_shard
from service.cli import build_configs, build_parser
from tests.helpers.models import ARCHS, hf_config

CPU = torch.device("cpu")


def config_only(root: Path, kind: str) -> Path:
    path = root / kind
    hf_config(kind).save_pretrained(str(path))
    return path


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("kind", ARCHS)
def test_random_load_equals_the_same_values_read_from_safetensors(tmp_path: Path,
                                                                   kind: str) -> None:
    path = config_only(tmp_path, kind)
    drawn = RandomCheckpoint(hf_config(kind), seed=7, device=CPU)
    written = tmp_path / f"{kind}-written"
    shutil.copytree(path, written)
    save_file({name: drawn.draw(name) for name in drawn.keys()},  # noqa: SIM118
              str(written / "model.safetensors"))
    random_model, _ = load_model(path, torch.float32, CPU, 64, load_format="random", seed=7)
    read_model, _ = load_model(written, torch.float32, CPU, 64)
    assert same_weights(random_model, read_model)
    # The safetensors format still wants weights in that directory.
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(path, torch.float32, CPU, 64)


def test_the_seed_decides_the_values_and_the_recipe_their_spread(tmp_path: Path) -> None:
    path = config_only(tmp_path, "llama")
    a, _ = load_model(path, torch.float32, CPU, 64, load_format="random", seed=1)
    b, _ = load_model(path, torch.float32, CPU, 64, load_format="random", seed=1)
    c, _ = load_model(path, torch.float32, CPU, 64, load_format="random", seed=2)
    assert same_weights(a, b) and not same_weights(a, c)
    cfg = hf_config("llama")
    recipe = random_recipe(cfg)
    drawn = RandomCheckpoint(cfg, 0, CPU)
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.1.input_layernorm.weight"):
        values, want = drawn.draw(name), recipe[name]
        assert tuple(values.shape) == want.shape
        assert values.mean().item() == pytest.approx(want.mean, abs=4 * want.std
                                                     / math.sqrt(values.numel()))
        assert values.std().item() == pytest.approx(want.std, rel=0.2)


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_draws_its_rows_of_the_tp1_tensor(size: int) -> None:
    cfg = hf_config("llama")
    drawn = RandomCheckpoint(cfg, 3, CPU)
    cases = {"model.layers.0.self_attn.q_proj.weight": ("layers.0.self_attn.qkv_proj.weight", 0),
             "model.layers.0.mlp.down_proj.weight": ("layers.0.mlp.down_proj.weight", 1),
             "model.embed_tokens.weight": ("embed_tokens.weight", 0)}
    for hf_name, (name, dim) in cases.items():
        full = drawn.draw(hf_name)
        parts = []
        for rank in range(size):
            shape = list(full.shape)
            if name == "embed_tokens.weight":
                shape[0] = VocabShard.of(full.shape[0], rank, size).rows
            else:
                shape[dim] //= size
            target = torch.full(shape, float("nan"))
            copy_shard(drawn, hf_name, name, target, rank, size, "random weights")
            parts.append(target)
        joined = torch.cat(parts, dim=dim)
        assert torch.equal(joined[: full.shape[0]], full)


def test_the_flag_reaches_the_config_and_a_bad_value_is_refused() -> None:
    parser = build_parser()
    executor_config, _ = build_configs(parser.parse_args(
        ["serve", "--device", "cpu", "--load-format", "random"]), env={})
    assert executor_config.model.load_format == "random"
    assert build_configs(parser.parse_args(["serve", "--device", "cpu"]), env={}
                         )[0].model.load_format == "safetensors"
    assert build_configs(parser.parse_args(["serve", "--load-format", "dummy"]), env={}
                         )[0].model.load_format == "random"  # (vLLM's name)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--load-format", "pt"])
    with pytest.raises(ConfigError, match="load_format must be one of"):
        ModelConfig(load_format="pickle")  # type: ignore[arg-type]


def test_health_says_where_the_weights_came_from(tmp_path: Path) -> None:
    from executor.config import CacheConfig, ExecutorConfig
    from executor.executor import Executor
    from executor.weights.tiny import ensure_tiny_model
    from service.convert import health_response

    shutil.copy(ensure_tiny_model() / "config.json", tmp_path / "config.json")
    cache = CacheConfig(kv_tokens=256, max_sequences=2, max_context=64)
    for source, load_format in ((str(tmp_path), "random"), ("tiny", "safetensors")):
        ex = Executor(ExecutorConfig(model=ModelConfig(source=source,
                                                       load_format=load_format),  # type: ignore[arg-type]
                                     device="cpu", cache=cache))
        msg = health_response(1, ex.status(), "test", 0.0, 0)
        assert msg.model.load_format == load_format
