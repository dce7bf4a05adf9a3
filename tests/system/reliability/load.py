"""Scheduler-like load for the reliability suite: reproducible random clients (prefill,
decode, release on their own sequences), run through gRPC or straight on an executor, and a
Health prober running beside them."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from executor.api import DecodeItem, PrefillItem
from executor.executor import Executor
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc
from service.health import READINESS_SERVICE
from tests.system.reliability.budget import BUDGET
from tests.system.reliability.support import tiny_config

MAX_LEN = 200  # a sequence is released before it grows past this
CONFIG = tiny_config(kv_tokens=BUDGET.clients * 2 * (MAX_LEN + 16), max_sequences=
                     BUDGET.clients * 2, max_context=MAX_LEN + 16)

# One call of a client: (op, seq_id, tokens, sample) -> (sampled token or -1, seq_len)
Step = Callable[[str, str, list[int], bool], Awaitable[tuple[int, int]]]


async def client(c: int, calls: int, step: Step) -> list[tuple[int, int]]:
    """A scheduler's worth of random but reproducible calls on this client's sequences;
    each decode feeds back the token the previous step sampled. Returns every result."""
    rng = random.Random(1000 + c)
    live: dict[str, tuple[int, int]] = {}  # seq_id -> (last sampled token, length)
    results = []
    fresh = 0
    for _ in range(calls):
        roll = rng.random()
        long = [s for s, (_, n) in live.items() if n >= MAX_LEN - 4]
        if long or (live and roll < 0.07):
            seq = long[0] if long else rng.choice(sorted(live))
            results.append(await step("release", seq, [], False))
            del live[seq]
        elif not live or (len(live) < 2 and roll < 0.17):
            seq, fresh = f"c{c}-s{fresh}", fresh + 1
            tokens = [rng.randrange(3, 500) for _ in range(rng.randrange(2, 13))]
            live[seq] = await step("prefill", seq, tokens, True)
            results.append(live[seq])
        elif roll < 0.27:  # a further chunk (sample=False on some: fill the cache only)
            seq = rng.choice(sorted(live))
            tokens = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 5))]
            sample = rng.random() < 0.7
            token, length = await step("prefill", seq, tokens, sample)
            live[seq] = (token if sample else live[seq][0], length)
            results.append((token, length))
        else:
            seq = rng.choice(sorted(live))
            live[seq] = await step("decode", seq, [live[seq][0]], True)
            results.append(live[seq])
    for seq in sorted(live):
        results.append(await step("release", seq, [], False))
    return results


def grpc_step(stub: Any, c: int, timeout: float) -> Step:
    counter = iter(range(10**9))

    async def step(op: str, seq: str, tokens: list[int], sample: bool) -> tuple[int, int]:
        rid = f"c{c}-{next(counter)}"
        if op == "release":
            response = await stub.Release(pb.ReleaseRequest(request_id=rid, seq_ids=[seq]),
                                          timeout=timeout)
            return -1, response.released
        if op == "prefill":
            response = await stub.Prefill(pb.PrefillRequest(request_id=rid, items=[
                pb.PrefillItem(seq_id=seq, token_ids=tokens, sample=sample)]), timeout=timeout)
        else:
            response = await stub.Decode(pb.DecodeRequest(request_id=rid, items=[
                pb.DecodeItem(seq_id=seq, token_id=tokens[0])]), timeout=timeout)
        out = response.outputs[0]
        return (out.token_id if out.HasField("token_id") else -1), out.seq_len

    return step


def direct_step(executor: Executor) -> Step:
    async def step(op: str, seq: str, tokens: list[int], sample: bool) -> tuple[int, int]:
        if op == "release":
            return -1, executor.release([seq]).released
        if op == "prefill":
            out = executor.prefill([PrefillItem(seq, tokens, sample)]).outputs[0]
        else:
            out = executor.decode([DecodeItem(seq, tokens[0])]).outputs[0]
        return (-1 if out.token_id is None else out.token_id), out.seq_len

    return step


class HealthProbe(threading.Thread):
    """Calls Executor/Health and the readiness check, in turn, every 20 ms while the load
    runs (like a busy prober; it does not load the server itself)."""

    def __init__(self, target: str) -> None:
        super().__init__(daemon=True)
        self.channel = grpc.insecure_channel(target)
        self.latencies_ms: list[float] = []
        self.failures = 0
        self.done = threading.Event()

    def run(self) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = pb_grpc.ExecutorStub(self.channel)
        health = health_pb2_grpc.HealthStub(self.channel)
        ready = health_pb2.HealthCheckRequest(service=READINESS_SERVICE)
        calls = (lambda: stub.Health(pb.HealthRequest(), timeout=5),
                 lambda: health.Check(ready, timeout=5))
        n = 0
        while not self.done.is_set():
            started = time.perf_counter()
            try:
                calls[n % 2]()
                self.latencies_ms.append((time.perf_counter() - started) * 1e3)
            except grpc.RpcError:
                self.failures += 1
            n += 1
            time.sleep(0.02)
        self.channel.close()
