"""Many clients at once: each drives its own sequences through interleaved Prefill (admit
and extend), Decode and Release, greedy, every call with its own request_id. The tokens
every client sees must equal those of the same calls run one at a time on an executor in
this process; the accounting invariant holds; Health answers throughout (its p99 latency
under load is a reported figure)."""

from __future__ import annotations

import asyncio
import time

import grpc

from executor.executor import Executor
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc
from tests.system.reliability.budget import BUDGET
from tests.system.reliability.figures import Figures, percentile, rss_bytes
from tests.system.reliability.load import CONFIG, HealthProbe, client, direct_step, grpc_step
from tests.system.reliability.support import ServerHarness, check_kv


def test_concurrent_clients_match_serial_execution(server: ServerHarness,
                                                   figures: Figures) -> None:
    baseline = check_kv(server, figures)
    clients, calls = BUDGET.clients, BUDGET.calls_per_client
    probe = HealthProbe(server.target)
    rss_before = rss_bytes()

    async def load() -> list[list[tuple[int, int]]]:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.ExecutorStub(channel)
            return list(await asyncio.gather(*(
                client(c, calls, grpc_step(stub, c, BUDGET.call_timeout_s))
                for c in range(clients))))

    started = time.perf_counter()
    probe.start()
    try:
        concurrent = asyncio.run(asyncio.wait_for(load(), timeout=600))
    finally:
        probe.done.set()
        probe.join(timeout=10)
    load_s = time.perf_counter() - started
    rss_growth = rss_bytes() - rss_before
    check_kv(server, figures, expected=baseline)  # every sequence released

    reference = Executor(CONFIG)  # the same calls, one at a time, no server
    serial_started = time.perf_counter()
    for c in range(clients):
        serial = asyncio.run(client(c, calls, direct_step(reference)))
        assert concurrent[c] == serial, f"client {c} diverged from serial execution"
    reference.kv.check_invariants()
    serial_s = time.perf_counter() - serial_started

    assert probe.failures == 0 and probe.latencies_ms
    p50, p99 = percentile(probe.latencies_ms, 0.5), percentile(probe.latencies_ms, 0.99)
    total = sum(len(r) for r in concurrent)
    figures.notes["load"] = {
        "clients": clients, "calls": total, "seconds": round(load_s, 1),
        "calls_per_second": round(total / load_s, 1),
        "serial_reference_seconds": round(serial_s, 1),
        "health_probes": len(probe.latencies_ms), "health_p50_ms": round(p50, 2),
        "health_p99_ms": round(p99, 2), "health_max_ms": round(max(probe.latencies_ms), 2),
        "rss_growth_mib": round(rss_growth / 2**20, 1)}
    # Health never waits for the executor: a busy executor thread must not show in it.
    assert p99 < 250, figures.notes["load"]
