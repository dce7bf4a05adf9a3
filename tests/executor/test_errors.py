"""Every typed error the executor raises, and that nothing is applied when one is raised."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from executor.api import DecodeItem, PrefillItem, SamplingParams
from executor.config import CacheConfig, ExecutorConfig
from executor.errors import (
    ContextLengthExceeded,
    GraphsUnavailable,
    InvalidRequest,
    OutOfResources,
    SequenceNotFound,
)
from executor.executor import Executor


@pytest.fixture(scope="module")
def ex() -> Executor:
    cfg = ExecutorConfig(cache=CacheConfig(kv_tokens=64, max_sequences=3, max_context=32),
                         max_prefill_tokens=48)
    return Executor(cfg)


@pytest.fixture(autouse=True)
def _clean(ex: Executor) -> None:
    ex.release([s for s in list(ex.kv._seqs)])


def unchanged(ex: Executor, call: Callable[[], object], exc: type[Exception]) -> Exception:
    before = ex.kv_stats()
    with pytest.raises(exc) as info:
        call()
    assert ex.kv_stats() == before
    ex.kv.check_invariants()
    return info.value


def fields(err: Exception) -> list[str]:
    assert isinstance(err, InvalidRequest)
    return [v.field for v in err.violations]


def test_empty_token_list(ex: Executor) -> None:
    err = unchanged(ex, lambda: ex.prefill([PrefillItem("a", [1]), PrefillItem("b", [])]),
                    InvalidRequest)
    assert fields(err) == ["items[1].token_ids"]


def test_token_out_of_vocab(ex: Executor) -> None:
    vocab = ex.model_info.vocab_size
    err = unchanged(ex, lambda: ex.prefill([PrefillItem("a", [1, vocab, -1])]), InvalidRequest)
    assert fields(err) == ["items[0].token_ids[1]"]
    assert f"[0, {vocab})" in str(err)
    ex.prefill([PrefillItem("a", [1])])
    err = unchanged(ex, lambda: ex.decode([DecodeItem("a", -5)]), InvalidRequest)
    assert fields(err) == ["items[0].token_id"]


def test_same_seq_id_twice(ex: Executor) -> None:
    err = unchanged(ex, lambda: ex.prefill([PrefillItem("a", [1]), PrefillItem("a", [2])]),
                    InvalidRequest)
    assert fields(err) == ["items[1].seq_id"] and "items[0]" in str(err)
    ex.prefill([PrefillItem("x", [1])])
    unchanged(ex, lambda: ex.decode([DecodeItem("x", 1), DecodeItem("x", 2)]), InvalidRequest)


def test_all_violations_reported_at_once(ex: Executor) -> None:
    bad = SamplingParams(temperature=-1, top_p=0.0, top_logprobs=21)
    err = unchanged(ex, lambda: ex.prefill([PrefillItem("", [1], sampling=bad),
                                            PrefillItem("b", [])]), InvalidRequest)
    assert set(fields(err)) == {"items[0].seq_id", "items[0].sampling.temperature",
                                "items[0].sampling.top_p", "items[0].sampling.top_logprobs",
                                "items[1].token_ids"}


def test_empty_call_and_too_many_tokens(ex: Executor) -> None:
    assert fields(unchanged(ex, lambda: ex.prefill([]), InvalidRequest)) == ["items"]
    assert fields(unchanged(ex, lambda: ex.decode([]), InvalidRequest)) == ["items"]
    err = unchanged(ex, lambda: ex.prefill([PrefillItem("a", [1] * 30),
                                            PrefillItem("b", [1] * 30)]), InvalidRequest)
    assert fields(err) == ["items"] and "at most 48" in str(err)


def test_context_length_exceeded(ex: Executor) -> None:
    unchanged(ex, lambda: ex.prefill([PrefillItem("a", [1] * 33)]), ContextLengthExceeded)
    ex.prefill([PrefillItem("a", [1] * 30)])
    err = unchanged(ex, lambda: ex.prefill([PrefillItem("a", [1] * 3)]), ContextLengthExceeded)
    assert "30 cached + 3 new" in str(err)
    ex.prefill([PrefillItem("a", [1] * 2)])  # exactly max_context is fine
    unchanged(ex, lambda: ex.decode([DecodeItem("a", 1)]), ContextLengthExceeded)


def test_unknown_seq_id_for_decode(ex: Executor) -> None:
    ex.prefill([PrefillItem("known", [1, 2])])
    err = unchanged(ex, lambda: ex.decode([DecodeItem("known", 1), DecodeItem("nope", 1)]),
                    SequenceNotFound)
    assert isinstance(err, SequenceNotFound)
    assert err.seq_ids == ["nope"] and err.field_names == ["items[1].seq_id"]


def test_out_of_kv_tokens(ex: Executor) -> None:
    ex.prefill([PrefillItem("a", [1] * 30)])
    err = unchanged(ex, lambda: ex.prefill([PrefillItem("b", [1] * 20),
                                            PrefillItem("c", [1] * 20)]), OutOfResources)
    assert isinstance(err, OutOfResources)
    assert (err.resource, err.needed, err.free) == ("kv_tokens", 40, 34)


def test_out_of_sequence_slots(ex: Executor) -> None:
    ex.prefill([PrefillItem(s, [1]) for s in "abc"])
    err = unchanged(ex, lambda: ex.prefill([PrefillItem("d", [1])]), OutOfResources)
    assert isinstance(err, OutOfResources)
    assert (err.resource, err.needed, err.free) == ("sequence_slots", 1, 0)


def test_failed_forward_rolls_back(ex: Executor, monkeypatch: pytest.MonkeyPatch) -> None:
    ex.prefill([PrefillItem("a", [1, 2, 3])])

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(ex.model, "forward", boom)
    unchanged(ex, lambda: ex.prefill([PrefillItem("a", [4]), PrefillItem("new", [1])]),
              RuntimeError)
    unchanged(ex, lambda: ex.decode([DecodeItem("a", 4)]), RuntimeError)
    monkeypatch.undo()
    assert ex.decode([DecodeItem("a", 4)]).outputs[0].seq_len == 4


def test_capture_on_cpu_is_unavailable(ex: Executor) -> None:
    with pytest.raises(GraphsUnavailable, match="CUDA device"):
        ex.capture(["decode"])


def test_release_reports_unknown_ids(ex: Executor) -> None:
    ex.prefill([PrefillItem("a", [1])])
    res = ex.release(["a", "ghost", "a"])
    assert res.released == 1 and res.unknown_seq_ids == ("ghost",)
    assert ex.kv_stats().free_tokens == ex.kv_stats().total_tokens
