"""Mixture-of-experts families against HF transformers on the same random weights (CPU,
float32), and how their checkpoints load.

Each tiny model (``tests/helpers/moe_models.py``: Qwen3-MoE with a dense layer and
renormalized top-2, Qwen3-MoE without renormalization, Mixtral) is written by transformers'
own ``save_pretrained``. Logits of a batched prefill, of chunked extends and of decode
steps within 1e-4 of HF's; the stacked experts layout loads to the same model; a tensor
parallel rank holds each expert's slice; what we cannot serve is refused in one line.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from executor.config import CacheConfig, ExecutorConfig, ModelConfig
from executor.errors import ConfigError, ModelLoadError
from executor.executor import Executor
from executor.model.moe import MoeCausalLM, SparseMoeBlock
from executor.weights import experts
from executor.weights.loader import load_hf_config, load_model
from executor.weights.sharding import check_divisible, local_spec
from tests.helpers.moe_models import MOE_KINDS, moe_config, write_moe_model

ATOL = 1e-4
PROMPTS = [[3, 17, 99, 4, 250, 8, 41], [5, 6], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {kind: write_moe_model(root, kind, seed=i) for i, kind in enumerate(MOE_KINDS)}


def _executor(path: Path) -> Executor:
    return Executor(ExecutorConfig(model=ModelConfig(source=str(path), dtype="float32"),
                                   device="cpu", cache=CacheConfig(kv_tokens=1024,
                                                                   max_sequences=8,
                                                                   max_context=128)))


def _hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                attn_implementation="eager").eval()


@torch.no_grad()
def _hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0].float()


def _extend(ex: Executor, chunks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    alloc = ex.kv.allocate([(sid, len(toks)) for sid, toks in chunks.items()])
    phase = "decode" if all(len(t) == 1 for t in chunks.values()) else "prefill"
    batch = ex.build_batch(phase, [t for toks in chunks.values() for t in toks], alloc,
                           list(range(len(chunks))) if phase == "decode" else [])
    batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens))
    logits = ex.forward_logits(batch)
    out, start = {}, 0
    for sid, toks in chunks.items():
        out[sid] = logits[start : start + len(toks)]
        start += len(toks)
    return out


@pytest.mark.parametrize("kind", list(MOE_KINDS))
def test_logits_match_hf(moe_dirs: dict[str, Path], kind: str) -> None:
    """Batched prefill, the same prompts as chunked extends, then 6 decode steps."""
    ex, hf = _executor(moe_dirs[kind]), _hf(moe_dirs[kind])
    assert isinstance(ex.model, MoeCausalLM)
    spec = ex.spec
    assert spec.moe is not None
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in ex.model.layers]
    assert sparse == [spec.moe.sparse(i) for i in range(spec.num_layers)]
    assert sparse == ([True, False, True] if kind == "qwen3_moe" else [True] * 3)
    got = _extend(ex, {f"p{i}": p for i, p in enumerate(PROMPTS)})
    for i, prompt in enumerate(PROMPTS):
        torch.testing.assert_close(got[f"p{i}"], _hf_logits(hf, prompt), atol=ATOL, rtol=ATOL)
    ex.release(list(got))
    seqs = {f"c{i}": p for i, p in enumerate(PROMPTS) if len(p) > 9}
    for a, b in itertools.pairwise((0, 2, 9, None)):
        got = _extend(ex, {sid: p[a:b] for sid, p in seqs.items()})
        for sid, p in seqs.items():
            torch.testing.assert_close(got[sid], _hf_logits(hf, p)[a:b], atol=ATOL, rtol=ATOL)
    seqs = {sid: list(p) for sid, p in seqs.items()}
    last = {sid: _hf_logits(hf, p)[-1] for sid, p in seqs.items()}
    for _ in range(6):
        step = {sid: [int(last[sid].argmax())] for sid in seqs}
        got = _extend(ex, step)
        for sid in seqs:
            seqs[sid] += step[sid]
            last[sid] = _hf_logits(hf, seqs[sid])[-1]
            torch.testing.assert_close(got[sid][0], last[sid], atol=ATOL, rtol=ATOL)
    ex.release(list(seqs))
    ex.kv.check_invariants()


def test_stacked_layout_loads_the_same_model(moe_dirs: dict[str, Path], tmp_path: Path
                                             ) -> None:
    """transformers' in-memory names (``mlp.experts.gate_up_proj`` (E, 2I, H),
    ``mlp.experts.down_proj`` (E, H, I)) written as is load to the same parameters."""
    path = moe_dirs["qwen3_moe"]
    state = {k: v.contiguous() for k, v in _hf(path).state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_text((path / "config.json").read_text())
    save_file(state, str(stacked / "model.safetensors"))
    a, _ = load_model(path, torch.float32, torch.device("cpu"), 64)
    b, _ = load_model(stacked, torch.float32, torch.device("cpu"), 64)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())  # type: ignore[attr-defined]
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def test_rank_holds_each_experts_slice(moe_dirs: dict[str, Path]) -> None:
    """Rank r of 2: rows r*I/2.. of each expert's gate and up, the same columns of down;
    the router and the dense layer's MLP as the Llama family splits it."""
    path = moe_dirs["mixtral"]
    spec = load_hf_config(path)
    assert spec.moe is not None
    half = local_spec(spec, 2)
    assert half.moe is not None and half.moe.intermediate_size == spec.moe.intermediate_size // 2
    i = half.moe.intermediate_size
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        w1 = f.get_tensor("model.layers.2.block_sparse_moe.experts.5.w1.weight")
        w3 = f.get_tensor("model.layers.2.block_sparse_moe.experts.5.w3.weight")
        w2 = f.get_tensor("model.layers.2.block_sparse_moe.experts.5.w2.weight")
        for rank in (0, 1):
            gate_up = torch.full((8, 2 * i, spec.hidden_size), float("nan"))
            down = torch.full((8, spec.hidden_size, i), float("nan"))
            for name, target in (("w1", gate_up), ("w3", gate_up), ("w2", down)):
                hf_name = f"model.layers.2.block_sparse_moe.experts.5.{name}.weight"
                src = experts.match(experts.canonical(hf_name))
                assert src is not None and src.expert == 5
                experts.copy_expert(f, hf_name, src, target, rank, 2, "file")
            rows = slice(rank * i, (rank + 1) * i)
            assert torch.equal(gate_up[5, :i], w1[rows]) and torch.equal(gate_up[5, i:], w3[rows])
            assert torch.equal(down[5], w2[:, rows])
            assert gate_up[4].isnan().all()  # other experts untouched


