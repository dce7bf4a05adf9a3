"""Mixture-of-experts models under ``--tensor-parallel-size 2`` on CPU (gloo, one process
per rank), through ``serve`` and gRPC: each rank holds half of every expert's width, the
router runs replicated, the experts' partial sums are all-reduced. Qwen3-MoE (with a dense
layer) and Mixtral: greedy tokens identical to HF ``generate`` over chunked prefill and 32
decode steps, log-probabilities within 1e-4 of HF's; then the same after UpdateWeights to
other random weights (each rank keeping its slice of every expert)."""

from __future__ import annotations

import pytest

from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.helpers.moe_models import (
    PROMPTS,
    STEPS,
    References,
    assert_matches_hf,
    served_greedy,
)
from tests.helpers.serving import ServeProcess


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_tp2_greedy_equals_hf(kind: str, moe_references: References) -> None:
    # the TP = 1 serving test's weights and HF references (tests/service/test_moe_serving.py)
    path, want = moe_references.get(kind, 3)
    new, want_updated = moe_references.get(kind, 11)
    server = ServeProcess(["--model", str(path), "--kv-tokens", "512", "--max-context", "128",
                           "--max-sequences", "4", "--drain-delay", "0",
                           "--tensor-parallel-size", "2"])
    try:
        server.wait_ready()
        model = server.stub.Health(pb.HealthRequest(), timeout=10).model
        assert model.tensor_parallel_size == 2 and model.num_experts == 8
        assert model.num_experts_per_token == 2
        got = served_greedy(server.stub, PROMPTS, STEPS, tag=kind)
        # UpdateWeights in place: each rank copies its half of every expert's width
        server.stub.UpdateWeights(pb.UpdateWeightsRequest(weight_version="v2", path=str(new)),
                                  timeout=60)
        updated = served_greedy(server.stub, PROMPTS, STEPS, tag=f"{kind}-v2")
    finally:
        assert server.stop() == 0, "".join(server.lines)[-3000:]
    assert_matches_hf(got, want)
    assert_matches_hf(updated, want_updated)
