"""The sequence table and atomic KV allocation on top of the pools.

Invariants (checked by ``check_invariants`` in tests after every operation):

* ``free + used == total`` for token locations and for slots, a location shared by
  forked sequences counted once;
* every live sequence of length ``n`` holds exactly the locations in ``table[slot, :n]``;
  a location held by k sequences has k references, and is free only when k is 0;
* allocation hands out free locations only, so appends never write a location that a
  live sequence holds (a fork shares its prefix; what it appends is its own);
* ``allocate`` is all-or-nothing, and ``rollback`` undoes one allocation exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from executor.api import KVStats
from executor.errors import ContextLengthExceeded, FieldViolation, OutOfResources, Shortage
from executor.kv.allocator import SlotAllocator, TokenAllocator
from executor.kv.pool import ReqToTokenTable

# NOTE: compared by identity (the table holds one per sequence), so ``None in states``
# over a batch's looked-up states stays in C instead of calling a generated ``__eq__``.


@dataclass(eq=False, slots=True)
class SequenceState:
    seq_id: str
    slot: int
    length: int  # tokens whose K/V are in the cache


class Extension(NamedTuple):
    """One sequence's part of an allocation: tokens ``prefix_len .. prefix_len+new_len-1``.
    (A named tuple: a decode step makes one per sequence, and a tuple is built in a third
    of a frozen dataclass's time.)"""

    seq_id: str
    slot: int
    prefix_len: int
    new_len: int
    is_new: bool

    @property
    def seq_len(self) -> int:
        return self.prefix_len + self.new_len


class Columns(NamedTuple):
    """An allocation's extensions as columns, in item order (what packing a batch reads)."""

    seq_ids: Sequence[str]
    slots: list[int]
    prefix_lens: list[int]
    new_lens: list[int]
    is_new: Sequence[bool]


class Allocation:
    """What one call allocated, in item order; ``out_cache_loc`` packs every new token.

    Made from its ``extensions`` or, by ``KVCacheManager.extend`` (a decode step), from
    ``columns``: each view is made from the other only when first asked for (a decode
    step's batch reads columns only, and a tuple per sequence costs more than the rest of
    its allocation). Not to be mutated."""

    __slots__ = ("_columns", "_extensions", "out_cache_loc")

    def __init__(self, extensions: tuple[Extension, ...], out_cache_loc: torch.Tensor) -> None:
        self._extensions: tuple[Extension, ...] | None = extensions
        self._columns: Columns | None = None
        self.out_cache_loc = out_cache_loc  # (num_tokens,) int64, CPU

    @classmethod
    def of_columns(cls, columns: Columns, out_cache_loc: torch.Tensor) -> Allocation:
        alloc = cls.__new__(cls)
        alloc._extensions, alloc._columns, alloc.out_cache_loc = None, columns, out_cache_loc
        return alloc

    @property
    def extensions(self) -> tuple[Extension, ...]:
        if self._extensions is None:
            assert self._columns is not None
            self._extensions = tuple(map(Extension, *self._columns))
        return self._extensions

    @property
    def columns(self) -> Columns:
        if self._columns is None:
            assert self._extensions is not None
            if self._extensions:  # one transposition of the extensions
                ids, slots, prefix, lens, new = zip(*self._extensions, strict=True)
                self._columns = Columns(ids, list(slots), list(prefix), list(lens), new)
            else:
                self._columns = Columns((), [], [], [], ())
        return self._columns

    @property
    def num_tokens(self) -> int:
        return int(self.out_cache_loc.numel())

    def __repr__(self) -> str:
        return f"Allocation({self.extensions!r}, {self.out_cache_loc!r})"


class KVCacheManager:
    """Owns the sequence table and allocates/frees KV locations and slots for it."""

    def __init__(self, table: ReqToTokenTable, num_locations: int) -> None:
        self.table = table
        self.tokens = TokenAllocator(num_locations)
        self.slots = SlotAllocator(table.max_sequences)
        self._seqs: dict[str, SequenceState] = {}
        self._forked: set[str] = set()  # live sequences created by ``fork``
        #: Bumped by every change to the sequences or the pool (allocate, extend,
        #: rollback, fork, truncate, release): equal values mean nothing changed between.
        self.version = 0

    # -- queries ---------------------------------------------------------------------
    def get(self, seq_id: str) -> SequenceState | None:
        return self._seqs.get(seq_id)

    def length(self, seq_id: str) -> int | None:
        """Tokens ``seq_id`` holds; None for an unknown sequence (validation asks this
        once per item of every step)."""
        state = self._seqs.get(seq_id)
        return None if state is None else state.length

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list[str]:
        """The live sequences, in admission order."""
        return list(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)

    def stats(self) -> KVStats:
        return KVStats(
            total_tokens=self.tokens.size,
            free_tokens=self.tokens.num_free,
            total_slots=self.slots.size,
            free_slots=self.slots.num_free,
            active_sequences=len(self._seqs),
            shared_tokens=self.tokens.num_shared,
            forked_sequences=len(self._forked),
        )

    # -- mutations -------------------------------------------------------------------
    def allocate(self, requests: Sequence[tuple[str, int]]) -> Allocation:
        """Allocate ``n`` new token locations for each ``(seq_id, n)``, admitting unknown ids.

        Raises OutOfResources (with needed vs free) before changing anything if the tokens
        or the slots for the whole call do not fit. Callers validate ids and lengths first.
        """
        self.version += 1
        needed_tokens = sum(n for _, n in requests)
        states = [self._seqs.get(sid) for sid, _ in requests]  # one lookup per request
        num_new = states.count(None)
        short: list[Shortage] = []
        if needed_tokens > self.tokens.num_free:
            short.append(("kv_tokens", needed_tokens, self.tokens.num_free))
        if num_new > self.slots.num_free:
            short.append(("sequence_slots", num_new, self.slots.num_free))
        if short:  # both are reported: freeing one resource alone would not be enough
            raise OutOfResources(*short[0], also=tuple(short[1:]))

        # From here on nothing can fail for lack of resources.
        new_slots = iter(self.slots.alloc(num_new))
        locs = self.tokens.alloc(needed_tokens)
        extensions: list[Extension] = []
        spans: list[tuple[int, int, int]] = []
        width = self.table.max_context
        over: list[FieldViolation] = []
        for (seq_id, n), state in zip(requests, states, strict=True):
            if state is None and (state := self._seqs.get(seq_id)) is None:
                state = SequenceState(seq_id, next(new_slots), 0)
                self._seqs[seq_id] = state
                is_new = True
            else:
                is_new = False
            extensions.append(Extension(seq_id, state.slot, state.length, n, is_new))
            spans.append((state.slot, state.length, n))
            state.length += n
            if state.length > width:
                over.append(FieldViolation("items", f"sequence {seq_id!r} would hold "
                                                    f"{state.length} tokens; at most {width}"))
        alloc = Allocation(tuple(extensions), locs)
        if over:  # callers validate lengths first; a row overrun must not apply in part
            self.rollback(alloc)
            raise ContextLengthExceeded(over)
        self.table.write_host(spans, locs)
        return alloc

    def extend(self, seq_ids: Sequence[str], n: int) -> Allocation:
        """``allocate`` of ``n`` new locations for each of ``seq_ids`` (a decode step),
        done over the batch's columns: no per-sequence tuple, one numpy scatter into the
        host table. The same locations, lengths, errors and atomicity as ``allocate``,
        which it hands over to for anything but distinct, known sequences that fit."""
        self.version += 1
        states = list(map(self._seqs.get, seq_ids))  # one lookup each, in C
        b, total = len(states), n * len(states)
        if n < 1 or None in states or total > self.tokens.num_free \
                or len(set(seq_ids)) != b:
            return self.allocate([(sid, n) for sid in seq_ids])
        prefix = [s.length for s in states]  # type: ignore[union-attr]
        if max(prefix) + n > self.table.max_context:  # allocate reports the overrun
            return self.allocate([(sid, n) for sid in seq_ids])
        # From here on nothing can fail.
        locs = self.tokens.alloc(total)
        for s in states:
            s.length += n  # type: ignore[union-attr]
        slots = [s.slot for s in states]  # type: ignore[union-attr]
        self.table.write_rows(slots, prefix, n, locs)
        return Allocation.of_columns(Columns(seq_ids, slots, prefix, [n] * b, [False] * b),
                                     locs)

    def rollback(self, alloc: Allocation) -> None:
        """Undo ``alloc`` exactly (used when the forward pass after it fails)."""
        self.version += 1
        self.tokens.free(alloc.out_cache_loc)
        c = alloc.columns
        # Newest first: admitted sequences' slots go back onto the free stack in the order
        # that restores it exactly.
        for seq_id, slot, prefix_len, is_new in zip(reversed(c.seq_ids), reversed(c.slots),
                                                    reversed(c.prefix_lens),
                                                    reversed(c.is_new), strict=True):
            if is_new:
                del self._seqs[seq_id]
                self.slots.free(slot)
            else:
                self._seqs[seq_id].length = prefix_len

    def fork(self, parent_id: str, child_id: str, prefix_len: int) -> SequenceState:
        """A new sequence ``child_id`` whose first ``prefix_len`` tokens share the KV
        locations of ``parent_id``'s (nothing is copied; the locations gain a holder).
        Raises OutOfResources when no slot is free, before changing anything. Callers
        validate the ids and ``0 <= prefix_len <= parent length`` first."""
        self.version += 1
        parent = self._seqs[parent_id]
        if child_id in self._seqs or not 0 <= prefix_len <= parent.length:
            raise ValueError(f"cannot fork {child_id!r} from {parent_id!r} of "
                             f"{parent.length} tokens at {prefix_len}")
        (slot,) = self.slots.alloc(1)  # the only step that can fail
        self.tokens.share(self.table.locations(parent.slot, 0, prefix_len))
        self.table.copy_prefix(parent.slot, slot, prefix_len)
        child = SequenceState(child_id, slot, prefix_len)
        self._seqs[child_id] = child
        self._forked.add(child_id)
        return child

    def truncate(self, seq_id: str, length: int) -> int:
        """Keep the first ``length`` tokens of a known sequence (0 <= length <= its length)
        and drop its hold on the locations past them; returns how many of those went back
        to the pool (a location another sequence still holds stays in use)."""
        self.version += 1
        state = self._seqs[seq_id]
        if not 0 <= length <= state.length:
            raise ValueError(f"cannot truncate {seq_id!r} of {state.length} tokens to {length}")
        freed = 0
        if length < state.length:
            freed = self.tokens.free(self.table.locations(state.slot, length, state.length))
            state.length = length
        return freed

    def release(self, seq_id: str) -> int | None:
        """Drop ``seq_id``'s hold on its locations and free its slot; returns how many
        locations went back to the pool, or None if the sequence is unknown."""
        self.version += 1
        state = self._seqs.pop(seq_id, None)
        if state is None:
            return None
        self._forked.discard(seq_id)
        freed = self.tokens.free(self.table.locations(state.slot, 0, state.length))
        self.slots.free(state.slot)
        return freed

    # -- test support ----------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if accounting is off (cheap enough to call in tests)."""
        owned = [self.table.locations(s.slot, 0, s.length) for s in self._seqs.values()]
        all_locs = torch.cat(owned) if owned else torch.empty(0, dtype=torch.int64)
        held, holders = all_locs.unique(return_counts=True)
        assert self.tokens.num_free + int(held.numel()) == self.tokens.size, (
            f"free {self.tokens.num_free} + used {int(held.numel())} != total "
            f"{self.tokens.size}")
        assert self.slots.num_free + len(self._seqs) == self.slots.size
        for s in self._seqs.values():
            mine = self.table.locations(s.slot, 0, s.length)
            assert int(mine.unique().numel()) == s.length, f"{s.seq_id} holds a location twice"
        if held.numel():
            assert int(held.min()) >= 1, "reserved location handed out"
            free = self.tokens.free_locations()
            assert not bool(torch.isin(held, free).any()), "held location is also free"
            assert torch.equal(self.tokens.references(held), holders.to(torch.int32)), \
                "reference counts differ from the sequences holding each location"
        assert self.tokens.num_shared == int((holders > 1).sum()), "shared count is off"
        assert self._forked <= set(self._seqs), "a released sequence still counts as forked"
        slots = [s.slot for s in self._seqs.values()]
        assert len(set(slots)) == len(slots), "slot owned twice"
