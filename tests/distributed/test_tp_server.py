"""Tensor parallelism through the real server on CPU (gloo, one process per rank).

``model-executor serve --tensor-parallel-size 2`` on ``tiny`` gives TP=1's greedy tokens,
log-probabilities within ``LOGPROB_ATOL`` and KV accounting over chunked prefill, decode,
multi-step decode, Truncate, KV exhaustion and release; a rank killed or stopped turns
Health UNHEALTHY, every process exits and nothing is left behind.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from service.gen.model_executor.v1 import executor_pb2 as pb
from service.health import READINESS_SERVICE
from tests.distributed import scenario
from tests.distributed.serving import ServeProcess, alive

#: float32 log-probabilities of TP=N against TP=1: sums in a different order (measured
#: differences are ~1e-6; tokens must be equal).
LOGPROB_ATOL = 1e-4
KV_TOKENS = 160
TINY = ["--model", "tiny", "--kv-tokens", str(KV_TOKENS), "--max-context", "128",
        "--max-sequences", "4", "--drain-delay", "0"]
PROMPT_A = [(i * 37) % 500 + 3 for i in range(40)]
PROMPT_B = [5, 17, 99, 4, 250, 311, 8]


def _run(args: list[str]) -> scenario.Transcript:
    server = ServeProcess(args)
    try:
        server.wait_ready()
        health = server.stub.Health(pb.HealthRequest(), timeout=10)
        assert health.state == pb.SERVER_STATE_READY
        return scenario.run(server.stub, PROMPT_A, PROMPT_B, kv_tokens=KV_TOKENS)
    finally:
        assert server.stop() == 0, "".join(server.lines)[-3000:]
        if "--tensor-parallel-size" in args:
            stopped = server.events("rank_stopped")
            assert stopped, "".join(server.lines)[-3000:]  # the follower left its loop


@pytest.fixture(scope="module")
def reference() -> scenario.Transcript:
    return _run(TINY)


def test_tp2_matches_tp1_through_grpc(reference: scenario.Transcript) -> None:
    assert reference.refused == "RESOURCE_EXHAUSTED"
    assert reference.kv[-1][1] == reference.kv[-1][0] == KV_TOKENS  # all freed again
    got = _run([*TINY, "--tensor-parallel-size", "2"])
    scenario.assert_same(got, reference, LOGPROB_ATOL)


def _shm() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir()} if Path("/dev/shm").is_dir() else set()


@pytest.fixture
def tp2() -> Iterator[ServeProcess]:
    server = ServeProcess([*TINY, "--tensor-parallel-size", "2", "--drain-delay", "1.5",
                           "--rank-heartbeat-timeout", "3"])
    try:
        server.wait_ready()
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop(10)
        for pid in server.rank_pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _assert_fails_and_exits(server: ServeProcess, rank_pid: int, why: str,
                            shm_before: set[str]) -> None:
    deadline = time.monotonic() + 30
    states = set()
    while time.monotonic() < deadline:
        try:
            states.add(server.stub.Health(pb.HealthRequest(), timeout=2).state)
            if server.check("") == health_pb2.HealthCheckResponse.NOT_SERVING and \
                    server.check(READINESS_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
        except grpc.RpcError:
            pass
        time.sleep(0.05)
    else:
        raise AssertionError("Health never reported NOT_SERVING")
    assert pb.SERVER_STATE_UNHEALTHY in states or \
        server.stub.Health(pb.HealthRequest(), timeout=2).state in (
            pb.SERVER_STATE_UNHEALTHY, pb.SERVER_STATE_DRAINING)
    # a step after the failure is refused, not hung
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(seq_id="x", token_id=1)]),
                           timeout=30)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
    assert server.proc.wait(60) == 1
    failed = server.events("rank_failed")
    assert failed and failed[0]["failed_rank"] == 1 and why in failed[0]["reason"], failed
    deadline = time.monotonic() + 10
    while alive(rank_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(rank_pid), "the failed rank's process was left behind"
    leaked = {n for n in _shm() - shm_before if n.startswith(("torch_", "nccl", "gloo"))}
    assert not leaked
    with socket.socket() as s:  # the gRPC port is free again
        s.bind(("127.0.0.1", server.port))


def test_a_killed_rank_turns_the_server_unhealthy_and_everything_exits(
        tp2: ServeProcess) -> None:
    before = _shm()
    out = tp2.stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(
        seq_id="x", token_ids=PROMPT_B, sample=True)]), timeout=60)
    assert out.outputs[0].HasField("token_id")
    pid = tp2.rank_pids[1]
    os.kill(pid, signal.SIGKILL)
    _assert_fails_and_exits(tp2, pid, "killed by SIGKILL", before)


def test_a_stopped_rank_is_found_by_its_heartbeat(tp2: ServeProcess) -> None:
    before = _shm()
    pid = tp2.rank_pids[1]
    os.kill(pid, signal.SIGSTOP)  # alive but silent: only the heartbeat can tell
    try:
        _assert_fails_and_exits(tp2, pid, "no heartbeat", before)
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
