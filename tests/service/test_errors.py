"""Every status code a client can get, over a real channel, with its google.rpc details."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.service.harness import ServerHarness, tiny_config


def rpc_error(fn: Any, request: Message, timeout: float = 10) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(request, timeout=timeout)
    return info.value


def status_of(err: grpc.RpcError) -> status_pb2.Status:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, "no grpc-status-details-bin trailer"
    return status


def details(err: grpc.RpcError) -> dict[type, Any]:
    out: dict[type, Any] = {}
    for detail in status_of(err).details:
        for cls in (error_details_pb2.BadRequest, error_details_pb2.ResourceInfo,
                    error_details_pb2.QuotaFailure, error_details_pb2.ErrorInfo,
                    error_details_pb2.RetryInfo, error_details_pb2.PreconditionFailure):
            if detail.Is(cls.DESCRIPTOR):
                msg = cls()
                detail.Unpack(msg)
                out.setdefault(cls, []).append(msg)
    return out


def field_violations(err: grpc.RpcError) -> dict[str, str]:
    [bad] = details(err)[error_details_pb2.BadRequest]
    return {v.field: v.description for v in bad.field_violations}


def prefill(*items: pb.PrefillItem) -> pb.PrefillRequest:
    return pb.PrefillRequest(items=items)


@pytest.fixture(scope="module")
def small() -> Iterator[ServerHarness]:
    """A server with a tiny KV cache: 64 token locations, 4 sequence slots."""
    harness = ServerHarness(tiny_config(kv_tokens=64, max_sequences=4, max_context=48))
    try:
        harness.wait_ready()
        yield harness
    finally:
        harness.close()


def test_invalid_argument_lists_every_field(server: ServerHarness) -> None:
    baseline = server.kv()
    bad_sampling = pb.SamplingParams(top_p=1.5, top_logprobs=21)
    err = rpc_error(server.stub.Prefill, prefill(
        pb.PrefillItem(seq_id="ok", token_ids=[1]),
        pb.PrefillItem(seq_id="s1", token_ids=[1], sampling=bad_sampling)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert set(field_violations(err)) == {"items[1].sampling.top_p",
                                          "items[1].sampling.top_logprobs"}
    # the executor's own checks travel the same way
    err = rpc_error(server.stub.Prefill, prefill(
        pb.PrefillItem(seq_id="a", token_ids=[1, 512]), pb.PrefillItem(seq_id="b"),
        pb.PrefillItem(seq_id="a", token_ids=[1])))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert set(field_violations(err)) >= {"items[0].token_ids[1]", "items[1].token_ids",
                                          "items[2].seq_id"}
    err = rpc_error(server.stub.Prefill, prefill(pb.PrefillItem(seq_id="long",
                                                                token_ids=[1] * 513)))
    assert "max_context" in field_violations(err)["items[0].token_ids"]
    assert server.kv() == baseline  # nothing allocated


def test_not_found_names_the_sequence(server: ServerHarness) -> None:
    server.stub.Prefill(prefill(pb.PrefillItem(seq_id="known", token_ids=[1])), timeout=10)
    try:
        err = rpc_error(server.stub.Decode, pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id="known", token_id=1), pb.DecodeItem(seq_id="ghost")]))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        [info] = details(err)[error_details_pb2.ResourceInfo]
        assert info.resource_name == "ghost" and "items[1].seq_id" in info.description
        assert server.kv().free_tokens == server.kv().total_tokens - 1  # known not extended
    finally:
        server.stub.Release(pb.ReleaseRequest(seq_ids=["known"]), timeout=10)


def test_resource_exhausted_kv_tokens_then_recovers(small: ServerHarness) -> None:
    small.stub.Prefill(prefill(pb.PrefillItem(seq_id="a", token_ids=[1] * 40)), timeout=10)
    before = small.kv()
    err = rpc_error(small.stub.Prefill, prefill(pb.PrefillItem(seq_id="b", token_ids=[2] * 8),
                                                pb.PrefillItem(seq_id="c", token_ids=[3] * 30)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    found = details(err)
    [quota] = found[error_details_pb2.QuotaFailure]
    assert quota.violations[0].subject == "kv_tokens"
    [info] = found[error_details_pb2.ErrorInfo]
    assert (info.metadata["needed"], info.metadata["free"]) == ("38", "24")
    assert found[error_details_pb2.RetryInfo][0].retry_delay.ToNanoseconds() > 0
    assert small.kv() == before  # nothing allocated, not even for "b"
    small.stub.Release(pb.ReleaseRequest(seq_ids=["a"]), timeout=10)
    small.stub.Prefill(prefill(pb.PrefillItem(seq_id="c", token_ids=[3] * 30)), timeout=10)
    small.stub.Release(pb.ReleaseRequest(seq_ids=["c"]), timeout=10)
    metrics = small.scrape()
    assert metrics[("model_executor_kv_allocation_failures_total",
                    (("resource", "kv_tokens"),))] == 1


def test_resource_exhausted_sequence_slots(small: ServerHarness) -> None:
    ids = [f"slot{i}" for i in range(4)]
    small.stub.Prefill(prefill(*(pb.PrefillItem(seq_id=s, token_ids=[1]) for s in ids)),
                       timeout=10)
    try:
        err = rpc_error(small.stub.Prefill, prefill(pb.PrefillItem(seq_id="one-more",
                                                                   token_ids=[1])))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        [info] = details(err)[error_details_pb2.ErrorInfo]
        assert info.reason == "SEQUENCE_SLOTS_EXHAUSTED"
        assert (info.metadata["needed"], info.metadata["free"]) == ("1", "0")
    finally:
        small.stub.Release(pb.ReleaseRequest(seq_ids=ids), timeout=10)


def test_capture_on_cpu_is_failed_precondition(server: ServerHarness) -> None:
    err = rpc_error(server.stub.Capture, pb.CaptureRequest(phases=[pb.PHASE_DECODE]))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "CUDA" in err.details()
    [failure] = details(err)[error_details_pb2.PreconditionFailure]
    assert failure.violations[0].type == "CUDA_GRAPHS"


def test_internal_for_a_bug_carries_the_request_id(server: ServerHarness,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("injected fault")

    monkeypatch.setattr(server.executor, "decode", broken)
    err = rpc_error(server.stub.Decode, pb.DecodeRequest(request_id="req-42", items=[
        pb.DecodeItem(seq_id="x", token_id=1)]))
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "req-42" in err.details() and "ZeroDivisionError" in err.details()
    assert dict(err.trailing_metadata())["x-request-id"] == "req-42"  # type: ignore[attr-defined]
    [info] = details(err)[error_details_pb2.ErrorInfo]
    assert info.metadata["request_id"] == "req-42"
    monkeypatch.undo()
    assert server.ready() == 1  # a bug is not a device failure: still SERVING


def test_deadline_passed_in_the_queue_never_runs(server: ServerHarness,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A call whose deadline passes while an earlier step holds the executor thread gets
    DEADLINE_EXCEEDED and never touches the KV cache; Health answers meanwhile."""
    release = threading.Event()
    real_prefill = server.executor.prefill

    def slow_prefill(items: Any) -> Any:
        if items[0].seq_id == "blocker":
            release.wait(10)
        return real_prefill(items)

    monkeypatch.setattr(server.executor, "prefill", slow_prefill)
    baseline = server.kv()
    blocker = server.stub.Prefill.future(prefill(pb.PrefillItem(seq_id="blocker",
                                                                token_ids=[1])), timeout=20)
    try:
        deadline = time.monotonic() + 5
        while server.stub.Health(pb.HealthRequest(), timeout=1).pending_calls < 1:
            assert time.monotonic() < deadline
        started = time.monotonic()
        health = server.stub.Health(pb.HealthRequest(), timeout=1)  # not stuck behind it
        assert health.state == pb.SERVER_STATE_READY and time.monotonic() - started < 5
        assert server.ready() == 1
        err = rpc_error(server.stub.Prefill, prefill(pb.PrefillItem(seq_id="late",
                                                                    token_ids=[1])), timeout=0.3)
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        release.set()
        blocker.result()
    assert server.kv().active_sequences == baseline.active_sequences + 1  # "late" never ran
    server.stub.Release(pb.ReleaseRequest(seq_ids=["blocker", "late"]), timeout=10)
    assert server.kv() == baseline


