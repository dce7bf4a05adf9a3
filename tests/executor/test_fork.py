"""Fork: a child sequence shares its parent's prefix KV (reference-counted, never copied).

A state machine drives the KV manager through admit / extend / decode / fork / truncate /
release on many sequences; executor tests check that a forked child computes exactly
what a fresh sequence with the same tokens computes, whatever its relatives do next.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from executor.api import DecodeItem, PrefillItem, SamplingParams
from executor.config import CacheConfig, ExecutorConfig
from executor.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    OutOfResources,
    SequenceNotFound,
)
from executor.executor import Executor
from executor.kv import KVCacheManager, ReqToTokenTable

SEEDED = SamplingParams(temperature=0.8, seed=21, logprobs=True, top_logprobs=2)
IDS = [f"s{i}" for i in range(8)]


class ForkMachine(RuleBasedStateMachine):
    """Random admit / extend / decode / fork / truncate / release / rollback; after each,
    the manager's invariants (exact accounting, reference counts equal holders) hold, and
    every allocation hands out only locations no live sequence holds."""

    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(ReqToTokenTable(6, 48, torch.device("cpu")), 96)

    def live(self) -> list[str]:
        return [sid for sid in IDS if sid in self.m]

    def held(self) -> torch.Tensor:
        rows = [self.m.table.locations(s.slot, 0, s.length)
                for s in (self.m.get(sid) for sid in self.live()) if s is not None]
        return torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64)

    def allocate(self, requests: list[tuple[str, int]]) -> None:
        before = self.held()
        try:
            alloc = self.m.allocate(requests)
        except (OutOfResources, ContextLengthExceeded):  # refused whole (the invariants)
            return
        # Appends never land on a location that any sequence (a fork's relative) holds.
        assert not bool(torch.isin(alloc.out_cache_loc, before).any())

    @rule(sid=st.sampled_from(IDS), n=st.integers(1, 12))
    def prefill(self, sid: str, n: int) -> None:
        self.allocate([(sid, n)])

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        sids = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, unique=True))
        self.allocate([(sid, 1) for sid in sids])

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data(), child=st.sampled_from(IDS))
    def fork(self, data: st.DataObject, child: str) -> None:
        parent = data.draw(st.sampled_from(self.live()))
        state = self.m.get(parent)
        assert state is not None
        if child in self.m:
            return
        prefix = data.draw(st.integers(0, state.length))
        free_before = self.m.stats().free_tokens
        try:
            self.m.fork(parent, child, prefix)
        except OutOfResources:
            assert child not in self.m
            return
        assert self.m.stats().free_tokens == free_before  # sharing takes no location
        assert torch.equal(self.m.table.locations(self.m.get(child).slot, 0, prefix),  # type: ignore[union-attr]
                           self.m.table.locations(state.slot, 0, prefix))

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.live()))
        state = self.m.get(sid)
        assert state is not None
        length = data.draw(st.integers(0, state.length))
        tail = self.m.table.locations(state.slot, length, state.length)
        others = [self.m.table.locations(s.slot, 0, s.length)
                  for s in (self.m.get(o) for o in self.live() if o != sid) if s is not None]
        shared = torch.isin(tail, torch.cat(others)) if others else torch.zeros_like(tail,
                                                                                    dtype=torch.bool)
        free_before = self.m.stats().free_tokens
        freed = self.m.truncate(sid, length)
        # Exactly the tail locations that no other sequence holds go back.
        assert freed == int((~shared).sum())
        assert self.m.stats().free_tokens == free_before + freed

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        sids = data.draw(st.lists(st.sampled_from(IDS), min_size=1, max_size=3, unique=True))
        before = self.m.stats()
        try:
            alloc = self.m.allocate([(sid, 2) for sid in sids])
        except OutOfResources:
            return
        self.m.rollback(alloc)
        assert self.m.stats() == before

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.live()))
        free_before = self.m.stats().free_tokens
        freed = self.m.release(sid)
        assert freed is not None and self.m.stats().free_tokens == free_before + freed

    @invariant()
    def accounting(self) -> None:
        self.m.check_invariants()

    def teardown(self) -> None:
        for sid in self.live():
            self.m.release(sid)
        stats = self.m.stats()
        assert (stats.free_tokens, stats.free_slots, stats.shared_tokens,
                stats.forked_sequences) == (stats.total_tokens, stats.total_slots, 0, 0)


TestForkMachine = ForkMachine.TestCase
TestForkMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# -- the executor ------------------------------------------------------------------------
def make(max_sequences: int = 8) -> Executor:
    return Executor(ExecutorConfig(cache=CacheConfig(kv_tokens=2048,
                                                     max_sequences=max_sequences,
                                                     max_context=256)))


@pytest.fixture(scope="module")
def pair() -> tuple[Executor, Executor]:
    return make(), make()


def decode_n(ex: Executor, sid: str, token: int | None, n: int,
             sampling: SamplingParams) -> list[tuple[int, float | None, int]]:
    out = []
    for _ in range(n):
        o = ex.decode([DecodeItem(sid, token, sampling)]).outputs[0]
        assert o.token_id is not None
        out.append((o.token_id, o.logprob, o.seq_len))
        token = o.token_id
    return out


def same(a: list[tuple[int, float | None, int]], b: list[tuple[int, float | None, int]]
         ) -> None:
    assert [(t, n) for t, _, n in a] == [(t, n) for t, _, n in b]
    for (_, la, _), (_, lb, _) in zip(a, b, strict=True):
        assert (la is None) == (lb is None)
        if la is not None:
            assert la == pytest.approx(lb, abs=1e-4)


@pytest.mark.parametrize("sampling", [SamplingParams(logprobs=True), SEEDED],
                         ids=["greedy", "seeded"])
def test_a_forked_child_decodes_like_a_fresh_sequence(pair: tuple[Executor, Executor],
                                                      sampling: SamplingParams) -> None:
    """Children forked at the end and in the middle of a parent, then extended and decoded,
    equal fresh sequences prefilled with the same tokens — while the parent and a sibling
    go on, are truncated below the shared prefix and re-extended with other tokens."""
    ref, ex = pair
    prompt = [3, 17, 4, 99, 23, 8, 61, 5]
    ex.prefill([PrefillItem("p", prompt, sampling=sampling)])
    full = ex.fork("p", "c_all")
    assert (full.seq_len, full.shared_tokens) == (8, 8)
    half = ex.fork("p", "c_half", prefix_len=5)
    assert (half.seq_len, half.has_last_sampled) == (5, False)
    assert ex.kv_stats().shared_tokens == 8 and ex.kv_stats().forked_sequences == 2
    # The parent rewrites its tail and beyond: the children's shared KV must not change.
    ex.truncate("p", 2)
    ex.prefill([PrefillItem("p", [70, 71, 72, 73, 74, 75], sampling=sampling)])
    decode_n(ex, "p", 9, 3, sampling)

    suffix = [44, 45, 46]
    got_half = ex.prefill([PrefillItem("c_half", suffix, sampling=sampling)]).outputs[0]
    want_half = ref.prefill([PrefillItem("r_half", prompt[:5] + suffix,
                                         sampling=sampling)]).outputs[0]
    assert (got_half.token_id, got_half.seq_len) == (want_half.token_id, want_half.seq_len)
    assert got_half.logprob == pytest.approx(want_half.logprob, abs=1e-4)
    assert got_half.token_id is not None
    same(decode_n(ex, "c_half", got_half.token_id, 4, sampling),
         decode_n(ref, "r_half", want_half.token_id, 4, sampling))

    want_all = ref.prefill([PrefillItem("r_all", prompt, sampling=sampling)]).outputs[0]
    assert want_all.token_id is not None
    # c_all shares all of the parent as it was, and inherited its last sampled token.
    assert full.has_last_sampled
    same(decode_n(ex, "c_all", None, 4, sampling),
         decode_n(ref, "r_all", want_all.token_id, 4, sampling))
    for e in pair:
        e.release([s for s in ("p", "c_all", "c_half", "r_half", "r_all") if s in e.kv])
        e.kv.check_invariants()
        assert e.kv_stats().free_tokens == e.kv_stats().total_tokens


def test_forks_of_forks_and_exact_release_accounting(pair: tuple[Executor, Executor]) -> None:
    _, ex = pair
    total = ex.kv_stats().total_tokens
    ex.prefill([PrefillItem("a", list(range(1, 11)))])  # 10 tokens
    ex.fork("a", "b", prefix_len=6)
    ex.fork("b", "c", prefix_len=4)  # a grandchild
    ex.prefill([PrefillItem("b", [50, 51])])  # b: 6 shared + 2 of its own
    stats = ex.kv_stats()
    assert stats.used_tokens == 12 and stats.shared_tokens == 6
    assert stats.forked_sequences == 2
    # Releasing the root frees only its unshared tail; shared locations stay in use.
    result = ex.release(["a"])
    assert (result.released, result.freed_tokens) == (1, 4)
    assert ex.kv_stats().shared_tokens == 4  # b and c still share 4
    # Positions 3..7 leave b: 3 stays with c, the rest no one else holds.
    assert ex.truncate("b", 3).freed_tokens == 4
    assert ex.kv_stats().shared_tokens == 3
    assert ex.release(["b", "c"]).freed_tokens == 4
    ex.kv.check_invariants()
    stats = ex.kv_stats()
    assert (stats.free_tokens, stats.shared_tokens, stats.forked_sequences) == (total, 0, 0)


def test_bad_forks_change_nothing() -> None:
    ex = make(max_sequences=2)
    ex.prefill([PrefillItem("p", [1, 2, 3], sample=False)])
    before = ex.kv_stats()
    with pytest.raises(SequenceNotFound, match="nope"):
        ex.fork("nope", "c")
    with pytest.raises(InvalidRequest, match="child_seq_id: sequence 'p' already exists"):
        ex.fork("p", "p")
    for bad in (-1, 4):
        with pytest.raises(InvalidRequest, match=r"prefix_len: must be in \[0, 3\]"):
            ex.fork("p", "c", prefix_len=bad)
    assert ex.kv_stats() == before and "c" not in ex.kv
    child = ex.fork("p", "c")
    assert not child.has_last_sampled  # the parent's last step sampled nothing
    with pytest.raises(InvalidRequest, match="no sampled token to continue from"):
        ex.decode([DecodeItem("c", None)])
    before = ex.kv_stats()
    with pytest.raises(OutOfResources) as info:  # both slots are taken
        ex.fork("p", "d")
    assert info.value.resource == "sequence_slots"
    assert ex.kv_stats() == before and "d" not in ex.kv
    ex.release(["p", "c"])
    ex.kv.check_invariants()
