"""Mixture-of-experts models through the real gRPC server (CPU, float32): Qwen3-MoE (a
dense layer, top-k renormalized or not) and Mixtral written by transformers'
``save_pretrained``. Three prompts, each prefilled in two chunks, then 32 greedy steps in
batched Decode calls: tokens identical to HF ``generate`` and every step's log-probabilities
within 1e-4 of HF's last-position logits; Health reports the experts."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from safetensors.torch import load_file, save_file

from executor.config import CacheConfig, ExecutorConfig, ModelConfig
from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.helpers.moe_models import (
    MOE_KINDS,
    PROMPTS,
    STEPS,
    References,
    assert_matches_hf,
    moe_config,
    served_greedy,
)
from tests.service.harness import ServerHarness


@pytest.fixture(scope="module", params=list(MOE_KINDS))
def served(request: pytest.FixtureRequest, moe_references: References
           ) -> Iterator[tuple[str, Path, ServerHarness]]:
    kind = request.param
    path, _ = moe_references.get(kind, 3)
    config = ExecutorConfig(model=ModelConfig(source=str(path), dtype="float32"), device="cpu",
                            cache=CacheConfig(kv_tokens=512, max_sequences=4, max_context=128))
    harness = ServerHarness(config)
    try:
        harness.wait_ready()
        yield kind, path, harness
    finally:
        harness.close()


def test_greedy_tokens_and_logprobs_equal_hf(served: tuple[str, Path, ServerHarness],
                                             moe_references: References) -> None:
    kind, _, harness = served
    got = served_greedy(harness.stub, PROMPTS, STEPS, tag=kind)
    assert_matches_hf(got, moe_references.get(kind, 3)[1])
    assert harness.kv().free_tokens == harness.kv().total_tokens


def test_health_reports_the_experts(served: tuple[str, Path, ServerHarness]) -> None:
    kind, _, harness = served
    model = harness.stub.Health(pb.HealthRequest(), timeout=10).model
    cfg = moe_config(kind)
    assert model.architecture == cfg.architectures[0]
    assert model.num_experts == (4 if kind == "qwen3_moe_raw" else 8)
    assert model.num_experts_per_token == 2


def test_weights_update_in_place_from_a_directory(
        served: tuple[str, Path, ServerHarness], moe_references: References,
        tmp_path: Path) -> None:
    """UpdateWeights with other random experts, routers and attention (the published
    per-expert names): greedy tokens then equal HF on the new weights; an expert of the
    wrong shape is refused naming it and changes nothing; the original weights restore."""
    kind, path, harness = served
    new, want = moe_references.get(kind, 11)
    bad = tmp_path / "bad"
    shutil.copytree(new, bad)
    shard = next(bad.glob("*.safetensors"))
    tensors = load_file(shard)
    name = next(n for n in sorted(tensors) if ".experts.1." in n)
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(grpc.RpcError) as err:
        harness.stub.UpdateWeights(pb.UpdateWeightsRequest(weight_version="bad", path=str(bad)),
                                   timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert name in (err.value.details() or "")
    done = harness.stub.UpdateWeights(
        pb.UpdateWeightsRequest(weight_version="v2", path=str(new)), timeout=60)
    assert done.weight_version == "v2" and done.tensors_updated > 0
    try:
        got = served_greedy(harness.stub, PROMPTS, STEPS, tag=f"{kind}-v2")
        assert_matches_hf(got, want)
    finally:
        harness.stub.UpdateWeights(pb.UpdateWeightsRequest(weight_version="v1", path=str(path)),
                                   timeout=60)
    assert harness.stub.Health(pb.HealthRequest(), timeout=10).model.weight_version == "v1"


def test_dense_model_reports_no_experts() -> None:
    harness = ServerHarness()
    try:
        harness.wait_ready()
        model = harness.stub.Health(pb.HealthRequest(), timeout=10).model
        assert (model.num_experts, model.num_experts_per_token) == (0, 0)
    finally:
        harness.close()
