"""Both health services and the Health RPC through every lifecycle state:
STARTING -> CAPTURING -> READY -> UNHEALTHY (fatal device error) -> DRAINING."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from structlog.testing import capture_logs

from executor.api import Phase
from service.config import ServerConfig
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.health import READINESS_SERVICE
from service.server import real_executor_factory
from service.worker import ExecutorLike
from tests.service.harness import ServerHarness, tiny_config

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PREFILL = pb.PrefillRequest(items=[pb.PrefillItem(seq_id="h", token_ids=[1])])


def wait_for(predicate: Callable[[], bool], harness: ServerHarness,
             timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, (
            f"not reached; state {harness.server.lifecycle.state}, "
            f"boot error {harness.server.boot_error!r}")
        time.sleep(0.02)


def state(harness: ServerHarness) -> int:
    return int(harness.stub.Health(pb.HealthRequest(), timeout=5).state)


def unavailable(harness: ServerHarness) -> str:
    with pytest.raises(grpc.RpcError) as info:
        harness.stub.Prefill(PREFILL, timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    return str(info.value.details())


def healthy_gauge(harness: ServerHarness) -> float:
    return harness.scrape()[("model_executor_healthy", ())]


class Gated:
    """Builds the real executor, but only once let through; start-up capture waits too."""

    def __init__(self) -> None:
        self.boot = threading.Event()
        self.capture = threading.Event()

    def __call__(self) -> ExecutorLike:
        assert self.boot.wait(30)
        executor = real_executor_factory(tiny_config())()
        real_capture = executor.capture

        # The executor claims a phase to capture at start-up, then (on CPU) refuses the
        # capture with GraphsUnavailable; the server logs that and serves eagerly.
        def capture(phases: Sequence[Phase], force: bool = False, progress: bool = False
                    ) -> Any:
            assert self.capture.wait(30)
            return real_capture(phases, force, progress)

        executor.startup_phases = lambda: ("decode",)  # type: ignore[method-assign]
        executor.capture = capture  # type: ignore[method-assign]
        return executor


def test_lifecycle_through_every_state() -> None:
    gated = Gated()
    harness = ServerHarness(tiny_config(), ServerConfig(port=0, metrics_port=0,
                                                       drain_delay_s=2.0), factory=gated)
    watched: list[int] = []
    watch = harness.health.Watch(health_pb2.HealthCheckRequest(service=READINESS_SERVICE))
    watcher = threading.Thread(target=lambda: watched.extend(r.status for r in _drain(watch)))
    watcher.start()
    try:
        # STARTING: alive, not ready; steps refused with a retry hint
        assert state(harness) == pb.SERVER_STATE_STARTING
        assert (harness.check(), harness.ready()) == (SERVING, NOT_SERVING)
        assert not harness.stub.Health(pb.HealthRequest(), timeout=5).HasField("model")
        assert "starting" in unavailable(harness)
        with pytest.raises(grpc.RpcError) as info:
            harness.stub.Prefill(PREFILL, timeout=5)
        status = rpc_status.from_call(info.value)  # type: ignore[arg-type]
        assert status is not None and status.details[0].Is(
            error_details_pb2.RetryInfo.DESCRIPTOR)
        assert healthy_gauge(harness) == 0

        # CAPTURING
        gated.boot.set()
        wait_for(lambda: state(harness) == pb.SERVER_STATE_CAPTURING, harness)
        assert (harness.check(), harness.ready()) == (SERVING, NOT_SERVING)
        assert "capturing" in unavailable(harness)

        # READY (the capture was refused on CPU; the server serves eagerly)
        gated.capture.set()
        harness.wait_ready()
        assert state(harness) == pb.SERVER_STATE_READY
        assert (harness.check(), harness.ready()) == (SERVING, SERVING)
        health = harness.stub.Health(pb.HealthRequest(), timeout=5)
        assert health.model.name == "tiny" and health.model.vocab_size == 512
        assert health.model.attention_backend == "torch_native"  # what auto chose on CPU
        assert health.kv.total_tokens == 4096 and health.version
        assert healthy_gauge(harness) == 1
        with pytest.raises(grpc.RpcError) as info:
            harness.check("no.such.Service")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND

        # UNHEALTHY: a fatal device error fails the call and takes both services down
        def device_lost(*args: object, **kwargs: object) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        harness.executor.prefill = device_lost  # type: ignore[method-assign,assignment]
        with pytest.raises(grpc.RpcError) as info:
            harness.stub.Prefill(PREFILL, timeout=5)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert state(harness) == pb.SERVER_STATE_UNHEALTHY
        assert (harness.check(), harness.ready()) == (NOT_SERVING, NOT_SERVING)
        assert "fatal device error" in unavailable(harness)
        assert healthy_gauge(harness) == 0

        # DRAINING: still answering during the drain delay, everything NOT_SERVING
        stop = harness.stop_in_background(grace=1.0)
        wait_for(lambda: state(harness) == pb.SERVER_STATE_DRAINING, harness)
        assert (harness.check(), harness.ready()) == (NOT_SERVING, NOT_SERVING)
        assert "shutting down" in unavailable(harness)
        stop.result(timeout=10)
    finally:
        gated.boot.set()
        gated.capture.set()
        harness.close()
    watcher.join(timeout=10)
    # the readiness watch saw each distinct status in order
    assert watched[:3] == [NOT_SERVING, SERVING, NOT_SERVING]


def _drain(stream: Any) -> Any:
    try:
        yield from stream
    except grpc.RpcError:
        return


def _listed(channel: grpc.Channel) -> dict[str, int]:
    response = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(),
                                                        timeout=5)
    return {name: int(r.status) for name, r in response.statuses.items()}


def test_list_names_every_service_with_its_status() -> None:
    """``grpc.health.v1.Health/List`` (in the standard health.proto; reflection advertises
    it): both services and what Check says for each, on the main and the health port, in
    every state; never INTERNAL, never an error line."""
    harness = ServerHarness(tiny_config(), ServerConfig(port=0, metrics_port=0,
                                                       health_port=0, drain_delay_s=2.0))
    probe_port = grpc.insecure_channel(f"127.0.0.1:{harness.server.health_port}")
    try:
        with capture_logs() as logs:
            harness.wait_ready()
            for channel in (harness.channel, probe_port):
                assert _listed(channel) == {"": SERVING, READINESS_SERVICE: SERVING}
            codes = {dict(labels)["grpc_code"]: value
                     for (name, labels), value in harness.scrape().items()
                     if name == "grpc_server_handled_total"
                     and ("grpc_method", "List") in labels}
            assert codes == {"OK": 2}  # the alert on INTERNAL sees nothing
            stop = harness.stop_in_background(grace=1.0)
            wait_for(lambda: state(harness) == pb.SERVER_STATE_DRAINING, harness)
            assert _listed(harness.channel) == {"": NOT_SERVING,
                                                READINESS_SERVICE: NOT_SERVING}
            assert (harness.check(), harness.ready()) == (NOT_SERVING, NOT_SERVING)
            stop.result(timeout=10)
        assert any(e["event"] == "draining" for e in logs)  # the server's lines are seen
        assert [e for e in logs if e["log_level"] in ("error", "critical")] == []
    finally:
        probe_port.close()
        harness.close()
