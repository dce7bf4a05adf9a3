"""Step planning: pure functions of a call's items and its allocation (no device work).

* ``SamplePlan``: a prefill's sampled rows (one per sampling item, or one per new token
  of an ``every_position`` item) with their parameters, positions and targets.
* ``decode_columns``: a decode call's items as columns, the host work of a large batch.
* ``DecodeMemo``: what a decode launch leaves for the next one when a pipelined scheduler
  sends the same items again, so their validation and columns stand as they were.
* ``decode_step``: one step's slice of a multi-step decode allocation.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence

from executor.api import DecodeItem, PrefillItem, SamplingParams
from executor.kv.manager import Allocation, Columns

NO_STOPS: frozenset[int] = frozenset()

#: A decode call's columns: (seq_ids, tokens, sampling, stop sets, had_last), where a
#: token is None for an item that continues from its last sample, and ``had_last`` says
#: per sequence whether it had a last sampled token before the call.
DecodeColumns = tuple[tuple[str, ...], tuple[int | None, ...], tuple[SamplingParams, ...],
                      tuple[frozenset[int], ...], dict[str, bool]]


@dataclasses.dataclass(frozen=True)
class SamplePlan:
    """A prefill's sampled rows: one per sampling item, or one per new token of an
    ``every_position`` item (its last row samples exactly as a plain item would)."""

    params: list[SamplingParams]  # per row
    positions: list[int]  # per row: the sampled token's index in its sequence
    targets: list[int] | None  # per row: the item's next given token (-1: none)
    item_rows: tuple[int | None, ...]  # per item: its last row, or None
    position_rows: tuple[tuple[int, int] | None, ...]  # per item: (first row, count)
    last_rows: list[int]  # per sampling item, in order: its last row

    @staticmethod
    def of(items: Sequence[PrefillItem], alloc: Allocation, rows: list[int],
           every: frozenset[int]) -> SamplePlan:
        """``rows``: the sampling items' indices; ``every``: those of them that sample
        at every new position."""
        exts = alloc.extensions
        if not every:  # the common case: a row per sampling item
            by_item: dict[int, int] = {i: r for r, i in enumerate(rows)}
            return SamplePlan([items[i].sampling for i in rows],
                              [exts[i].seq_len for i in rows], None,
                              tuple(by_item.get(i) for i in range(len(items))), (),
                              list(range(len(rows))))
        params: list[SamplingParams] = []
        positions: list[int] = []
        targets: list[int] = []
        item_rows: list[int | None] = [None] * len(items)
        spans: list[tuple[int, int] | None] = [None] * len(items)
        for i in rows:
            it, e = items[i], exts[i]
            n = e.new_len if i in every else 1
            if i in every:
                spans[i] = (len(params), n)
                targets += [*it.token_ids[1:], -1]
            else:
                targets.append(-1)
            params += [it.sampling] * n
            positions += range(e.seq_len - n + 1, e.seq_len + 1)
            item_rows[i] = len(params) - 1
        last = [r for r in item_rows if r is not None]
        return SamplePlan(params, positions, targets, tuple(item_rows), tuple(spans), last)


def decode_columns(items: Sequence[DecodeItem],
                   has_last: Callable[[str], bool]) -> DecodeColumns:
    """The items' columns (``DecodeColumns``). Per-item work is most of a large batch's
    host time: the columns come from one transposition, and each is made once, in C
    where it can be."""
    seq_ids, tokens, sampling, stop_ids = zip(*items, strict=True)
    stops = tuple(frozenset(stop) if stop else NO_STOPS for stop in stop_ids) \
        if any(stop_ids) else (NO_STOPS,) * len(items)
    had_last = dict(zip(seq_ids, map(has_last, seq_ids), strict=True))
    return seq_ids, tokens, sampling, stops, had_last


@dataclasses.dataclass(slots=True)
class DecodeMemo:
    """What a decode launch leaves for the next one when every item continued from its
    last sample: a pipelined scheduler sends the same items step after step
    (``use_last_sampled``), and their validation, columns and flags then stand as they
    were, provided the KV cache changed in nothing but this launch's own tokens."""

    items: tuple[DecodeItem, ...]
    num_steps: int
    kv_version: int  # ``KVCacheManager.version`` right after the launch
    max_len: int  # the longest of its sequences after the launch
    #: The columns the next launch of the same items takes (every ``had_last`` True,
    #: every token None), or None when an item gave its token (the next step's items
    #: would then differ from what it validated).
    columns: DecodeColumns | None

    @staticmethod
    def after(items: Sequence[DecodeItem], num_steps: int, kv_version: int, max_len: int,
              columns: DecodeColumns) -> DecodeMemo:
        """The memo of a launch of ``items`` whose columns were ``columns``."""
        seq_ids, tokens, sampling, stops, _had_last = columns
        n = len(seq_ids)
        return DecodeMemo(tuple(items), num_steps, kv_version, max_len,
                          (seq_ids, (None,) * n, sampling, stops, dict.fromkeys(seq_ids, True))
                          if tokens.count(None) == n else None)

    def repeats(self, items: Sequence[DecodeItem], num_steps: int, kv_version: int,
                servable_context: int) -> bool:
        """Whether ``items`` (the same objects, in order) continue this launch with
        nothing else changed, and every sequence still has room for ``num_steps``."""
        return (self.columns is not None and kv_version == self.kv_version
                and num_steps == self.num_steps and len(items) == len(self.items)
                and all(map(operator.is_, items, self.items))
                and self.max_len <= servable_context - num_steps)


def decode_step(alloc: Allocation, num_steps: int, step: int) -> Allocation:
    """Decode step ``step`` of a multi-step allocation (``num_steps`` tokens per sequence,
    each sequence's locations contiguous): one token per sequence."""
    c = alloc.columns
    b = len(c.slots)
    locs = alloc.out_cache_loc.view(b, num_steps)[:, step]
    return Allocation.of_columns(
        Columns(c.seq_ids, c.slots, [p + step for p in c.prefix_lens], [1] * b,
                [is_new and step == 0 for is_new in c.is_new]), locs.contiguous())
