"""KV accounting: atomic allocation, exact release, and a property test of random ops."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.errors import ContextLengthExceeded, OutOfResources
from executor.kv import Allocation, KVCacheManager, ReqToTokenTable, TokenAllocator


def manager(tokens: int = 64, slots: int = 4, ctx: int = 64) -> KVCacheManager:
    return KVCacheManager(ReqToTokenTable(slots, ctx, torch.device("cpu")), tokens)


def test_allocator_hands_out_distinct_locations_and_never_zero() -> None:
    a = TokenAllocator(10)
    got = torch.cat([a.alloc(3), a.alloc(7)])
    assert sorted(got.tolist()) == list(range(1, 11))
    assert a.num_free == 0
    with pytest.raises(OutOfResources) as exc:
        a.alloc(1)
    assert (exc.value.needed, exc.value.free) == (1, 0)
    a.free(got[:4])
    assert a.num_free == 4


def test_token_exhaustion_allocates_nothing() -> None:
    m = manager(tokens=10, slots=4)
    m.allocate([("a", 6)])
    before = m.stats()
    with pytest.raises(OutOfResources) as exc:
        m.allocate([("b", 3), ("a", 2)])  # 5 needed, 4 free
    assert exc.value.resource == "kv_tokens"
    assert (exc.value.needed, exc.value.free) == (5, 4)
    assert m.stats() == before and "b" not in m
    assert m.get("a") is not None and m.get("a").length == 6  # type: ignore[union-attr]
    m.check_invariants()


def test_slot_exhaustion_allocates_nothing() -> None:
    m = manager(tokens=64, slots=2)
    m.allocate([("a", 1)])
    before = m.stats()
    with pytest.raises(OutOfResources) as exc:
        m.allocate([("b", 1), ("c", 1)])
    assert exc.value.resource == "sequence_slots"
    assert (exc.value.needed, exc.value.free) == (2, 1)
    assert m.stats() == before
    m.check_invariants()


def test_a_row_overrun_allocates_nothing() -> None:
    """Callers validate lengths first; the manager still refuses a call that would write
    past a sequence's table row before taking anything (it once took the tokens, then
    failed on the row write, leaking them)."""
    m = manager(tokens=64, slots=4, ctx=8)
    m.allocate([("a", 6)])
    before = m.stats()
    with pytest.raises(ContextLengthExceeded, match="'a' would hold 9 tokens; at most 8"):
        m.allocate([("b", 2), ("a", 3)])
    with pytest.raises(ContextLengthExceeded, match="'c' would hold 9"):
        m.allocate([("c", 9)])
    assert m.stats() == before and "b" not in m and "c" not in m
    assert m.get("a").length == 6  # type: ignore[union-attr]
    m.check_invariants()
    m.allocate([("a", 2)])  # up to the row's end is fine
    m.check_invariants()


def test_release_returns_every_location_and_the_slot() -> None:
    m = manager(tokens=32, slots=2)
    m.allocate([("a", 5), ("b", 3)])
    m.allocate([("a", 4)])
    assert m.release("a") and not m.release("a")
    assert m.stats().free_tokens == 32 - 3 and m.stats().free_slots == 1
    assert m.release("b")
    s = m.stats()
    assert (s.free_tokens, s.free_slots, s.active_sequences) == (32, 2, 0)
    m.check_invariants()


def test_rollback_undoes_exactly() -> None:
    m = manager(tokens=32, slots=3)
    m.allocate([("a", 5)])
    snapshot = m.stats()
    alloc = m.allocate([("a", 2), ("b", 4)])
    m.rollback(alloc)
    assert m.stats() == snapshot and "b" not in m
    assert m.get("a").length == 5  # type: ignore[union-attr]
    m.check_invariants()


def test_table_maps_each_token_to_its_location() -> None:
    m = manager()
    first = m.allocate([("a", 3)])
    second = m.allocate([("a", 2)])
    slot = m.get("a").slot  # type: ignore[union-attr]
    expect = torch.cat([first.out_cache_loc, second.out_cache_loc]).to(torch.int32)
    assert torch.equal(m.table.host_table[slot, :5], expect)


ops = st.lists(
    st.tuples(st.sampled_from(["extend", "release"]), st.integers(0, 5), st.integers(1, 9)),
    min_size=1, max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_admit_extend_decode_release_keep_accounting(seq: list[tuple[str, int, int]]
                                                           ) -> None:
    """free + used == total after every op; no location is ever owned twice."""
    m = manager(tokens=40, slots=4, ctx=64)
    for op, who, n in seq:
        sid = f"s{who}"
        if op == "release":
            m.release(sid)
        else:
            state = m.get(sid)
            if state is not None and state.length + n > 64:
                continue
            try:
                # mix decode-like (1 token for several) and extend-like calls
                reqs = [(sid, n)] if n > 1 else [(f"s{(who + k) % 6}", 1) for k in range(3)]
                reqs = list(dict(reqs).items())
                m.allocate(reqs)
            except OutOfResources:
                pass
        m.check_invariants()
        s = m.stats()
        assert s.free_tokens + sum(x.length for x in m._seqs.values()) == s.total_tokens


@pytest.mark.parametrize("lens", [[2, 1, 3], [1] * 40, [300, 5], [7]])
def test_each_sequence_finds_its_new_locations_in_the_host_table(lens: list[int]) -> None:
    """Whichever way ``write_host`` takes (one slice, one scatter for short spans, a slice
    per long span), every sequence's row holds exactly the locations handed to it."""
    m = manager(tokens=2048, slots=64, ctx=512)
    m.allocate([("old", 4)])
    ids = [f"s{i}" for i in range(len(lens))]
    first = m.allocate([(sid, n) for sid, n in zip(ids, lens, strict=True)] + [("old", 2)])
    second = m.allocate([(sid, 1) for sid in ids])
    for alloc in (first, second):
        offset = 0
        for ext in alloc.extensions:
            want = alloc.out_cache_loc[offset : offset + ext.new_len]
            got = m.table.locations(ext.slot, ext.prefix_len, ext.seq_len)
            assert torch.equal(got, want), (ext, got, want)
            offset += ext.new_len
    m.check_invariants()



