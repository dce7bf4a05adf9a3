"""``Executor.truncate``: a sequence keeps its first ``length`` tokens, the KV past them is
freed exactly, and what follows continues as if the tail had never been there."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.api import DecodeItem, PrefillItem, SamplingParams
from executor.config import CacheConfig, ExecutorConfig
from executor.errors import InvalidRequest, SequenceNotFound
from executor.executor import Executor

SEEDED = SamplingParams(temperature=0.7, seed=9, logprobs=True)


def make() -> Executor:
    return Executor(ExecutorConfig(cache=CacheConfig(kv_tokens=2048, max_sequences=8,
                                                     max_context=256)))


@pytest.fixture(scope="module")
def pair() -> tuple[Executor, Executor]:
    return make(), make()


def test_truncate_then_extend_equals_never_having_extended(pair: tuple[Executor, Executor]
                                                           ) -> None:
    """Speculative decoding's roll-back: extend by draft tokens, truncate the rejected
    tail, continue; every output equals a sequence that never saw the rejected tokens."""
    ref, ex = pair
    prompt, accepted, rejected = [5, 9, 2, 7, 11], [40, 41], [300, 301, 302]
    ref_out = ref.prefill([PrefillItem("r", prompt + accepted, sampling=SEEDED)]).outputs[0]
    ex.prefill([PrefillItem("t", prompt, sampling=SEEDED)])
    ex.prefill([PrefillItem("t", accepted + rejected, sampling=SEEDED)])
    free_before = ex.kv_stats().free_tokens
    result = ex.truncate("t", len(prompt) + len(accepted) - 1)
    assert (result.seq_len, result.freed_tokens) == (6, 1 + len(rejected))
    assert ex.kv_stats().free_tokens == free_before + 4
    out = ex.prefill([PrefillItem("t", accepted[-1:], sampling=SEEDED)]).outputs[0]
    # The same tokens; logprobs to float32 rounding (the last accepted token is now run as
    # an extend over the cached prefix, not inside one 7-token prefill).
    assert (out.token_id, out.seq_len) == (ref_out.token_id, ref_out.seq_len)
    assert out.logprob == pytest.approx(ref_out.logprob, abs=1e-4)
    for _ in range(4):
        a = ref.decode([DecodeItem("r", ref_out.token_id, SEEDED)]).outputs[0]
        b = ex.decode([DecodeItem("t", ref_out.token_id, SEEDED)]).outputs[0]
        assert (a.token_id, a.seq_len) == (b.token_id, b.seq_len)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        ref_out = a
    ref.release(["r"])
    ex.release(["t"])
    for e in pair:
        e.kv.check_invariants()
        assert e.kv_stats().free_tokens == e.kv_stats().total_tokens


def test_a_truncated_sequence_must_give_its_next_token(pair: tuple[Executor, Executor]
                                                      ) -> None:
    _, ex = pair
    ex.prefill([PrefillItem("u", [1, 2, 3, 4])])
    ex.truncate("u", 4)  # its own length: nothing changes, the last sample stays
    assert ex.decode([DecodeItem("u", None)]).outputs[0].seq_len == 5
    ex.truncate("u", 2)
    with pytest.raises(InvalidRequest, match="no sampled token to continue from"):
        ex.decode([DecodeItem("u", None)])
    assert ex.decode([DecodeItem("u", 3)]).outputs[0].seq_len == 3
    ex.release(["u"])


def test_bad_truncates_change_nothing(pair: tuple[Executor, Executor]) -> None:
    _, ex = pair
    ex.prefill([PrefillItem("v", [1, 2, 3])])
    before = ex.kv_stats()
    with pytest.raises(SequenceNotFound):
        ex.truncate("nope", 0)
    for bad in (-1, 4):
        with pytest.raises(InvalidRequest, match=r"length: must be in \[0, 3\]"):
            ex.truncate("v", bad)
    assert ex.kv_stats() == before and ex.kv.get("v").length == 3  # type: ignore[union-attr]
    ex.truncate("v", 0)  # an empty sequence keeps its slot and continues from 0
    assert ex.prefill([PrefillItem("v", [7])]).outputs[0].seq_len == 1
    ex.release(["v"])
    ex.kv.check_invariants()


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["prefill", "decode", "truncate", "release"]),
                              st.integers(0, 3), st.integers(0, 40)), max_size=30))
def test_accounting_stays_exact_under_truncates(ops: list[tuple[str, int, int]]) -> None:
    ex = make()
    total = ex.kv_stats().total_tokens
    for op, which, n in ops:
        sid = f"s{which}"
        state = ex.kv.get(sid)
        if op == "prefill":
            ex.prefill([PrefillItem(sid, list(range(1, 2 + n % 9)), sample=n % 2 == 0)])
        elif op == "decode" and state is not None:
            ex.decode([DecodeItem(sid, n)])
        elif op == "truncate" and state is not None:
            ex.truncate(sid, min(n, state.length))
        elif op == "release":
            ex.release([sid])
        ex.kv.check_invariants()
    ex.release([f"s{i}" for i in range(4)])
    assert ex.kv_stats().free_tokens == total
