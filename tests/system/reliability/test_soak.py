"""Soak (only with ``MODEL_EXECUTOR_SOAK=1``; ``MODEL_EXECUTOR_SOAK_SECONDS``, default 600):
rounds of the concurrent-client load for that long against one server. After every round
the KV cache is back at its baseline and the invariant holds; after a warm-up round the
process's memory stays flat (growth bounded), and Health keeps answering."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc
from tests.system.reliability.budget import BUDGET
from tests.system.reliability.figures import Figures, percentile, rss_bytes
from tests.system.reliability.load import CONFIG as CONFIG  # the conftest ``server``'s
from tests.system.reliability.load import HealthProbe, client, grpc_step
from tests.system.reliability.support import ServerHarness, check_kv

pytestmark = pytest.mark.skipif(BUDGET.soak_seconds <= 0,
                                reason="soak only: set MODEL_EXECUTOR_SOAK=1")
ROUND_CLIENTS, ROUND_CALLS = 16, 200
MAX_GROWTH_MIB = 128


def test_steady_load_keeps_memory_and_kv_flat(server: ServerHarness, figures: Figures) -> None:
    baseline = check_kv(server, figures)
    probe = HealthProbe(server.target)
    probe.start()
    started, rounds, calls = time.monotonic(), 0, 0
    warm_rss = 0
    try:
        while time.monotonic() - started < BUDGET.soak_seconds:
            async def load(offset: int) -> int:
                async with grpc.aio.insecure_channel(server.target) as channel:
                    stub = pb_grpc.ExecutorStub(channel)
                    done = await asyncio.gather(*(
                        client(offset + c, ROUND_CALLS,
                               grpc_step(stub, offset + c, BUDGET.call_timeout_s))
                        for c in range(ROUND_CLIENTS)))
                    return sum(len(d) for d in done)

            calls += asyncio.run(load(rounds * ROUND_CLIENTS))
            check_kv(server, figures, expected=baseline)
            rounds += 1
            if rounds == 1:
                warm_rss = rss_bytes()
    finally:
        probe.done.set()
        probe.join(timeout=10)
    growth = (rss_bytes() - warm_rss) / 2**20
    figures.notes["soak"] = {
        "seconds": round(time.monotonic() - started), "rounds": rounds, "calls": calls,
        "rss_growth_after_warmup_mib": round(growth, 1),
        "health_p99_ms": round(percentile(probe.latencies_ms, 0.99), 2),
        "health_failures": probe.failures}
    assert probe.failures == 0
    assert growth < MAX_GROWTH_MIB, figures.notes["soak"]
