"""``every_position`` prefill: a token, its logprob, top logprobs and the next given token's
logprob at every new position, against HF transformers' logits (float32, CPU); a
speculative-decoding loop built from it and Truncate equals plain greedy decoding."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from executor.api import DecodeItem, PrefillItem, SamplingParams
from executor.errors import InvalidRequest
from executor.executor import Executor
from executor.validation import MAX_POSITION_ROWS
from tests.helpers.every_position import SCORED, assert_positions_match, make_executor
from tests.helpers.models import ARCHS


@torch.no_grad()
def hf_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module", params=ARCHS)
def pair(request: pytest.FixtureRequest, model_dirs: dict[str, Path]
         ) -> tuple[Executor, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    path = model_dirs[request.param]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    return make_executor(path), hf


def test_every_position_matches_hf(pair: tuple[Executor, torch.nn.Module]) -> None:
    """Two new sequences and one extended (a chunk over a cached prefix) in one call, beside
    a plain sampling item and a non-sampling one."""
    ex, hf = pair
    a, b, c = [3, 17, 99, 4, 250, 8, 41], [5, 6], [200, 1, 2, 3, 4, 5, 6, 7, 8]
    ex.prefill([PrefillItem("c", c[:4], sample=False)])
    res = ex.prefill([
        PrefillItem("a", a, sampling=SCORED, every_position=True),
        PrefillItem("plain", [9, 9, 9], sampling=SCORED),
        PrefillItem("b", b, sampling=SCORED, every_position=True),
        PrefillItem("quiet", [1, 2], sample=False),
        PrefillItem("c", c[4:], sampling=SCORED, every_position=True)]).outputs
    assert_positions_match(res[0], hf_logprobs(hf, a), a)
    assert_positions_match(res[2], hf_logprobs(hf, b), b)
    assert_positions_match(res[4], hf_logprobs(hf, c)[4:], c[4:])
    assert res[1].positions == () and res[1].token_id is not None
    assert res[3].token_id is None and res[3].positions == ()
    assert [o.seq_len for o in res] == [7, 3, 2, 2, 9]
    # The next decode continues from the last position's token, as after a plain prefill.
    nxt = ex.decode([DecodeItem("a", None)]).outputs[0]
    want = int(hf_logprobs(hf, [*a, res[0].token_id])[-1].argmax())  # type: ignore[list-item]
    assert nxt.token_id == want
    ex.release(["a", "b", "c", "plain", "quiet"])
    ex.kv.check_invariants()


def test_the_last_position_samples_as_a_plain_prefill() -> None:
    """Seeded sampling keys its noise by position: the every_position item's last entry is
    the token a plain prefill of the same prompt samples, and earlier positions are what
    prefilling the shorter prompts samples."""
    ex = make_executor("tiny")
    seeded = SamplingParams(temperature=1.3, top_p=0.9, seed=77, logprobs=True)
    prompt = [11, 22, 33, 44, 55, 66]
    got = ex.prefill([PrefillItem("e", prompt, sampling=seeded, every_position=True)]
                     ).outputs[0]
    for n in range(1, len(prompt) + 1):
        plain = ex.prefill([PrefillItem(f"p{n}", prompt[:n], sampling=seeded)]).outputs[0]
        assert got.positions[n - 1].token_id == plain.token_id
        assert got.positions[n - 1].logprob == pytest.approx(plain.logprob, abs=1e-5)
    ex.release(["e", *(f"p{n}" for n in range(1, len(prompt) + 1))])


def test_speculative_decoding_through_the_api_equals_greedy_decoding() -> None:
    """Draft k tokens, verify them in one every_position prefill, accept the matching
    prefix plus the model's own next token, Truncate the rest: the output is exactly the
    greedy continuation, with fewer verify calls than tokens when drafts are good."""
    ex = make_executor("tiny")
    prompt, n_new, k = [7, 3, 9, 12, 40], 24, 4
    ref = [ex.prefill([PrefillItem("ref", prompt)]).outputs[0].token_id]
    while len(ref) < n_new:
        ref.append(ex.decode([DecodeItem("ref", ref[-1])]).outputs[0].token_id)

    def draft(out: list[int | None], i: int) -> list[int]:
        """A drafter right at even rounds (the reference), wrong afterwards at odd ones."""
        guess = [t for t in ref[len(out) - 1: len(out) - 1 + k] if t is not None]
        return guess if i % 2 == 0 else guess[:2] + [(g + 1) % 512 for g in guess[2:]]

    out: list[int | None] = [ex.prefill([PrefillItem("spec", prompt)]).outputs[0].token_id]
    calls = 0
    while len(out) < n_new:
        proposal = draft(out, calls)
        assert out[-1] is not None
        verify = [out[-1], *proposal[1:]]  # the last accepted token, then the drafts
        res = ex.prefill([PrefillItem("spec", verify, every_position=True)]).outputs[0]
        calls += 1
        model = [p.token_id for p in res.positions]
        accepted = 0
        while accepted + 1 < len(verify) and verify[accepted + 1] == model[accepted]:
            accepted += 1
        out += model[: accepted + 1]
        seq_len = len(prompt) + len(out) - 1  # every token but the newest is in the cache
        if res.seq_len > seq_len:
            ex.truncate("spec", seq_len)
    assert out[:n_new] == ref
    assert calls < n_new - 1  # accepted drafts saved calls
    ex.release(["spec", "ref"])
    ex.kv.check_invariants()


def test_bad_every_position_calls_change_nothing() -> None:
    ex = make_executor("tiny")
    before = ex.kv_stats()
    cases = [
        ([PrefillItem("x", [1, 2], sample=False, every_position=True)],
         "items[0].every_position: needs sample"),
        ([PrefillItem("x", [1] * (MAX_POSITION_ROWS // 2 + 1), every_position=True),
          PrefillItem("y", [2] * (MAX_POSITION_ROWS // 2), every_position=True)],
         f"at most {MAX_POSITION_ROWS}"),
        ([PrefillItem("x", [1] * 500, every_position=True,
                      sampling=SamplingParams(top_logprobs=20))],
         "10000 top log-probabilities"),
    ]
    for items, text in cases:
        with pytest.raises(InvalidRequest, match=re.escape(text)):
            ex.prefill(items)
        assert ex.kv_stats() == before
