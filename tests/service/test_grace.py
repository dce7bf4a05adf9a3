"""Issue 19, defect 8: the grace period bounds the stop, and callers are told the truth.

A step longer than the grace period used to be answered UNAVAILABLE ("not applied") after
the grace period although it completed and applied, and the process exited seconds later.
Now: a call still queued at the end of the grace period is UNAVAILABLE (it never ran), the
call whose step is still running is CANCELLED with reason STEP_OUTCOME_UNKNOWN, and the stop
returns at once; a step that ends within the grace period gets its real answer."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from service.config import ServerConfig
from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.reliability.support import Gate, details, pending, wait_until
from tests.service.harness import ServerHarness


def _prefill(harness: ServerHarness, seq_id: str) -> pb.PrefillResponse:
    request = pb.PrefillRequest(items=[pb.PrefillItem(seq_id=seq_id, token_ids=[3, 4, 5],
                                                      sample=True)])
    return harness.stub.Prefill(request, timeout=30)


def _error(future: object) -> grpc.RpcError:
    exc = future.exception(timeout=30)  # type: ignore[attr-defined]
    assert isinstance(exc, grpc.RpcError), exc
    return exc


def test_a_step_longer_than_the_grace_period_is_reported_as_unknown() -> None:
    grace = 0.5
    harness = ServerHarness(server_config=ServerConfig(port=0, metrics_port=0,
                                                       grace_period_s=grace))
    gate: Gate | None = None
    try:
        harness.wait_ready()
        executor = harness.executor
        gate = Gate(harness, "prefill", hold="held")
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(_prefill, harness, "held")
            assert gate.entered.wait(10)
            queued = pool.submit(_prefill, harness, "queued")
            wait_until(lambda: pending(harness) == 2, what="the second call to queue")
            started = time.monotonic()
            harness.stop_in_background(grace).result(timeout=30)
            stop_s = time.monotonic() - started
            err = _error(running)
            assert err.code() == grpc.StatusCode.CANCELLED, err.details()
            assert details(err)["ErrorInfo"].reason == "STEP_OUTCOME_UNKNOWN"  # type: ignore[attr-defined]
            err = _error(queued)
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
            assert "nothing was applied" in (err.details() or "")
        assert grace <= stop_s < grace + 2.0, stop_s
        assert harness.server.step_abandoned
        # The held step still completes on the executor thread; the queued one never ran.
        gate.open()
        wait_until(lambda: executor.kv_stats().active_sequences == 1, what="the step")
        assert [c[0] for c in gate.calls] == ["held"]
    finally:
        if gate is not None:
            gate.restore()
        harness.close()


def test_a_step_within_the_grace_period_gets_its_answer() -> None:
    harness = ServerHarness(server_config=ServerConfig(port=0, metrics_port=0,
                                                       grace_period_s=10.0))
    try:
        harness.wait_ready()
        with Gate(harness, "prefill", hold="held") as gate, ThreadPoolExecutor(1) as pool:
            running = pool.submit(_prefill, harness, "held")
            assert gate.entered.wait(10)
            stop = harness.stop_in_background(10.0)
            time.sleep(0.3)
            started = time.monotonic()
            gate.open()
            assert running.result(timeout=30).outputs[0].seq_len == 3
            stop.result(timeout=30)
            assert time.monotonic() - started < 3.0  # not the whole grace period
        assert not harness.server.step_abandoned
    finally:
        harness.close()
