"""Idempotent retries over a live server: a retry with the same request_id gets the
original response and appends nothing; another call under a used id is INVALID_ARGUMENT;
failures are not remembered; Release and the cache's bounds drop entries, and a late retry
of a dropped one is ABORTED rather than run twice."""

from __future__ import annotations

import grpc

from service.config import RetryCacheConfig, ServerConfig
from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.system.reliability.figures import Figures
from tests.system.reliability.support import (
    Gate,
    ServerHarness,
    check_kv,
    details,
    rpc_error,
    serving,
)

CACHE = RetryCacheConfig(max_entries=8, per_sequence=2, max_forgotten=64)
SERVER_CONFIG = ServerConfig(port=0, metrics_port=0, retry_cache=CACHE)


def prefill(seq_id: str, request_id: str, tokens: tuple[int, ...] = (1, 2, 3)
            ) -> pb.PrefillRequest:
    return pb.PrefillRequest(request_id=request_id, items=[
        pb.PrefillItem(seq_id=seq_id, token_ids=tokens, sample=True)])


def decode(seq_id: str, token: int, request_id: str) -> pb.DecodeRequest:
    return pb.DecodeRequest(request_id=request_id, items=[pb.DecodeItem(seq_id=seq_id,
                                                                        token_id=token)])


def metric(server: ServerHarness, name: str, **labels: str) -> float:
    return server.scrape().get((name, tuple(sorted(labels.items()))), 0.0)


def test_retry_gets_the_original_response_and_appends_nothing(server: ServerHarness,
                                                              figures: Figures) -> None:
    baseline = check_kv(server, figures)
    first = server.stub.Prefill(prefill("r", "r-p"), timeout=10)
    after_prefill = check_kv(server, figures)
    again = server.stub.Prefill(prefill("r", "r-p"), timeout=10)
    assert again.SerializeToString() == first.SerializeToString()  # the very same response
    check_kv(server, figures, expected=after_prefill)
    step = server.stub.Decode(decode("r", first.outputs[0].token_id, "r-d1"), timeout=10)
    after_decode = check_kv(server, figures)
    for _ in range(3):
        assert server.stub.Decode(decode("r", first.outputs[0].token_id, "r-d1"),
                                  timeout=10) == step
    check_kv(server, figures, expected=after_decode)
    assert step.outputs[0].seq_len == 4 and after_decode.free_tokens == \
        baseline.free_tokens - 4
    assert metric(server, "model_executor_retry_cache_hits_total", method="Decode") >= 3
    assert 0 < metric(server, "model_executor_retry_cache_entries") <= CACHE.max_entries
    server.stub.Release(pb.ReleaseRequest(seq_ids=["r"]), timeout=10)
    check_kv(server, figures, expected=baseline)


def test_another_call_under_a_used_id_is_invalid_argument(server: ServerHarness,
                                                          figures: Figures) -> None:
    first = server.stub.Prefill(prefill("u", "u-1"), timeout=10)
    before = check_kv(server, figures)
    for fn, request in ((server.stub.Prefill, prefill("u", "u-1", (1, 2, 4))),  # body
                        (server.stub.Prefill, prefill("u2", "u-1")),  # seq_id
                        (server.stub.Decode, decode("u", 3, "u-1"))):  # method
        err = rpc_error(fn, request)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        [violation] = details(err)["BadRequest"].field_violations  # type: ignore[attr-defined]
        assert violation.field == "request_id" and "different call" in violation.description
    check_kv(server, figures, expected=before)
    assert server.stub.Prefill(prefill("u", "u-1"), timeout=10) == first  # still retryable
    server.stub.Release(pb.ReleaseRequest(seq_ids=["u"]), timeout=10)


def test_failures_are_not_remembered(server: ServerHarness, figures: Figures) -> None:
    baseline = check_kv(server, figures)
    err = rpc_error(server.stub.Decode, decode("f", 1, "f-d1"))
    assert err.code() == grpc.StatusCode.NOT_FOUND  # nothing applied, nothing kept
    server.stub.Prefill(prefill("f", "f-p"), timeout=10)
    assert server.stub.Decode(decode("f", 1, "f-d1"), timeout=10).outputs[0].seq_len == 4
    server.stub.Release(pb.ReleaseRequest(seq_ids=["f"]), timeout=10)
    check_kv(server, figures, expected=baseline)


