"""Issue 19, defect 9: with the default --drain-delay of 0, readiness never showed
NOT_SERVING (the listener just closed). The CLI's default now keeps answering NOT_SERVING
for a while before the listener closes."""

from __future__ import annotations

import time

from grpc_health.v1 import health_pb2

from service.cli import DEFAULT_DRAIN_DELAY_S, build_configs, build_parser
from tests.service.harness import ServerHarness, tiny_config

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_default_drain_shows_not_serving_before_the_listener_closes() -> None:
    args = build_parser().parse_args(["serve", "--device", "cpu", "--port", "0",
                                      "--metrics-port", "-1"])
    _, config = build_configs(args, env={})
    assert config.drain_delay_s == DEFAULT_DRAIN_DELAY_S >= 5.0
    harness = ServerHarness(tiny_config(), config)
    try:
        harness.wait_ready()
        started = time.monotonic()
        stop = harness.stop_in_background(config.grace_period_s)
        seen = []
        while time.monotonic() - started < 2.0:  # a probe every 0.2 s sees the drain
            seen.append(harness.ready())
            time.sleep(0.2)
        assert seen and set(seen[1:]) == {NOT_SERVING}
        assert harness.check("") == NOT_SERVING
        stop.result(timeout=30)
        assert time.monotonic() - started >= DEFAULT_DRAIN_DELAY_S
    finally:
        harness.close()
