"""A scheduler-like session over a real channel: several sequences, chunked prefill,
prefill and decode calls interleaved, a release mid-way. Greedy tokens must equal HF
transformers ``generate`` on the same tiny weights."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from executor.weights.tiny import ensure_tiny_model
from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.service.harness import ServerHarness

PROMPT_LENGTHS = {"A": 20, "B": 45, "C": 7, "D": 30}
NEW_TOKENS = {"A": 12, "B": 10, "C": 6, "D": 8}


def hf_greedy(prompt: list[int], new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model: Any = hf_greedy.__dict__.get("model")
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32)
        model.generation_config.eos_token_id = None  # never stop early
        hf_greedy.__dict__["model"] = model.eval()
    ids = torch.tensor([prompt])
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    generated: list[int] = out[0, len(prompt):].tolist()
    assert len(generated) == new_tokens
    return generated


class Scheduler:
    """Just enough of a scheduler: tracks prompts, generated tokens and lengths."""

    def __init__(self, harness: ServerHarness) -> None:
        self.stub = harness.stub
        rng = random.Random(7)
        self.prompts = {s: [rng.randrange(3, 512) for _ in range(n)]
                        for s, n in PROMPT_LENGTHS.items()}
        self.fed = dict.fromkeys(self.prompts, 0)  # prompt tokens prefilled so far
        self.out: dict[str, list[int]] = {s: [] for s in self.prompts}

    def prefill(self, chunks: dict[str, int]) -> pb.PrefillResponse:
        items = []
        for seq, n in chunks.items():
            start = self.fed[seq]
            self.fed[seq] += n
            last = self.fed[seq] == len(self.prompts[seq])
            items.append(pb.PrefillItem(seq_id=seq, token_ids=self.prompts[seq][start:start + n],
                                        sample=last))
        # a request_id names one call (a retry with it gets the same response)
        request_id = f"scenario-{sum(self.fed.values())}"
        response = self.stub.Prefill(pb.PrefillRequest(request_id=request_id, items=items),
                                     timeout=30)
        assert response.step.phase == pb.PHASE_PREFILL
        assert response.execute_ms >= response.step.forward_ms > 0 and response.queue_ms >= 0
        assert response.step.num_tokens == sum(chunks.values())
        for seq, output in zip(chunks, response.outputs, strict=True):
            assert output.seq_id == seq and output.seq_len == self.fed[seq]
            if self.fed[seq] == len(self.prompts[seq]):
                self.out[seq].append(output.token_id)
            else:
                assert not output.HasField("token_id")
        return response

    def decode(self, seqs: list[str]) -> None:
        items = [pb.DecodeItem(seq_id=s, token_id=self.out[s][-1]) for s in seqs]
        response = self.stub.Decode(pb.DecodeRequest(items=items), timeout=30)
        assert response.step.phase == pb.PHASE_DECODE and response.step.num_tokens == len(seqs)
        assert response.step.path == pb.PATH_EAGER and response.step.fallback_reason
        for seq, output in zip(seqs, response.outputs, strict=True):
            assert output.seq_id == seq
            assert output.seq_len == len(self.prompts[seq]) + len(self.out[seq])
            self.out[seq].append(output.token_id)

    def decode_until_done(self, seqs: list[str], steps: int) -> None:
        for _ in range(steps):
            active = [s for s in seqs if len(self.out[s]) < NEW_TOKENS[s]]
            if active:
                self.decode(active)


def test_scheduler_scenario_matches_hf_generate(server: ServerHarness) -> None:
    baseline = server.kv()
    sched = Scheduler(server)
    sched.prefill({"A": 20, "B": 16, "C": 7})  # B is chunked: no token yet
    sched.prefill({"B": 16})
    sched.prefill({"B": 13})
    sched.decode_until_done(["A", "B", "C"], 3)
    sched.prefill({"D": 10})  # D joins while the others are mid-generation
    sched.decode_until_done(["A", "B", "C"], 1)
    sched.prefill({"D": 20})
    sched.decode_until_done(["A", "B", "C", "D"], 2)
    assert len(sched.out["C"]) == NEW_TOKENS["C"]
    released = server.stub.Release(pb.ReleaseRequest(seq_ids=["C"]), timeout=10)
    assert released.released == 1
    sched.decode_until_done(["A", "B", "D"], 12)

    kv = server.kv()
    held = sum(len(sched.prompts[s]) + len(sched.out[s]) - 1 for s in "ABD")
    assert kv.active_sequences == baseline.active_sequences + 3
    assert kv.free_tokens == baseline.free_tokens - held

    for seq in PROMPT_LENGTHS:
        assert len(sched.out[seq]) == NEW_TOKENS[seq], seq
        assert sched.out[seq] == hf_greedy(sched.prompts[seq], NEW_TOKENS[seq]), seq

    released = server.stub.Release(pb.ReleaseRequest(seq_ids=["A", "B", "C", "D"]), timeout=10)
    assert released.released == 3 and list(released.unknown_seq_ids) == ["C"]
    assert server.kv() == baseline


@pytest.mark.parametrize("logprobs", [0, 3])
def test_logprobs_ride_along(server: ServerHarness, logprobs: int) -> None:
    sampling = pb.SamplingParams(logprobs=True, top_logprobs=logprobs)
    response = server.stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(
        seq_id="lp", token_ids=[5, 6, 7], sample=True, sampling=sampling)]), timeout=10)
    server.stub.Release(pb.ReleaseRequest(seq_ids=["lp"]), timeout=10)
    output = response.outputs[0]
    assert output.HasField("logprob") and output.logprob <= 0
    assert len(output.top_logprobs) == logprobs
    if logprobs:  # greedy: the sampled token is the most likely one
        assert output.top_logprobs[0].token_id == output.token_id