def test_release_drops_entries_and_a_late_retry_is_aborted(server: ServerHarness,
                                                           figures: Figures) -> None:
    baseline = check_kv(server, figures)
    released = metric(server, "model_executor_retry_cache_evictions_total", reason="release")
    server.stub.Prefill(prefill("gone", "gone-p"), timeout=10)
    server.stub.Release(pb.ReleaseRequest(seq_ids=["gone"]), timeout=10)
    err = rpc_error(server.stub.Prefill, prefill("gone", "gone-p"))
    assert err.code() == grpc.StatusCode.ABORTED  # not re-admitted behind the scheduler
    info = details(err)["ErrorInfo"]
    assert info.reason == "RESPONSE_EXPIRED"  # type: ignore[attr-defined]
    assert "released" in info.metadata["why"]  # type: ignore[attr-defined]
    check_kv(server, figures, expected=baseline)
    assert metric(server, "model_executor_retry_cache_evictions_total",
                  reason="release") == released + 1


def test_bounds_evict_oldest_and_evicted_retries_are_aborted(server: ServerHarness,
                                                             figures: Figures) -> None:
    baseline = check_kv(server, figures)
    first = server.stub.Prefill(prefill("b0", "b0-p"), timeout=10)
    token = first.outputs[0].token_id
    steps = [server.stub.Decode(decode("b0", token, f"b0-d{i}"), timeout=10)
             for i in range(3)]  # per_sequence=2: b0-p and b0-d0 are dropped
    for request_id in ("b0-p", "b0-d0"):
        request = prefill("b0", "b0-p") if request_id == "b0-p" else \
            decode("b0", token, "b0-d0")
        fn = server.stub.Prefill if request_id == "b0-p" else server.stub.Decode
        err = rpc_error(fn, request)
        assert err.code() == grpc.StatusCode.ABORTED
        assert "same sequence" in details(err)["ErrorInfo"].metadata["why"]  # type: ignore[attr-defined]
    assert server.stub.Decode(decode("b0", token, "b0-d2"), timeout=10) == steps[2]
    # capacity: 8 entries in all; 9 more sequences push b0's out
    for i in range(1, 10):
        server.stub.Prefill(prefill(f"b{i}", f"b{i}-p"), timeout=10)
    assert metric(server, "model_executor_retry_cache_entries") == CACHE.max_entries
    err = rpc_error(server.stub.Decode, decode("b0", token, "b0-d2"))
    assert err.code() == grpc.StatusCode.ABORTED
    assert metric(server, "model_executor_retry_cache_evictions_total",
                  reason="capacity") >= 1
    before = check_kv(server, figures)
    assert server.stub.Prefill(prefill("b9", "b9-p"), timeout=10).outputs[0].seq_len == 3
    check_kv(server, figures, expected=before)
    server.stub.Release(pb.ReleaseRequest(seq_ids=[f"b{i}" for i in range(10)]), timeout=10)
    check_kv(server, figures, expected=baseline)


def test_retry_queued_behind_its_original_runs_nothing(server: ServerHarness,
                                                       figures: Figures) -> None:
    """Original and retry both wait behind a slow step; the original runs, the retry gets
    its response (the check happens on the executor thread, in order)."""
    baseline = check_kv(server, figures)
    with Gate(server, "prefill", hold="blocker") as gate:
        blocker = server.stub.Prefill.future(prefill("blocker", ""), timeout=30)
        assert gate.entered.wait(10)
        original = server.stub.Prefill.future(prefill("twice", "twice-p"), timeout=30)
        retry = server.stub.Prefill.future(prefill("twice", "twice-p"), timeout=30)
        gate.open()
        blocker.result()
        assert original.result() == retry.result()
    assert gate.calls.count(["twice"]) == 1
    stats = check_kv(server, figures)
    assert stats.free_tokens == baseline.free_tokens - 6  # blocker 3 + twice 3
    server.stub.Release(pb.ReleaseRequest(seq_ids=["blocker", "twice"]), timeout=10)
    check_kv(server, figures, expected=baseline)


def test_a_kept_response_is_answered_while_draining(figures: Figures) -> None:
    """A retry whose step ran is answered even once new steps are refused (it runs
    nothing, and it tells the scheduler the step was applied)."""
    from service.config import ServerConfig as Config

    with serving(figures, server_config=Config(port=0, metrics_port=0,
                                               drain_delay_s=1.0)) as harness:
        first = harness.stub.Prefill(prefill("dr", "dr-p"), timeout=10)
        stop = harness.stop_in_background(grace=1.0)
        try:
            err = rpc_error(harness.stub.Prefill, prefill("dr2", "dr2-p"))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert harness.stub.Prefill(prefill("dr", "dr-p"), timeout=10) == first
        finally:
            stop.result(timeout=10)
