"""Issue 19, defects 1 and 2: health probes answer whatever other clients do.

1. Unauthenticated ``Health/Watch`` streams used to take every slot of
   ``--max-concurrent-rpcs`` (and the health port's 16): authenticated calls and probes then
   got a bare RESOURCE_EXHAUSTED. Watch streams now have their own budget per listener.
2. Calls queued behind a long step used to starve readiness, liveness and
   ``Executor/Health``. Probes are now outside every budget, and an overload refusal says
   so (reason OVERLOADED, a RetryInfo, a metric), unlike KV exhaustion.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.auth import AuthConfig, Secret
from service.config import ServerConfig
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.health import READINESS_SERVICE
from tests.system.reliability.figures import Figures
from tests.system.reliability.support import (
    Gate,
    ServerHarness,
    details,
    pending,
    rpc_error,
    serving,
    wait_until,
)

TOKEN = "t0ken"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
SERVING = health_pb2.HealthCheckResponse.SERVING
REFUSALS = "model_executor_overload_refusals_total"


def _watch(channel: grpc.Channel, stack: ExitStack) -> Iterator[health_pb2.HealthCheckResponse]:
    """An open Watch stream (its first message read), cancelled when ``stack`` closes."""
    stream = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service=READINESS_SERVICE), timeout=60)
    stack.callback(stream.cancel)
    assert next(stream).status == SERVING
    return stream  # type: ignore[no-any-return]


def _check(channel: grpc.Channel, service: str) -> int:
    request = health_pb2.HealthCheckRequest(service=service)
    return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status)


def test_unauthenticated_watch_streams_cannot_lock_out(figures: Figures) -> None:
    config = ServerConfig(port=0, metrics_port=0, grace_period_s=1.0, max_concurrent_rpcs=8,
                          max_watch_streams=4, health_port=0,
                          auth=AuthConfig(token=Secret(TOKEN)))
    with serving(figures, server_config=config) as harness, ExitStack() as stack:
        health_target = f"127.0.0.1:{harness.server.health_port}"
        probe_channel = stack.enter_context(grpc.insecure_channel(health_target))
        # No token, on both listeners: more streams than the main port's call budget.
        for target, count in ((harness.target, 8), (health_target, 16)):
            channel = stack.enter_context(grpc.insecure_channel(target))
            opened = 0
            for _ in range(count):
                try:
                    _watch(channel, stack)
                    opened += 1
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    reason = details(err)["ErrorInfo"].reason  # type: ignore[attr-defined]
                    assert reason == "WATCH_STREAMS_EXHAUSTED"
            assert opened == 4
        # Probes, Executor/Health and steps with the token all still work.
        assert harness.stub.Health(pb.HealthRequest(), timeout=5, metadata=AUTH).state == \
            pb.SERVER_STATE_READY
        assert _check(harness.channel, READINESS_SERVICE) == SERVING
        assert _check(probe_channel, "") == SERVING
        assert _check(probe_channel, READINESS_SERVICE) == SERVING
        request = pb.PrefillRequest(items=[pb.PrefillItem(seq_id="a", token_ids=[1, 2])])
        harness.stub.Prefill(request, timeout=10, metadata=AUTH)
        harness.stub.Release(pb.ReleaseRequest(seq_ids=["a"]), timeout=10, metadata=AUTH)
        scrape = harness.scrape()
        assert scrape[(REFUSALS, (("kind", "watch"),))] == 4 + 12
        assert scrape[(REFUSALS, (("kind", "call"),))] == 0


def _prefill(harness: ServerHarness, seq_id: str) -> pb.PrefillResponse:
    request = pb.PrefillRequest(items=[pb.PrefillItem(seq_id=seq_id, token_ids=[3, 4],
                                                      sample=True)])
    return harness.stub.Prefill(request, timeout=30)


def test_probes_answer_while_calls_queue_behind_a_long_step(figures: Figures) -> None:
    limit = 8
    config = ServerConfig(port=0, metrics_port=0, grace_period_s=1.0,
                          max_concurrent_rpcs=limit)
    with serving(figures, server_config=config) as harness, \
            Gate(harness, "prefill", hold="held") as gate, \
            ThreadPoolExecutor(limit) as pool:
        futures = [pool.submit(_prefill, harness, "held")]
        assert gate.entered.wait(10)
        futures += [pool.submit(_prefill, harness, f"q{i}") for i in range(limit - 1)]
        wait_until(lambda: pending(harness) == limit, what="the queue to fill")
        # The budget is full: one more step is refused as overload, not as KV exhaustion.
        err = rpc_error(harness.stub.Prefill, pb.PrefillRequest(
            items=[pb.PrefillItem(seq_id="extra", token_ids=[1])]))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        found = details(err)
        assert found["ErrorInfo"].reason == "OVERLOADED"  # type: ignore[attr-defined]
        assert found["RetryInfo"].retry_delay.ToNanoseconds() > 0  # type: ignore[attr-defined]
        assert "QuotaFailure" not in found
        # Saturation is visible: the queue depth and the calls in flight (issue 19, metrics).
        scrape = harness.scrape()
        assert scrape[("model_executor_executor_queue_depth", ())] == limit
        assert scrape[("model_executor_calls_in_flight", (("kind", "call"),))] == limit
        # Liveness, readiness and Executor/Health answer, many times over.
        for _ in range(3 * limit):
            assert harness.check("") == SERVING
            assert harness.ready() == SERVING
            assert harness.stub.Health(pb.HealthRequest(), timeout=5).pending_calls == limit
        gate.open()
        responses = [f.result(30) for f in futures]
        assert all(r.outputs[0].HasField("token_id") for r in responses)
        scrape = harness.scrape()
        assert scrape[(REFUSALS, (("kind", "call"),))] == 1
        assert scrape[("model_executor_executor_queue_wait_seconds_count", ())] >= limit
        assert scrape[("model_executor_executor_queue_wait_seconds_sum", ())] > 0
        assert scrape[("model_executor_kv_allocation_failures_total",
                       (("resource", "kv_tokens"),))] == 0
        harness.stub.Release(pb.ReleaseRequest(
            seq_ids=["held", *(f"q{i}" for i in range(limit - 1))]), timeout=10)
        assert harness.kv().active_sequences == 0
