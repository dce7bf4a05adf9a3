"""Decode validation's batch-wide pass (``_plainly_valid_decode``) against the full pass
item by item: the same outcome, error and message for any batch."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor import validation
from executor.api import GREEDY, DecodeItem, ItemOutput, SamplingParams, named_rows
from executor.errors import ExecutorError
from executor.validation import Limits, validate_decode

_LIMITS = Limits(vocab_size=50, max_context=20, max_prefill_tokens=100, max_decode_batch=5)
_LENGTHS = {"a": 3, "b": 19, "c": 0, "d": 10}
_LAST = {"a", "b", "d"}
_PARAMS = [GREEDY, SamplingParams(temperature=0.7, seed=3), SamplingParams(top_p=2.0)]

items_st = st.lists(st.builds(
    DecodeItem,
    st.sampled_from(["a", "b", "c", "d", "x", ""]),
    st.one_of(st.none(), st.integers(-2, 52)),
    st.sampled_from(_PARAMS),
    st.one_of(st.just(()), st.tuples(st.integers(-1, 51)))), max_size=7)


def _outcome(items: list[DecodeItem], steps: int) -> tuple[object, ...]:
    try:
        validate_decode(items, _LENGTHS.get, _LIMITS, steps, _LAST.__contains__)
    except ExecutorError as e:
        return type(e), str(e)
    return ("ok",)


@settings(max_examples=400, deadline=None)
@given(items_st, st.integers(0, 3))
def test_batch_pass_agrees_with_the_full_pass(items: list[DecodeItem], steps: int) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(validation, "_BATCH_PASS_MIN_ITEMS", 0)  # the batch pass at any size
        got = _outcome(items, steps)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(validation, "_plainly_valid_decode", lambda *a: False)
        assert got == _outcome(items, steps)


def test_named_rows_are_the_named_tuples() -> None:
    rows = named_rows(ItemOutput, ["s", "t"], [1, None], [None, -0.5], [(), ()], [4, 5],
                      [(), ()], [False, True], [(), ()], [(), ()], [(), ()], [False, False])
    assert rows == [ItemOutput("s", 1, None, (), 4), ItemOutput("t", None, -0.5, (), 5,
                                                                stopped=True)]
    assert all(type(r) is ItemOutput for r in rows) and rows[1].stopped
    with pytest.raises(TypeError):
        named_rows(ItemOutput, ["s"], [1])
