"""SIGTERM drain of the real CLI process: readiness drops at once, new calls get
UNAVAILABLE, calls already in flight finish within the grace period, exit code 0. Also
checks the JSON log lines the process writes on stdout."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc
from tests.service.cli_process import PROMPT_TOKENS, Process


@pytest.fixture
def served() -> Iterator[Process]:
    process = Process("--grace-period", "30", "--drain-delay", "0.5")
    try:
        yield process
    finally:
        process.close()


def test_sigterm_drains_in_flight_calls_and_exits_zero(served: Process) -> None:
    serving = served.wait_event(lambda e: e["event"] == "serving")
    assert serving["grpc"].startswith("127.0.0.1:") and serving["metrics"].endswith("/metrics")
    served.wait_event(lambda e: e["event"] == "state_changed" and e["new"] == "READY")
    channel = grpc.insecure_channel(serving["grpc"])
    stub = pb_grpc.ExecutorStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    ready = health_pb2.HealthCheckRequest(service="model_executor.v1.Executor")
    assert health.Check(ready, timeout=5).status == health_pb2.HealthCheckResponse.SERVING

    in_flight = [stub.Prefill.future(pb.PrefillRequest(request_id=f"inflight-{i}", items=[
        pb.PrefillItem(seq_id=f"s{i}", token_ids=[(7 * i + k) % 500 + 3
                                                  for k in range(PROMPT_TOKENS)], sample=True)
    ]), timeout=60) for i in range(4)]
    deadline = time.monotonic() + 10
    # Signal only once the server has accepted all four (queued, running or done): a call
    # still in the client's transport at SIGTERM is rightly refused with UNAVAILABLE.
    # (Done is read first: a call finishing between the two reads is missed, not counted twice.)
    while (sum(f.done() for f in in_flight)
           + stub.Health(pb.HealthRequest(), timeout=5).pending_calls) < len(in_flight):
        assert time.monotonic() < deadline, "calls never queued"
    served.proc.send_signal(signal.SIGTERM)

    served.wait_event(lambda e: e["event"] == "state_changed" and e["new"] == "DRAINING")
    with pytest.raises(grpc.RpcError) as info:
        stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(seq_id="late", token_ids=[1])]),
                     timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    for i, future in enumerate(in_flight):  # every accepted call completes
        response = future.result(timeout=60)
        assert response.outputs[0].seq_id == f"s{i}"
        assert response.outputs[0].seq_len == PROMPT_TOKENS
    assert served.proc.wait(timeout=60) == 0
    channel.close()
    served._reader.join(timeout=5)

    names = [e["event"] for e in served.events]
    assert names.index("signal_received") < names.index("draining") < names.index("stopped")
    assert [e["signal"] for e in served.events if e["event"] == "signal_received"] == [
        "SIGTERM"]
    summaries = [e for e in served.events if e["event"] == "rpc" and e["rpc"] == "Executor/Prefill"
                 and e["code"] == "OK"]
    assert {e["request_id"] for e in summaries} == {f"inflight-{i}" for i in range(4)}
    line = summaries[0]
    assert {"request_id", "rpc", "peer", "code", "duration_ms", "items", "tokens", "level",
            "timestamp"} <= set(line)
    assert line["items"] == 1 and line["tokens"] == PROMPT_TOKENS
    assert not served.other, "every stdout line is JSON"
