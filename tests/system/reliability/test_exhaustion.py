"""KV exhaustion on a pool of 64 token locations and 4 sequence slots: RESOURCE_EXHAUSTED
with needed vs free (QuotaFailure, ErrorInfo) and a retry hint (RetryInfo), nothing
allocated (not even for the items that fit), counted in metrics, and the pool back at its
baseline once sequences are released; also with clients racing for the pool."""

from __future__ import annotations

import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc

from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.system.reliability.figures import Figures
from tests.system.reliability.support import (
    ServerHarness,
    check_kv,
    details,
    rpc_error,
    tiny_config,
)

FAILURES = "model_executor_kv_allocation_failures_total"
CONFIG = tiny_config(kv_tokens=64, max_sequences=4, max_context=64)


def items(*spec: tuple[str, int]) -> pb.PrefillRequest:
    return pb.PrefillRequest(items=[pb.PrefillItem(seq_id=s, token_ids=[5] * n, sample=True)
                                    for s, n in spec])


def failures(harness: ServerHarness, resource: str) -> float:
    return harness.scrape()[(FAILURES, (("resource", resource),))]


def assert_exhausted(err: grpc.RpcError, resource: str, needed: int, free: int) -> None:
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    found = details(err)
    violation = found["QuotaFailure"].violations[0]  # type: ignore[attr-defined]
    assert violation.subject == resource
    assert violation.description == f"needed {needed}, free {free}"
    meta = found["ErrorInfo"].metadata  # type: ignore[attr-defined]
    assert (meta["resource"], meta["needed"], meta["free"]) == (resource, str(needed),
                                                                str(free))
    assert found["RetryInfo"].retry_delay.ToNanoseconds() > 0  # type: ignore[attr-defined]


def test_tokens_and_slots_exhausted_then_baseline(server: ServerHarness,
                                                  figures: Figures) -> None:
    baseline = check_kv(server, figures)
    tokens_before, slots_before = failures(server, "kv_tokens"), failures(server, "sequence_slots")
    first = server.stub.Prefill(items(("a", 40)), timeout=10)
    full = check_kv(server, figures)
    # an item that fits and one that does not: nothing is allocated for either
    assert_exhausted(rpc_error(server.stub.Prefill, items(("b", 8), ("c", 20))),
                     "kv_tokens", 28, 24)
    check_kv(server, figures, expected=full)
    server.stub.Prefill(items(("b", 20)), timeout=10)  # leaves 4 free
    # extending a known sequence past the pool
    assert_exhausted(rpc_error(server.stub.Prefill, items(("a", 10))), "kv_tokens", 10, 4)
    server.stub.Prefill(items(("c", 1), ("d", 1)), timeout=10)  # leaves 2 free, 0 slots
    before_decode = check_kv(server, figures)
    # decode of three sequences needs 3 tokens, 2 are free
    err = rpc_error(server.stub.Decode, pb.DecodeRequest(items=[
        pb.DecodeItem(seq_id=s, token_id=1) for s in ("a", "b", "c")]))
    assert_exhausted(err, "kv_tokens", 3, 2)
    # slots: four sequences alive, a fifth cannot be admitted
    assert_exhausted(rpc_error(server.stub.Prefill, items(("e", 1))), "sequence_slots", 1, 0)
    check_kv(server, figures, expected=before_decode)
    assert failures(server, "kv_tokens") == tokens_before + 3
    assert failures(server, "sequence_slots") == slots_before + 1
    # the scheduler frees a sequence and the refused call now fits
    server.stub.Release(pb.ReleaseRequest(seq_ids=["a"]), timeout=10)
    server.stub.Prefill(items(("e", 30)), timeout=10)
    server.stub.Release(pb.ReleaseRequest(seq_ids=["b", "c", "d", "e"]), timeout=10)
    check_kv(server, figures, expected=baseline)
    assert first.outputs[0].seq_len == 40


def test_clients_racing_for_a_tiny_pool(server: ServerHarness, figures: Figures) -> None:
    """Eight clients admit, extend, decode and release at random: every call is OK or
    RESOURCE_EXHAUSTED (or NOT_FOUND/INVALID_ARGUMENT for a sequence a client released or
    grew to the context limit), the invariant holds throughout, the pool returns to
    baseline."""
    baseline = check_kv(server, figures)
    codes: Counter[str] = Counter()

    def client(c: int) -> None:
        rng = random.Random(c)
        stub = server.stub
        for _ in range(30):
            seq = f"race{c}-{rng.randrange(2)}"
            op = rng.random()
            try:
                if op < 0.45:
                    stub.Prefill(items((seq, rng.randrange(1, 20))), timeout=30)
                elif op < 0.8:
                    stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(seq_id=seq, token_id=3)]),
                                timeout=30)
                else:
                    stub.Release(pb.ReleaseRequest(seq_ids=[seq]), timeout=30)
                codes["OK"] += 1
            except grpc.RpcError as err:
                codes[err.code().name] += 1

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(client, range(8)))
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED", "NOT_FOUND", "INVALID_ARGUMENT"}, codes
    assert codes["RESOURCE_EXHAUSTED"] > 0 and codes["OK"] > 0
    check_kv(server, figures)
    server.stub.Release(pb.ReleaseRequest(seq_ids=[f"race{c}-{i}" for c in range(8)
                                                  for i in range(2)]), timeout=10)
    check_kv(server, figures, expected=baseline)
    figures.notes["exhaustion_race_codes"] = dict(codes)
