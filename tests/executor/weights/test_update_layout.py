"""The pure parts of in-place updates: the bucket plan both sides compute, packing and
unpacking a bucket, and ``WeightLayout.check`` against a served model (one rank and the
full shapes a tensor-parallel rank expects), naming the first offending tensor."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from executor.errors import InvalidRequest
from executor.model.base import model_factory
from executor.model.spec import spec_from_hf_config
from executor.weights.random_weights import random_state_dict
from executor.weights.sharding import local_spec
from executor.weights.tiny import tiny_config
from executor.weights.transfer import ALIGN, pack_bucket, plan_buckets, unpack
from executor.weights.update import TensorMeta, WeightLayout


def metas_of(sd: dict[str, torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in sd.items()]


def test_buckets_are_aligned_bounded_and_round_trip() -> None:
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.float64),
               torch.randn(100).to(torch.bfloat16), torch.randn(40, 40)]
    metas = [TensorMeta(f"t{i}", tuple(t.shape), t.dtype) for i, t in enumerate(tensors)]
    buckets = plan_buckets(metas, 1024)
    assert [i for b in buckets for i, _ in b.entries] == [0, 1, 2, 3]  # manifest order
    assert all(off % ALIGN == 0 for b in buckets for _, off in b.entries)
    # 40 x 40 float32 (6400 bytes) is over the limit: a bucket of its own
    assert [b.nbytes <= 1024 for b in buckets] == [True, False]
    for b in buckets:
        flat = torch.zeros(b.nbytes, dtype=torch.uint8)
        pack_bucket(b, tensors, flat)
        for name, view in unpack(b, metas, flat).items():
            assert torch.equal(view, tensors[int(name[1:])])


def served(tp_size: int = 1) -> tuple[torch.nn.Module, dict[str, torch.Tensor], object]:
    cfg = tiny_config()
    spec = local_spec(spec_from_hf_config(cfg), tp_size)
    with torch.device("meta"):
        model = model_factory(spec.architecture)(spec, 64)
    model.materialize(torch.float32, torch.device("cpu"))
    return model, random_state_dict(cfg, 0, torch.float32), spec


def test_the_check_names_the_first_offending_tensor() -> None:
    model, sd, spec = served()
    layout = WeightLayout(model, spec, 1)  # type: ignore[arg-type]
    layout.check(metas_of(sd), "path")  # the checkpoint itself passes
    metas = metas_of(sd)
    cases = {
        "shape": [dataclasses.replace(m, shape=(1,)) if m.name.endswith("o_proj.weight")
                  else m for m in metas],
        "dtype": [dataclasses.replace(m, dtype=torch.bfloat16) if "norm" in m.name else m
                  for m in metas],
        "unknown": [*metas, TensorMeta("model.layers.9.mlp.up_proj.weight", (4,),
                                       torch.float32)],
        "missing": [m for m in metas if m.name != "lm_head.weight"],
        "twice": [*metas, metas[3]],
    }
    expected = {"shape": "'model.layers.0.self_attn.o_proj.weight' has shape [1]",
                "dtype": "is bfloat16; the served checkpoint's is float32",
                "unknown": "unknown tensor 'model.layers.9.mlp.up_proj.weight'",
                "missing": "tensor 'lm_head.weight' is missing",
                "twice": "is given twice"}
    for kind, manifest in cases.items():
        with pytest.raises(InvalidRequest) as err:
            layout.check(manifest, "distributed.tensors")
        assert expected[kind] in str(err.value), (kind, str(err.value))


def test_a_tensor_parallel_rank_expects_the_full_shapes() -> None:
    model, sd, spec = served(tp_size=2)
    layout = WeightLayout(model, spec, 2)  # type: ignore[arg-type]
    layout.check(metas_of(sd), "path")  # whole tensors, although the rank holds halves
    down = "model.layers.0.mlp.down_proj.weight"
    half = [dataclasses.replace(m, shape=tuple(model.get_parameter(
        "layers.0.mlp.down_proj.weight").shape)) if m.name == down else m for m in metas_of(sd)]
    with pytest.raises(InvalidRequest, match="down_proj"):
        layout.check(half, "path")
