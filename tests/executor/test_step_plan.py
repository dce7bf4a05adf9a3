"""Step planning (``executor/step_plan.py``): pure functions of a call's items and its
allocation, checked on CPU without an executor."""

from __future__ import annotations

import torch

from executor.api import DecodeItem, PrefillItem, SamplingParams
from executor.kv.manager import Allocation, Columns, Extension
from executor.step_plan import NO_STOPS, DecodeMemo, SamplePlan, decode_columns, decode_step

HOT = SamplingParams(temperature=0.7, seed=3)


def prefill_alloc(items: list[PrefillItem], prefix: list[int]) -> Allocation:
    exts = tuple(Extension(it.seq_id, slot, p, len(it.token_ids), p == 0)
                 for slot, (it, p) in enumerate(zip(items, prefix, strict=True)))
    return Allocation(exts, torch.arange(sum(len(it.token_ids) for it in items)))


def test_a_plain_prefill_samples_one_row_per_sampling_item() -> None:
    items = [PrefillItem("a", [5, 6, 7]), PrefillItem("b", [1, 2], sample=False),
             PrefillItem("c", [9], sampling=HOT)]
    alloc = prefill_alloc(items, [0, 0, 4])
    plan = SamplePlan.of(items, alloc, [0, 2], frozenset())
    assert plan.params == [items[0].sampling, HOT]
    assert plan.positions == [3, 5]  # the new token's index: each sequence's length
    assert plan.targets is None and plan.position_rows == ()
    assert plan.item_rows == (0, None, 1)
    assert plan.last_rows == [0, 1]


def test_an_every_position_item_samples_each_new_token_with_the_next_as_target() -> None:
    items = [PrefillItem("a", [5, 6, 7], every_position=True), PrefillItem("b", [1, 2])]
    alloc = prefill_alloc(items, [2, 0])
    plan = SamplePlan.of(items, alloc, [0, 1], frozenset({0}))
    assert plan.positions == [3, 4, 5, 2]
    assert plan.targets == [6, 7, -1, -1]  # the last row of each item has no target
    assert plan.position_rows == ((0, 3), None)
    assert plan.item_rows == (2, 3)
    assert plan.last_rows == [2, 3]
    assert len(plan.params) == 4


def test_decode_columns_transpose_the_items() -> None:
    items = [DecodeItem("a", 4), DecodeItem("b", None, HOT, (2, 3))]
    has = {"b"}.__contains__
    seq_ids, tokens, sampling, stops, had_last = decode_columns(items, has)
    assert seq_ids == ("a", "b") and tokens == (4, None)
    assert sampling == (items[0].sampling, HOT)
    assert stops == (NO_STOPS, frozenset({2, 3}))
    assert had_last == {"a": False, "b": True}
    _, _, _, plain, _ = decode_columns([DecodeItem("a", 4)], has)
    assert plain[0] is NO_STOPS  # no stop ids: one shared empty set


def test_a_memo_repeats_only_the_same_items_with_nothing_else_changed() -> None:
    items = [DecodeItem("a", None), DecodeItem("b", None)]
    memo = DecodeMemo.after(items, 1, 7, 10, decode_columns(items, lambda _: True))
    assert memo.columns is not None
    assert memo.columns[1] == (None, None) and memo.columns[4] == {"a": True, "b": True}
    assert memo.repeats(items, 1, 7, 64)
    assert memo.repeats(list(items), 1, 7, 64)  # the same objects in a new list
    assert not memo.repeats([DecodeItem(*it) for it in items], 1, 7, 64)  # equal, not same
    assert not memo.repeats(items, 1, 8, 64)  # the cache changed
    assert not memo.repeats(items, 2, 7, 64)  # another step count
    assert not memo.repeats(items[:1], 1, 7, 64)
    assert memo.repeats(items, 1, 7, 11) and not memo.repeats(items, 1, 7, 10)  # no room


def test_a_launch_that_gave_a_token_leaves_no_columns() -> None:
    items = [DecodeItem("a", 5), DecodeItem("b", None)]
    memo = DecodeMemo.after(items, 1, 1, 3, decode_columns(items, lambda _: True))
    assert memo.columns is None and not memo.repeats(items, 1, 1, 64)


def test_decode_step_slices_one_token_per_sequence() -> None:
    cols = Columns(("a", "b"), [3, 5], [4, 0], [2, 2], [False, True])
    alloc = Allocation.of_columns(cols, torch.tensor([10, 11, 20, 21]))
    first, second = decode_step(alloc, 2, 0), decode_step(alloc, 2, 1)
    assert first.out_cache_loc.tolist() == [10, 20]
    assert second.out_cache_loc.tolist() == [11, 21]
    assert first.columns.prefix_lens == [4, 0] and second.columns.prefix_lens == [5, 1]
    assert first.columns.new_lens == [1, 1] == second.columns.new_lens
    assert list(first.columns.is_new) == [False, True]  # new only at the first step
    assert list(second.columns.is_new) == [False, False]
    assert first.columns.slots == [3, 5] == second.columns.slots
