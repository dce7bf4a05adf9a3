"""Idle ``Session`` streams cannot lock out the server (docs/reliability.md, "Session
admission and idle rules").

A Session (and the reflection stream grpcurl holds beside it) used to count against
``--max-concurrent-rpcs`` from the moment it opened, with no timeout: a few streams that
never sent a message made every Prefill, every new Session and reflection answer
OVERLOADED. Sessions now have their own budget
(``--max-session-streams``) and are closed after ``--session-idle-timeout`` seconds with
nothing to do (before the first step and between steps; never while a step is unanswered).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from service.config import ServerConfig
from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.system.reliability.figures import Figures
from tests.system.reliability.support import Gate, ServerHarness, details, serving, wait_until

CALLS, SESSIONS, IDLE_S = 4, 6, 1.0
IN_FLIGHT = "model_executor_calls_in_flight"


def _config() -> ServerConfig:
    return ServerConfig(port=0, metrics_port=0, grace_period_s=1.0, max_concurrent_rpcs=CALLS,
                        max_session_streams=SESSIONS, session_idle_timeout_s=IDLE_S)


def _in_flight(harness: ServerHarness, kind: str) -> float:
    return harness.scrape().get((IN_FLIGHT, (("kind", kind),)), 0.0)


def _session(harness: ServerHarness, stack: ExitStack, *requests: pb.SessionRequest
             ) -> Any:
    """A Session that sends ``requests`` and then nothing until ``stack`` closes."""
    done = threading.Event()
    stack.callback(done.set)

    def send() -> Iterator[pb.SessionRequest]:
        yield from requests
        done.wait(30)

    call = harness.stub.Session(send(), timeout=60)
    stack.callback(call.cancel)
    return call


def _reflection(harness: ServerHarness, stack: ExitStack) -> None:
    """A reflection stream held open after its first answer, as grpcurl holds one for as
    long as the call it resolved runs."""
    done = threading.Event()
    stack.callback(done.set)

    def ask() -> Iterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        done.wait(30)

    call = reflection_pb2_grpc.ServerReflectionStub(harness.channel).ServerReflectionInfo(
        ask(), timeout=60)
    stack.callback(call.cancel)
    assert next(call).list_services_response.service


def _prefill(seq_id: str) -> pb.PrefillRequest:
    return pb.PrefillRequest(items=[pb.PrefillItem(seq_id=seq_id, token_ids=[3, 4, 5],
                                                   sample=True)])


def _closed_idle(call: Any) -> grpc.RpcError:
    """The error that ended ``call`` (read to its end): it must be the idle timeout."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
        info: Any = details(err)["ErrorInfo"]
        assert info.reason == "SESSION_IDLE_TIMEOUT"
        assert "--session-idle-timeout" in str(err.details())
        return err
    raise AssertionError("the idle Session was not closed")


def test_idle_sessions_leave_the_call_budget_usable_and_time_out(figures: Figures) -> None:
    with serving(figures, server_config=_config()) as harness, ExitStack() as stack:
        opened = time.monotonic()
        idle = [_session(harness, stack) for _ in range(SESSIONS)]
        for _ in range(SESSIONS):  # grpcurl's way: each idle Session with its reflection
            _reflection(harness, stack)
        # More idle Sessions than the call budget: all open, none of them a "call".
        wait_until(lambda: _in_flight(harness, "call") + _in_flight(harness, "session")
                   >= CALLS, what="the Sessions to open")
        # The unary budget, reflection and health are all still usable.
        out = harness.stub.Prefill(_prefill("u1"), timeout=10).outputs[0]
        assert out.seq_len == 3
        services = ProtoReflectionDescriptorDatabase(harness.channel).get_services()
        assert "model_executor.v1.Executor" in services
        assert harness.ready() == 1  # SERVING
        wait_until(lambda: _in_flight(harness, "session") == SESSIONS,
                   what="every Session counted as a session")
        assert _in_flight(harness, "call") == 0
        # The Session budget is full: one more is refused at once, as overload.
        extra = _session(harness, stack)
        try:
            next(extra)
            raise AssertionError("a Session over the budget was admitted")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            found: Any = details(err)
            assert found["ErrorInfo"].reason == "SESSION_STREAMS_EXHAUSTED"
            assert found["RetryInfo"].retry_delay.ToNanoseconds() > 0
        # After the idle timeout every idle Session is closed; nothing leaks.
        for call in idle:
            _closed_idle(call)
        assert IDLE_S <= time.monotonic() - opened < IDLE_S + 5
        wait_until(lambda: _in_flight(harness, "session") == 0, what="Sessions to be gone")
        assert harness.scrape()[("model_executor_overload_refusals_total",
                                 (("kind", "session"),))] == 1
        harness.stub.Release(pb.ReleaseRequest(seq_ids=["u1"]), timeout=10)
        assert harness.kv().active_sequences == 0


def test_a_session_is_idle_only_with_nothing_unanswered(figures: Figures) -> None:
    """Between steps the idle clock runs from the last answer; a stream that keeps sending
    is never closed; a step held on the executor for longer than the timeout keeps its
    stream open, which is idle only from that step's answer on."""
    with serving(figures, server_config=_config()) as harness, ExitStack() as stack:
        quiet = _session(harness, stack, pb.SessionRequest(step=1, prefill=_prefill("q")))
        assert next(quiet).prefill.outputs[0].seq_len == 3
        answered_at = time.monotonic()

        def busy() -> Iterator[pb.SessionRequest]:
            for step in range(1, 7):  # 2.4 idle timeouts in all, never idle as long as one
                yield pb.SessionRequest(step=step, truncate=pb.TruncateRequest(
                    seq_id="q", length=3))
                time.sleep(IDLE_S * 0.4)

        busy_answers = list(harness.stub.Session(busy(), timeout=30))
        assert [r.WhichOneof("result") for r in busy_answers] == ["truncate"] * 6
        _closed_idle(quiet)  # answered, then nothing: closed one timeout after its answer
        assert time.monotonic() - answered_at >= IDLE_S
        with Gate(harness, "launch_prefill", hold="slow") as gate:
            slow = _session(harness, stack, pb.SessionRequest(step=1,
                                                              prefill=_prefill("slow")))
            assert gate.entered.wait(10)
            time.sleep(IDLE_S * 1.5)
            assert _in_flight(harness, "session") == 1  # still open: a step is unanswered
            gate.open()
            held_until = time.monotonic()
            assert next(slow).prefill.outputs[0].seq_len == 3
        _closed_idle(slow)
        assert time.monotonic() - held_until >= IDLE_S * 0.9
        harness.stub.Release(pb.ReleaseRequest(seq_ids=["q", "slow"]), timeout=10)
        wait_until(lambda: _in_flight(harness, "session") == 0, what="Sessions to be gone")
        assert harness.kv().active_sequences == 0