def test_tp_size_must_divide_the_expert_width() -> None:
    from executor.model.spec import spec_from_hf_config

    cfg = moe_config("qwen3_moe_raw")  # expert width 48, 4 heads, 2 KV heads, MLP 96
    spec = spec_from_hf_config(cfg)
    check_divisible(spec, 2)
    cfg.moe_intermediate_size = 45
    with pytest.raises(ConfigError, match=r"2 KV heads, expert width 45 and MLP width 96 \(KV "
                       r"heads are not replicated; expert parallelism is not supported\); "
                       r"sizes that work: 1$"):
        check_divisible(spec_from_hf_config(cfg), 2)


def _refused(tmp_path: Path, config: dict[str, object], match: str) -> None:
    path = tmp_path / "m"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=match) as info:
        load_hf_config(path)
    assert "\n" not in str(info.value)


def test_refusals_name_architecture_feature_and_what_is_supported(tmp_path: Path) -> None:
    base = moe_config("qwen3_moe").to_dict()
    _refused(tmp_path, {**moe_config("qwen3_moe").to_dict(), "model_type": "qwen2_moe",
                        "architectures": ["Qwen2MoeForCausalLM"],
                        "shared_expert_intermediate_size": 64},
             r"'Qwen2MoeForCausalLM': shared experts are not supported; mixture-of-experts "
             r"families supported: MixtralForCausalLM, Qwen3MoeForCausalLM")
    _refused(tmp_path, {**base, "num_experts_per_tok": 9},
             r"Qwen3MoeForCausalLM config has num_experts=8, num_experts_per_tok=9; "
             r"supported: 1 <= num_experts_per_tok <= num_experts")
