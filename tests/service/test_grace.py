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
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc
from tests.service.harness import ServerHarness
from tests.system.reliability.support import Gate, details, pending, wait_until


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


def test_the_process_exits_at_the_end_of_the_grace_period() -> None:
    """The CLI process used to exit seconds after the grace period (it joined the running
    step). Now it answers every caller at the end of the grace period and exits at once."""
    import signal

    from tests.service.cli_process import PROMPT_TOKENS, Process

    served = Process("--grace-period", "0.3", "--drain-delay", "0")
    try:
        serving = served.wait_event(lambda e: e["event"] == "serving")
        served.wait_event(lambda e: e["event"] == "state_changed" and e["new"] == "READY")
        channel = grpc.insecure_channel(serving["grpc"])
        stub = pb_grpc.ExecutorStub(channel)
        calls = [stub.Prefill.future(pb.PrefillRequest(items=[pb.PrefillItem(
            seq_id=f"g{i}", token_ids=[(5 * i + k) % 500 + 3 for k in range(PROMPT_TOKENS)],
            sample=True)]), timeout=60) for i in range(6)]
        wait_until(lambda: sum(c.done() for c in calls) + stub.Health(
            pb.HealthRequest(), timeout=5).pending_calls >= len(calls), what="queued calls")
        signalled = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=30) == 0
        exit_s = time.monotonic() - signalled
        codes = []
        for call in calls:
            exc = call.exception(timeout=10)
            codes.append(grpc.StatusCode.OK if exc is None else exc.code())
        channel.close()
        served._reader.join(timeout=5)  # every log line read
        # Each answer is true: OK (applied), UNAVAILABLE (never started) or CANCELLED
        # (outcome unknown); no caller waited on the queue past the grace period.
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE,
                              grpc.StatusCode.CANCELLED}, codes
        assert grpc.StatusCode.UNAVAILABLE in codes, codes
        assert exit_s < 5.0, exit_s
        print(f"exit {exit_s:.2f} s after SIGTERM; answers {[c.name for c in codes]}")
        stopped = served.wait_event(lambda e: e["event"] == "stopped")
        assert stopped["step_abandoned"] == (grpc.StatusCode.CANCELLED in codes)
    finally:
        served.close()
