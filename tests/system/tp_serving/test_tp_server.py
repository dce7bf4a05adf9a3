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
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from service.gen.model_executor.v1 import executor_pb2 as pb
from service.health import READINESS_SERVICE
from tests.helpers.serving import ServeProcess, alive
from tests.system.tp_serving import scenario

#: float32 log-probabilities of TP=N against TP=1: sums in a different order (measured
#: differences are ~1e-6; tokens must be equal).
LOGPROB_ATOL = 1e-4
KV_TOKENS, TINY = scenario.KV_TOKENS, scenario.TINY
PROMPT_A = [(i * 37) % 500 + 3 for i in range(40)]
PROMPT_B = [5, 17, 99, 4, 250, 311, 8]


def _run(server: ServeProcess, world_size: int) -> scenario.Transcript:
    """The scenario on a shared ``tiny`` server (``conftest``: started with a metrics
    port; its clean stop is checked when the package ends), with what Health and the
    metrics say of its size."""
    health = server.stub.Health(pb.HealthRequest(), timeout=10)
    assert health.state == pb.SERVER_STATE_READY
    assert health.model.tensor_parallel_size == world_size
    per_rank = list(health.model.rank_memory_bytes)
    assert len(per_rank) == world_size and all(b > 0 for b in per_rank)
    # what the group's all-reduces run as: gloo on CPU ("" for one process), and no
    # projection sends (the push kernel needs CUDA)
    assert health.model.tp_all_reduce == ("gloo" if world_size > 1 else "")
    assert not any(f.startswith("tp_") for f in health.model.kernel_features)
    metrics = _scrape(str(server.events("serving")[0]["metrics"]))
    assert metrics["model_executor_tensor_parallel_size"] == {(): world_size}
    assert metrics.get("model_executor_tp_all_reduce") == (
        {(("algorithm", "gloo"),): 1} if world_size > 1 else None)
    assert metrics["model_executor_rank_memory_bytes"] == {
        (("rank", str(r)),): b for r, b in enumerate(per_rank)}
    counts_before = {name: metrics.get(f"model_executor_{name}_count", {})
                     for name in ("tp_step_delivery_seconds", "tp_launch_lag_seconds")}
    transcript = scenario.run(server.stub, PROMPT_A, PROMPT_B, kv_tokens=KV_TOKENS)
    # every step's delivery and launch lag (the follower's answer carries its receipt
    # and launch times; the ranks share this host, so the local transport): observed
    # for both phases, by this scenario's own steps
    scraped = _scrape(str(server.events("serving")[0]["metrics"]))
    for name, before in counts_before.items():
        counts = scraped.get(f"model_executor_{name}_count", {})
        if world_size > 1:
            for phase in ("prefill", "decode"):
                key = (("phase", phase),)
                assert counts.get(key, 0) > before.get(key, 0), (name, counts)
        else:
            assert counts == {}, name
    return transcript


def test_tp2_matches_tp1_through_grpc(tiny_tp1: ServeProcess, tiny_tp2: ServeProcess) -> None:
    reference = _run(tiny_tp1, 1)
    assert reference.refused == "RESOURCE_EXHAUSTED"
    assert reference.kv[-1][1] == reference.kv[-1][0] == KV_TOKENS  # all freed again
    got = _run(tiny_tp2, 2)
    scenario.assert_same(got, reference, LOGPROB_ATOL)


def _scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    text = urllib.request.urlopen(url, timeout=10).read()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = \
                sample.value
    return out


def _shm() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir()} if Path("/dev/shm").is_dir() else set()


@pytest.fixture
def tp2(request: pytest.FixtureRequest) -> Iterator[ServeProcess]:
    extra = getattr(request, "param", ["--rank-heartbeat-timeout", "3"])
    server = ServeProcess([*TINY, "--tensor-parallel-size", "2", "--drain-delay", "1.5",
                           *extra])
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
                            shm_before: set[str], rank: int | None = 1) -> None:
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
    assert failed and failed[0]["failed_rank"] == rank and why in failed[0]["reason"], failed
    deadline = time.monotonic() + 10
    while alive(rank_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(rank_pid), "the failed rank's process was left behind"
    leaked = {n for n in _shm() - shm_before if n.startswith(("torch_", "nccl", "gloo"))}
    assert not leaked
    with socket.socket() as s:  # nothing listens on the gRPC port any more
        # (SO_REUSEADDR, as gRPC's own listener: the test's closed connections may leave
        # the port in TIME_WAIT, which is not a listener)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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


# The collective timeout also bounds the ranks' first rendezvous at start-up: 3 s failed
# there on a loaded 2-core host (rank 1 still importing), hence a few seconds more.
@pytest.mark.parametrize("tp2", [["--rank-heartbeat-timeout", "120",
                                  "--collective-timeout", "6"]], indirect=True)
def test_a_rank_hung_inside_a_step_fails_it_within_the_collective_timeout(
        tp2: ServeProcess) -> None:
    """The heartbeat is slower than the collective timeout here: the step finds it."""
    before = _shm()
    pid = tp2.rank_pids[1]
    os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        tp2.stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(
            seq_id="h", token_ids=PROMPT_B, sample=True)]), timeout=60)
    assert time.monotonic() - started < 30
    assert err.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
    try:
        _assert_fails_and_exits(tp2, pid, "collective failed", before, rank=None)
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_killed_rank_0_takes_the_other_ranks_with_it(tp2: ServeProcess) -> None:
    pid = tp2.rank_pids[1]
    tp2.proc.kill()  # SIGKILL: no handler runs; the kernel's parent-death signal does
    tp2.proc.wait(10)
    deadline = time.monotonic() + 20
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "rank 1 outlived rank 0"


def test_torchrun_style_launch_serves_and_stops_every_rank(tmp_path: Path) -> None:
    """Two processes started by hand with the environment torchrun sets; rank 0 serves,
    rank 1 follows; SIGTERM to rank 0 stops both cleanly."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master_port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "WORLD_SIZE": "2"}
    follower = ServeProcess.start_follower([*TINY], {**env, "RANK": "1", "LOCAL_RANK": "1"})
    try:
        leader = ServeProcess(TINY, env={**env, "RANK": "0", "LOCAL_RANK": "0"})
        leader.wait_ready()
        health = leader.stub.Health(pb.HealthRequest(), timeout=10)
        assert health.model.tensor_parallel_size == 2
        out = leader.stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(
            seq_id="t", token_ids=PROMPT_B, sample=True)]), timeout=60)
        assert out.outputs[0].HasField("token_id")
        assert leader.stop() == 0, "".join(leader.lines)[-3000:]
        assert follower.wait(30) == 0
    finally:
        if follower.poll() is None:
            follower.kill()