@pytest.mark.parametrize("request_id", ["line\nbreak", "café-1", "tab\there"])
def test_any_request_id_is_echoed_as_valid_metadata(server: ServerHarness,
                                                    request_id: str) -> None:
    """A request id with characters metadata cannot carry does not fail the call: the
    ``x-request-id`` trailer carries it percent-encoded."""
    response, call = server.stub.Release.with_call(
        pb.ReleaseRequest(request_id=request_id, seq_ids=["nobody"]))
    assert list(response.unknown_seq_ids) == ["nobody"]
    echoed = dict(call.trailing_metadata())["x-request-id"]
    assert echoed.isascii() and echoed.isprintable()
    from urllib.parse import unquote

    assert unquote(echoed) == request_id


def test_header_request_id_is_per_call(server: ServerHarness) -> None:
    """Without a body request_id the x-request-id header names the call; handlers are
    wrapped once per method, so a later call must not inherit an earlier call's header."""
    _, first = server.stub.Health.with_call(pb.HealthRequest(), timeout=5,
                                            metadata=[("x-request-id", "hdr-7")])
    assert dict(first.trailing_metadata())["x-request-id"] == "hdr-7"  # type: ignore[attr-defined]
    _, second = server.stub.Health.with_call(pb.HealthRequest(), timeout=5)
    generated = dict(second.trailing_metadata())["x-request-id"]  # type: ignore[attr-defined]
    assert generated and generated != "hdr-7"
    _, third = server.stub.Health.with_call(pb.HealthRequest(), timeout=5,
                                            metadata=[("x-request-id", "hdr-8")])
    assert dict(third.trailing_metadata())["x-request-id"] == "hdr-8"  # type: ignore[attr-defined]
