"""The retry cache on its own: property tests against a plain model of its rules (bounds
always hold; a kept id answers with its response; a dropped one is ABORTED; a different
call under a used id is refused), and its metric labels."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from service.config import RetryCacheConfig
from service.errors import ResponseExpired
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.idempotency import _WHY, Key, RequestIdReused, ResponseCache, digest
from service.metrics import RETRY_EVICTION_REASONS
from tests.system.reliability.budget import BUDGET


def response(n: int) -> pb.PrefillResponse:
    return pb.PrefillResponse(outputs=[pb.ItemOutput(seq_id=f"s{i}", seq_len=i)
                                    for i in range(n)])


ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 30), st.lists(st.sampled_from("abcde"),
                                                           min_size=1, max_size=3),
              st.integers(0, 40)),
    st.tuples(st.just("drop"), st.lists(st.sampled_from("abcde"), min_size=1, max_size=2)),
), max_size=60)


@settings(max_examples=BUDGET.fuzz_examples * 5, deadline=None)
@given(ops=ops, max_entries=st.integers(1, 6), per_sequence=st.integers(1, 3),
       max_bytes=st.integers(300, 2000))
def test_bounds_and_answers(ops: list, max_entries: int, per_sequence: int,  # type: ignore[type-arg]
                            max_bytes: int) -> None:
    config = RetryCacheConfig(max_entries=max_entries, max_bytes=max_bytes,
                              per_sequence=per_sequence, max_forgotten=10_000)
    evictions: list[str] = []
    cache = ResponseCache(config, evictions.append)
    stored: dict[str, pb.PrefillResponse] = {}
    for op in ops:
        if op[0] == "put":
            _, n, seqs, size = op
            rid = f"r{n}"
            key = Key(rid, digest("Decode", pb.DecodeRequest(request_id=rid)))
            try:
                hit = cache.get(key)
            except ResponseExpired:
                continue  # a dropped id is never run (nor stored) again
            if hit is not None:
                assert hit is stored[rid]
                continue
            stored[rid] = response(size)
            cache.put(key, seqs, stored[rid])
        else:
            cache.drop_sequences(op[1])
        entries, size_bytes = cache.size()
        assert entries <= max_entries and size_bytes <= max_bytes
        assert all(len(ids) <= per_sequence for ids in cache._by_seq.values())
        assert set(cache._entries).isdisjoint(cache._forgotten)
    assert set(evictions) <= set(RETRY_EVICTION_REASONS)
    for rid, kept in stored.items():  # every stored call is answered or refused, never lost
        key = Key(rid, digest("Decode", pb.DecodeRequest(request_id=rid)))
        try:
            assert cache.get(key) is kept
        except ResponseExpired:
            assert rid in cache._forgotten


def test_reused_ids_and_disabled_cache() -> None:
    cache = ResponseCache(RetryCacheConfig(max_entries=2, max_bytes=10_000))
    a = pb.PrefillRequest(request_id="x", items=[pb.PrefillItem(seq_id="s", token_ids=[1])])
    b = pb.PrefillRequest(request_id="x", items=[pb.PrefillItem(seq_id="s", token_ids=[2])])
    key_a, key_b = cache.key("Prefill", a), cache.key("Prefill", b)
    assert key_a is not None and key_b is not None and key_a.digest != key_b.digest
    assert cache.key("Prefill", pb.PrefillRequest()) is None  # no request_id: no retry
    cache.put(key_a, ["s"], response(1))
    try:
        cache.get(key_b)
        raise AssertionError("a different body under a used id was accepted")
    except RequestIdReused as exc:
        assert exc.violations[0].field == "request_id"
    cache.drop_sequences(["s"])
    try:
        cache.get(key_b)  # still a different call, also after the entry was dropped
        raise AssertionError("accepted")
    except RequestIdReused:
        pass
    off = ResponseCache(RetryCacheConfig(max_entries=0))
    assert not off.enabled and off.key("Prefill", a) is None


def test_too_large_responses_are_refused_on_retry() -> None:
    cache = ResponseCache(RetryCacheConfig(max_bytes=100))
    key = Key("big", b"d")
    cache.put(key, ["s"], response(50))
    try:
        cache.get(key)
        raise AssertionError("a response too large to keep was answered")
    except ResponseExpired as exc:
        assert "too large" in str(exc)


def test_reasons_match_the_metric_labels() -> None:
    assert set(_WHY) == set(RETRY_EVICTION_REASONS)
