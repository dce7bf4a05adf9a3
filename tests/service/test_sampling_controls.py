"""Token masks, logit bias, processed logprobs, candidate-token logprobs and hidden states
over a real gRPC server (random weights, CPU), against HF transformers (float32) on the
same weights and a float64 torch reference of the sampling transform."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from executor.config import CacheConfig, ExecutorConfig, ModelConfig
from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.helpers.models import write_model
from tests.service.harness import ServerHarness

V = 256  # the test checkpoints' vocabulary
TOL = 1e-4


def bitmask(ids: list[int] | range, vocab: int = V) -> bytes:
    bits = np.zeros(((vocab + 31) // 32) * 32, dtype=np.uint8)
    bits[list(ids)] = 1
    return np.packbits(bits, bitorder="little").tobytes()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("ctl"), "llama", seed=5)


@pytest.fixture(scope="module")
def harness(model_dir: Path) -> Iterator[ServerHarness]:
    cfg = ExecutorConfig(model=ModelConfig(source=str(model_dir), dtype="float32"),
                         device="cpu", cache=CacheConfig(kv_tokens=4096, max_sequences=16,
                                                         max_context=256))
    h = ServerHarness(cfg)
    try:
        h.wait_ready()
        yield h
    finally:
        h.close()


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                attn_implementation="eager").eval()


def prefill(h: ServerHarness, seq_id: str, tokens: list[int], sampling: pb.SamplingParams,
            **item: Any) -> pb.ItemOutput:
    req = pb.PrefillRequest(items=[pb.PrefillItem(seq_id=seq_id, token_ids=tokens, sample=True,
                                                  sampling=sampling, **item)])
    return h.stub.Prefill(req, timeout=60).outputs[0]


def release(h: ServerHarness, *ids: str) -> None:
    h.stub.Release(pb.ReleaseRequest(seq_ids=list(ids)), timeout=60)


def session(h: ServerHarness, requests: list[pb.SessionRequest]) -> list[pb.SessionResponse]:
    return list(h.stub.Session(iter(requests), timeout=120))


ONE = bitmask([42])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_token_mask_every_step(harness: ServerHarness, temperature: float) -> None:
    """Unary prefill and decode, a Session at depth 2 continuing from the device's last
    samples, and num_steps 8: every token is the one allowed."""
    s = pb.SamplingParams(temperature=temperature, allowed_token_bitmask=ONE, logprobs=True)
    out = prefill(harness, "m", [1, 2, 3], s)
    assert out.token_id == 42 and out.logprob == pytest.approx(0.0, abs=1e-6)
    dec = harness.stub.Decode(pb.DecodeRequest(items=[
        pb.DecodeItem(seq_id="m", token_id=42, sampling=s)]), timeout=60).outputs[0]
    assert dec.token_id == 42
    steps = [pb.SessionRequest(step=i + 1, decode=pb.DecodeRequest(items=[
        pb.DecodeItem(seq_id="m", use_last_sampled=True, sampling=s)])) for i in range(4)]
    steps.append(pb.SessionRequest(step=9, decode=pb.DecodeRequest(num_steps=8, items=[
        pb.DecodeItem(seq_id="m", use_last_sampled=True, sampling=s)])))
    answers = session(harness, steps)
    assert [a.decode.outputs[0].token_id for a in answers[:4]] == [42] * 4
    assert [t.token_id for t in answers[4].decode.outputs[0].steps] == [42] * 8
    release(harness, "m")


def test_mask_set_never_violated(harness: ServerHarness) -> None:
    """Over 1,000 seeded T=1 draws (15 masked sequences and a free one, 8 steps, 9 calls)
    stay inside each row's allowed set; an unmasked row in the batch is unaffected."""
    rng = np.random.default_rng(0)
    allowed = [sorted(rng.choice(V, size=int(rng.integers(2, 40)), replace=False).tolist())
               for _ in range(15)]
    items = [pb.PrefillItem(seq_id=f"s{i}", token_ids=[i + 1, 7], sample=True,
                            sampling=pb.SamplingParams(temperature=1.0, seed=i,
                                                       allowed_token_bitmask=bitmask(a)))
             for i, a in enumerate(allowed)]
    items.append(pb.PrefillItem(seq_id="free", token_ids=[5], sample=True,
                                sampling=pb.SamplingParams(temperature=1.0, seed=99)))
    harness.stub.Prefill(pb.PrefillRequest(items=items), timeout=60)
    seen: list[set[int]] = [set() for _ in allowed]
    draws = 0
    for _ in range(9):
        req = pb.DecodeRequest(num_steps=8, items=[
            pb.DecodeItem(seq_id=it.seq_id, use_last_sampled=True, sampling=it.sampling)
            for it in items])
        outs = harness.stub.Decode(req, timeout=120).outputs
        for i, a in enumerate(allowed):
            toks = [t.token_id for t in outs[i].steps]
            assert set(toks) <= set(a), (i, toks, a)
            seen[i].update(toks)
            draws += len(toks)
        assert len(outs[-1].steps) == 8
    assert draws >= 1000
    assert sum(len(s) > 1 for s in seen) >= 10  # the draws do vary inside the sets
    release(harness, *[it.seq_id for it in items])


