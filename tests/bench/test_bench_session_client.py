"""``bench.common.server.Client`` (the scheduler side of the session benchmarks) against a
real server: the pipelined client (next request made while the window is full, the window
freed on arrival) runs the steps it says, one token per sequence per step, and its
depth-2 stream gives the tokens of one-at-a-time steps."""

from __future__ import annotations

from bench.common.server import CTX, Client
from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.service.harness import ServerHarness

STEPS = 12


def _run(server: ServerHarness, depth: int, prefix: str) -> tuple[list[int], int]:
    client = Client(server.target, vocab=100)
    ids = [f"{prefix}-{i}" for i in range(3)]
    toks = client.admit(ids)
    free_before = server.kv().free_tokens
    per_token = client.session(ids, toks, STEPS, depth)
    assert per_token > 0
    seen = [step for step, _ in client.seen]
    assert len(seen) == STEPS + 10  # every request was answered, once
    # One token per sequence per step went into the cache.
    assert free_before - server.kv().free_tokens == len(ids) * (STEPS + 10)
    # Where each depth ended: the token its sequences' next step samples.
    last = server.stub.Decode(pb.DecodeRequest(items=[
        pb.DecodeItem(seq_id=s, use_last_sampled=True) for s in ids]), timeout=60)
    client.release(ids)
    client.channel.close()
    return [o.token_id for o in last.outputs], len(seen)


def test_pipelined_bench_client_matches_one_step_at_a_time(server: ServerHarness) -> None:
    free = server.kv().free_tokens
    one, _ = _run(server, 1, "bench-d1")
    two, _ = _run(server, 2, "bench-d2")
    three, _ = _run(server, 3, "bench-d3")
    assert one == two == three  # same prompts (by position), greedy: same continuations
    assert server.kv().free_tokens == free
    assert CTX + STEPS + 11 <= 512  # the shared server's max_context holds these runs
