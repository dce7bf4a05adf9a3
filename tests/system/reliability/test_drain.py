"""Graceful drain of the real CLI process, served with TLS, a token and a plaintext health
port (the flags as an operator writes them): SIGTERM turns readiness NOT_SERVING at once,
new calls get UNAVAILABLE, the calls in flight complete within the grace period, exit 0.
Its timings go into the figures; the token never reaches the logs."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc
from service.health import READINESS_SERVICE
from service.tls import channel_credentials
from tests.service.cli_process import PROMPT_TOKENS, Process
from tests.system.reliability.certs import Authority
from tests.system.reliability.figures import Figures

TOKEN = "drain-token-5f1c2e"
AUTH = [("authorization", f"Bearer {TOKEN}")]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Process, Authority]]:
    pki = Authority.make(tmp_path / "pki", "drain")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    process = Process("--grace-period", "30", "--drain-delay", "0.5",
                      "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                      "--token-file", str(token_file),
                      "--health-port", "0")
    try:
        yield process, pki
    finally:
        process.close()


def test_sigterm_drain_with_tls_and_token(served: tuple[Process, Authority],
                                          figures: Figures) -> None:
    process, pki = served
    serving = process.wait_event(lambda e: e["event"] == "serving")
    security = process.wait_event(lambda e: e["event"] == "security")
    assert security["tls"] == "tls" and security["token"] is True
    process.wait_event(lambda e: e["event"] == "state_changed" and e["new"] == "READY")
    probe = grpc.insecure_channel(serving["health"])  # plaintext, no token
    ready = health_pb2.HealthCheckRequest(service=READINESS_SERVICE)
    readiness = health_pb2_grpc.HealthStub(probe)
    assert readiness.Check(ready, timeout=5).status == SERVING

    channel = grpc.secure_channel(serving["grpc"], channel_credentials(pki.ca))
    stub = pb_grpc.ExecutorStub(channel)
    in_flight = [stub.Prefill.future(pb.PrefillRequest(request_id=f"drain-{i}", items=[
        pb.PrefillItem(seq_id=f"s{i}", token_ids=[(7 * i + k) % 500 + 3
                                                  for k in range(PROMPT_TOKENS)], sample=True)
    ]), timeout=60, metadata=AUTH) for i in range(4)]
    deadline = time.monotonic() + 10
    # Signal only once the server has accepted all four (queued, running or done): a call
    # still in the client's transport at SIGTERM is rightly refused with UNAVAILABLE.
    # (Done is read first: a call finishing between the two reads is missed, not counted twice.)
    def accepted() -> int:
        done = sum(f.done() for f in in_flight)
        return done + stub.Health(pb.HealthRequest(), timeout=5, metadata=AUTH).pending_calls

    while accepted() < len(in_flight):
        assert time.monotonic() < deadline, "calls never queued"

    signalled = time.monotonic()
    process.proc.send_signal(signal.SIGTERM)
    while readiness.Check(ready, timeout=5).status != NOT_SERVING:
        assert time.monotonic() - signalled < 5, "readiness did not drop"
    not_serving_ms = (time.monotonic() - signalled) * 1e3
    with pytest.raises(grpc.RpcError) as info:
        stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(seq_id="late", token_ids=[1])]),
                     timeout=10, metadata=AUTH)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    for i, future in enumerate(in_flight):  # every accepted call completes
        assert future.result(timeout=60).outputs[0].seq_id == f"s{i}"
    code = process.proc.wait(timeout=60)
    exit_s = time.monotonic() - signalled
    channel.close()
    probe.close()
    process._reader.join(timeout=5)
    assert code == 0
    assert exit_s < 30  # within the grace period
    logs = "\n".join(json.dumps(e) for e in process.events) + "".join(process.other)
    assert TOKEN not in logs
    handled = [e for e in process.events if e["event"] == "rpc"]
    for event in handled:
        figures.add_handled(event["rpc"], event["code"])
    figures.notes["drain"] = {"in_flight_completed": len(in_flight),
                              "sigterm_to_not_serving_ms": round(not_serving_ms, 1),
                              "sigterm_to_exit_s": round(exit_s, 2), "exit_code": code}