def test_logit_bias_forces_and_bans(harness: ServerHarness) -> None:
    out = prefill(harness, "b", [9, 8, 7], pb.SamplingParams(temperature=1.0, seed=1,
                                                             logit_bias={77: 100.0}))
    assert out.token_id == 77
    greedy = prefill(harness, "g", [9, 8, 7], pb.SamplingParams()).token_id
    banned = prefill(harness, "g2", [9, 8, 7],
                     pb.SamplingParams(logit_bias={greedy: -100.0})).token_id
    assert banned != greedy
    release(harness, "b", "g", "g2")


def reference_processed(logits: torch.Tensor, bias: dict[int, float], allowed: list[int],
                        temperature: float, top_k: int, top_p: float, min_p: float
                        ) -> torch.Tensor:
    """float64: bias, mask, temperature, top-k, top-p, min-p, log-softmax."""
    x = logits.double().clone()
    for t, b in bias.items():
        x[t] += b
    keep = torch.zeros_like(x, dtype=torch.bool)
    keep[allowed] = True
    x = x.masked_fill(~keep, -math.inf) / temperature
    if top_k:
        x = x.masked_fill(x < torch.topk(x, top_k).values[-1], -math.inf)
    if top_p < 1:
        sx, order = x.sort(descending=True)
        p = sx.softmax(-1)
        drop = torch.zeros_like(keep)
        drop[order] = (p.cumsum(-1) - p) >= top_p
        x = x.masked_fill(drop, -math.inf)
    if min_p:
        x = x.masked_fill(x < x.max() + math.log(min_p), -math.inf)
    return torch.log_softmax(x, -1)


@torch.no_grad()
def test_processed_logprobs_match_float64_reference(harness: ServerHarness, hf: Any) -> None:
    prompt = [3, 17, 99, 4, 250]
    allowed = list(range(0, V, 3))
    bias = {6: 2.5, 9: -1.0, 12: 0.75}
    cases = [(0.7, 20, 0.9, 0.0), (1.3, 0, 0.8, 0.05), (0.0, 0, 1.0, 0.0)]
    for n, (temp, k, p, mp) in enumerate(cases):
        s = pb.SamplingParams(temperature=temp, top_k=k, top_p=p, min_p=mp, seed=4,
                              logprobs=True, top_logprobs=5, logit_bias=bias,
                              allowed_token_bitmask=bitmask(allowed),
                              logprobs_mode=pb.LOGPROBS_MODE_PROCESSED)
        out = prefill(harness, f"p{n}", prompt, s,
                      candidate_token_ids=[0, 6, 1, 9, 255])
        logits = hf(torch.tensor([prompt])).logits[0, -1]
        ref = reference_processed(logits, bias, allowed, temp or 1.0, k, p, mp)
        assert out.logprob == pytest.approx(float(ref[out.token_id]), abs=TOL)
        top = torch.topk(ref, 5)
        got = [t.logprob for t in out.top_logprobs]
        finite = [v for v in top.values.tolist() if math.isfinite(v)]
        assert got[: len(finite)] == pytest.approx(finite, abs=TOL)
        assert math.isfinite(ref[out.token_id])  # drawn from the surviving set
        assert float(ref.exp().sum()) == pytest.approx(1.0, abs=1e-9)
        assert float(ref[torch.isfinite(ref)].exp().sum()) == pytest.approx(1.0, abs=1e-9)
        cand = [(c.token_id, c.logprob) for c in out.candidate_logprobs]
        assert [c for c, _ in cand] == [0, 6, 1, 9, 255]
        for tok, lp in cand:
            want = float(ref[tok])
            assert (lp == want == -math.inf) or lp == pytest.approx(want, abs=TOL)
        # The returned processed distribution sums to 1 over the surviving set.
        top_all = prefill(harness, f"q{n}", prompt, s,
                          candidate_token_ids=list(range(V))).candidate_logprobs
        mass = sum(math.exp(c.logprob) for c in top_all if math.isfinite(c.logprob))
        assert mass == pytest.approx(1.0, abs=1e-4)
    release(harness, *[f"{c}{n}" for c in "pq" for n in range(len(cases))])


