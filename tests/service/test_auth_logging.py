"""Issue 19, defect 10 and the log items: refusals by auth are logged at WARNING (they were
DEBUG for reflection and Executor/Health), rate-limited with a count of what was held back;
the per-RPC line carries an expected error's reason and message; the log level can come from
the environment."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import structlog
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from service.auth import AuthConfig, Secret
from service.cli import LOG_LEVEL_ENV, log_level
from service.config import ServerConfig
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.interceptors import RateLimiter
from service.logs import configure_logging
from tests.service.harness import ServerHarness

TOKEN = "s3cret"
CALLS = 20


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    config = structlog.get_config()
    stream = io.StringIO()
    configure_logging("json", "INFO", stream=stream)
    yield stream
    root.handlers, root.level = handlers, level
    structlog.configure(**config)
    structlog.contextvars.clear_contextvars()


def _events(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_auth_refusals_are_warnings_rate_limited(log_lines: io.StringIO) -> None:
    harness = ServerHarness(server_config=ServerConfig(
        port=0, metrics_port=0, auth=AuthConfig(token=Secret(TOKEN))))
    try:
        harness.wait_ready()
        reflection = reflection_pb2_grpc.ServerReflectionStub(harness.channel)
        for _ in range(CALLS):
            with pytest.raises(grpc.RpcError):
                harness.stub.Health(pb.HealthRequest(), timeout=5)
            with pytest.raises(grpc.RpcError):
                list(reflection.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                    timeout=5))
        auth = (("authorization", f"Bearer {TOKEN}"),)
        with pytest.raises(grpc.RpcError):  # an expected error: reason and message logged
            harness.stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(seq_id="nope")]),
                                timeout=5, metadata=auth)
        harness.stub.Prefill(pb.PrefillRequest(items=[  # an eager step: why, in the line
            pb.PrefillItem(seq_id="log", token_ids=[1, 2])]), timeout=10, metadata=auth)
        harness.stub.Release(pb.ReleaseRequest(seq_ids=["log"]), timeout=10, metadata=auth)
    finally:
        harness.close()
    events = _events(log_lines)
    refused = [e for e in events if e["event"] == "auth_refused"]
    assert sorted(e["rpc"] for e in refused) == ["Executor/Health",
                                                 "ServerReflection/ServerReflectionInfo"]
    assert all(e["level"] == "warning" and e["code"] == "UNAUTHENTICATED"
               and e["reason"] == "UNAUTHENTICATED" and "missing credentials" in e["message"]
               and e["held_back"] == 0 for e in refused)
    # the refusals held back are said at shutdown, not only by a later refusal of the kind
    held = [e for e in events if e["event"] == "auth_refused_held_back"]
    assert {e["rpc"]: (e["code"], e["held_back"]) for e in held} == {
        "Executor/Health": ("UNAUTHENTICATED", CALLS - 1),
        "ServerReflection/ServerReflectionInfo": ("UNAUTHENTICATED", CALLS - 1)}
    assert len(held) == 2 and all(e["level"] == "warning" for e in held)
    assert TOKEN not in log_lines.getvalue()
    decode = [e for e in events if e["event"] == "rpc" and e["rpc"] == "Executor/Decode"]
    assert decode[0]["code"] == "NOT_FOUND" and decode[0]["reason"] == "SEQUENCE_NOT_FOUND"
    assert "nope" in decode[0]["message"]
    prefill = [e for e in events if e["event"] == "rpc" and e["rpc"] == "Executor/Prefill"]
    assert prefill[0]["path"] == "eager" and prefill[0]["fallback_reason"] == "no_cuda"


def test_rate_limiter_counts_what_it_held_back() -> None:
    now = [0.0]
    limiter = RateLimiter(10.0, clock=lambda: now[0])
    assert limiter.allow("k") == 0
    assert [limiter.allow("k") for _ in range(5)] == [None] * 5
    assert limiter.allow("other") == 0
    now[0] = 10.5
    assert limiter.allow("k") == 5
    assert limiter.allow("k") is None


def test_held_back_counts_are_said_once_their_interval_is_over() -> None:
    """Counts wait for no later event: ``overdue`` takes those whose interval is over (the
    server asks every interval), and all of them at shutdown; each is said once."""
    now = [0.0]
    limiter = RateLimiter(10.0, clock=lambda: now[0])
    assert limiter.allow("a") == 0 and limiter.allow("a") is None
    now[0] = 4.0
    assert limiter.allow("b") == 0 and limiter.allow("b") is None and limiter.allow("b") is None
    assert limiter.overdue() == {}  # neither interval is over yet
    now[0] = 10.0
    assert limiter.overdue() == {"a": 1}
    assert limiter.overdue() == {}
    assert limiter.allow("a") is None  # the count was said at 10.0: a new interval began
    assert limiter.overdue(everything=True) == {"a": 1, "b": 2}
    assert limiter.overdue(everything=True) == {}


def test_log_level_from_the_environment() -> None:
    assert log_level(None, {}) == "INFO"
    assert log_level(None, {LOG_LEVEL_ENV: "debug"}) == "DEBUG"
    assert log_level("WARNING", {LOG_LEVEL_ENV: "debug"}) == "WARNING"
    with pytest.raises(ValueError, match=LOG_LEVEL_ENV):
        log_level(None, {LOG_LEVEL_ENV: "chatty"})


def test_rpc_log_errors_keeps_only_failed_calls(log_lines: io.StringIO) -> None:
    """``--rpc-log errors``: successful steps write no line (they are still counted), a
    refused call still does."""
    harness = ServerHarness(server_config=ServerConfig(port=0, metrics_port=0,
                                                       rpc_log="errors"))
    try:
        harness.wait_ready()
        log_lines.truncate(0)
        log_lines.seek(0)
        harness.stub.Prefill(pb.PrefillRequest(items=[
            pb.PrefillItem(seq_id="q", token_ids=[1, 2], sample=True)]), timeout=30)
        harness.stub.Release(pb.ReleaseRequest(seq_ids=["q"]), timeout=30)
        with pytest.raises(grpc.RpcError):
            harness.stub.Decode(pb.DecodeRequest(items=[
                pb.DecodeItem(seq_id="gone", token_id=1)]), timeout=30)
        rpcs = [e for e in _events(log_lines) if e.get("event") == "rpc"]
        assert [(e["rpc"], e["code"]) for e in rpcs] == [("Executor/Decode", "NOT_FOUND")]
        counted = harness.scrape()
        assert counted[("grpc_server_handled_total", (
            ("grpc_code", "OK"), ("grpc_method", "Prefill"),
            ("grpc_service", "model_executor.v1.Executor"), ("grpc_type", "unary")))] == 1
    finally:
        harness.close()
