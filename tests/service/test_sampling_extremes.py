"""Issue 19, defect 5: a tiny positive temperature returned token 0 instead of the top token
(float32 overflow in the scaling); below 1e-5 it is greedy now."""

from __future__ import annotations

import pytest

from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.service.harness import ServerHarness

PROMPT = [11, 42, 7, 99, 3]


def _first_token(server: ServerHarness, seq_id: str, sampling: pb.SamplingParams
                 ) -> pb.ItemOutput:
    request = pb.PrefillRequest(items=[pb.PrefillItem(seq_id=seq_id, token_ids=PROMPT,
                                                      sample=True, sampling=sampling)])
    try:
        return server.stub.Prefill(request, timeout=30).outputs[0]
    finally:
        server.stub.Release(pb.ReleaseRequest(seq_ids=[seq_id]), timeout=10)


@pytest.mark.parametrize("temperature", [1e-45, 3e-39, 2.9e-38, 1e-20])
def test_tiny_temperature_returns_the_greedy_token(server: ServerHarness,
                                                   temperature: float) -> None:
    greedy = _first_token(server, "greedy", pb.SamplingParams(logprobs=True))
    tiny = _first_token(server, "tiny", pb.SamplingParams(temperature=temperature, top_k=5,
                                                          seed=3, logprobs=True))
    assert tiny.token_id == greedy.token_id
    assert tiny.logprob == pytest.approx(greedy.logprob)