@torch.no_grad()
def test_candidates_and_hidden_states_match_hf_every_position(harness: ServerHarness,
                                                              hf: Any) -> None:
    prompt = [5, 6, 200, 11, 42, 9]
    cands = [0, 1, 42, 255, 100]
    out = prefill(harness, "c", prompt, pb.SamplingParams(), every_position=True,
                  candidate_token_ids=cands, return_hidden_state=True)
    ref = hf(torch.tensor([prompt]), output_hidden_states=True)
    logprobs = torch.log_softmax(ref.logits[0], -1)
    # HF's last hidden_states entry is after the final norm.
    hidden = ref.hidden_states[-1][0]
    assert len(out.positions) == len(prompt)
    for i, pos in enumerate(out.positions):
        assert [c.token_id for c in pos.candidate_logprobs] == cands
        assert [c.logprob for c in pos.candidate_logprobs] == pytest.approx(
            logprobs[i, cands].tolist(), abs=TOL)
        assert list(pos.hidden_state) == pytest.approx(hidden[i].tolist(), abs=TOL)
    assert list(out.hidden_state) == pytest.approx(hidden[-1].tolist(), abs=TOL)
    # Decode: each step's candidates and hidden state, against HF on the grown sequence.
    req = pb.DecodeRequest(num_steps=3, items=[pb.DecodeItem(
        seq_id="c", use_last_sampled=True, candidate_token_ids=cands,
        return_hidden_state=True)])
    dec = harness.stub.Decode(req, timeout=60).outputs[0]
    seq = [*prompt, out.token_id, *[t.token_id for t in dec.steps]]
    ref = hf(torch.tensor([seq]), output_hidden_states=True)
    logprobs = torch.log_softmax(ref.logits[0], -1)
    for k, step in enumerate(dec.steps):
        row = len(prompt) + k
        assert [c.logprob for c in step.candidate_logprobs] == pytest.approx(
            logprobs[row, cands].tolist(), abs=TOL)
        assert list(step.hidden_state) == pytest.approx(
            ref.hidden_states[-1][0, row].tolist(), abs=TOL)
    release(harness, "c")


@pytest.mark.parametrize("sampling,item,field", [
    (pb.SamplingParams(allowed_token_bitmask=b"\xff" * 4), {},
     "items[0].sampling.allowed_token_bitmask"),
    (pb.SamplingParams(allowed_token_bitmask=bytes(V // 8)), {},
     "items[0].sampling.allowed_token_bitmask"),
    (pb.SamplingParams(logit_bias={V: 1.0}), {}, f"items[0].sampling.logit_bias[{V}]"),
    (pb.SamplingParams(), {"candidate_token_ids": list(range(257))},
     "items[0].candidate_token_ids"),
    (pb.SamplingParams(), {"candidate_token_ids": [3, -1]}, "items[0].candidate_token_ids[1]"),
])
def test_bad_controls_are_invalid_argument(harness: ServerHarness, sampling: pb.SamplingParams,
                                           item: dict[str, Any], field: str) -> None:
    before = harness.kv()
    with pytest.raises(grpc.RpcError) as err:
        prefill(harness, "bad", [1, 2], sampling, **item)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (err.value.details() or "")
    assert harness.kv().free_tokens == before.free_tokens


def test_packed_outputs_refuse_extra_outputs(harness: ServerHarness) -> None:
    prefill(harness, "pk", [1, 2], pb.SamplingParams())
    with pytest.raises(grpc.RpcError) as err:
        harness.stub.Decode(pb.DecodeRequest(packed_outputs=True, items=[pb.DecodeItem(
            seq_id="pk", use_last_sampled=True, return_hidden_state=True)]), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[0].return_hidden_state" in (err.value.details() or "")
    release(harness, "pk")


def test_grammar_without_a_tokenizer_is_failed_precondition(harness: ServerHarness) -> None:
    """The random-weight checkpoint has no tokenizer.json: nothing to compile against."""
    before = harness.kv().free_tokens
    with pytest.raises(grpc.RpcError) as err:
        prefill(harness, "gr", [1, 2], pb.SamplingParams(grammar=pb.Grammar(regex="[ab]+")))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "tokenizer" in (err.value.details() or "")
    assert harness.kv().free_tokens == before