def _state(m: KVCacheManager) -> tuple[object, ...]:
    """The manager's lengths and slots, free stacks and host table."""
    seqs = {s.seq_id: (s.slot, s.length) for s in m._seqs.values()}
    return (seqs, m.tokens.free_locations().tolist(), m.slots._free,
            m.table.host_table.tolist())


def _outcome(m: KVCacheManager, call: Callable[[], Allocation]
             ) -> tuple[Allocation | None, tuple[object, ...]]:
    """A call's allocation (None if it raised) and what it did: its extensions and
    locations, or its error, then the manager's state."""
    try:
        alloc = call()
    except (OutOfResources, ContextLengthExceeded) as e:
        return None, ((type(e), str(e)), _state(m))
    return alloc, ((alloc.extensions, alloc.out_cache_loc.tolist()), _state(m))


# Distinct ids per call, as validation guarantees (``allocate`` of an unknown id twice in
# one call takes a slot it never uses).
batches = st.lists(st.tuples(st.lists(st.integers(0, 6), min_size=1, max_size=6, unique=True),
                             st.integers(1, 4), st.booleans()), min_size=1, max_size=25)


@settings(max_examples=150, deadline=None)
@given(batches)
def test_extend_matches_allocate(calls: list[tuple[list[int], int, bool]]) -> None:
    """``extend`` (a decode step over the batch's columns) gives the same locations,
    table rows, lengths and errors as ``allocate`` of the same requests, whether it takes
    its fast path or hands over (unknown ids, a row overrun, too few tokens), and rolling
    either back restores the same state."""
    fast, ref = manager(tokens=48, slots=5, ctx=12), manager(tokens=48, slots=5, ctx=12)
    for who, n, undo in calls:
        ids = [f"s{w}" for w in who]
        got, did = _outcome(fast, lambda: fast.extend(ids, n))  # noqa: B023
        want, should = _outcome(ref, lambda: ref.allocate([(sid, n) for sid in ids]))  # noqa: B023
        assert did == should
        fast.check_invariants()
        if undo and got is not None and want is not None:
            fast.rollback(got)
            ref.rollback(want)
            assert _state(fast) == _state(ref)
            fast.check_invariants()


def test_extend_of_a_repeated_known_id_matches_allocate() -> None:
    fast, ref = manager(tokens=48, slots=5, ctx=12), manager(tokens=48, slots=5, ctx=12)
    for m in (fast, ref):
        m.allocate([("a", 2), ("b", 1)])
    got = _outcome(fast, lambda: fast.extend(["a", "b", "a"], 2))[1]
    assert got == _outcome(ref, lambda: ref.allocate([("a", 2), ("b", 2), ("a", 2)]))[1]
    fast.check_invariants()


def test_extend_rollback_restores_lengths_and_locations() -> None:
    m = manager(tokens=32, slots=3, ctx=16)
    m.allocate([("a", 5), ("b", 2)])
    before = _state(m)
    alloc = m.extend(["b", "a"], 3)
    assert [(e.seq_id, e.prefix_len, e.new_len, e.is_new) for e in alloc.extensions] == [
        ("b", 2, 3, False), ("a", 5, 3, False)]
    assert m.get("a").length == 8 and m.get("b").length == 5  # type: ignore[union-attr]
    m.check_invariants()
    m.rollback(alloc)
    assert _state(m)[:3] == before[:3]
    m.check_invariants()
