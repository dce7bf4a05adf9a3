"""UpdateWeights from a trainer process over gloo (the distributed source), real servers.

A trainer process (``tests/helpers/trainer.py``) joins the server's ranks in a group of
its own, has a manifest with one wrong shape refused (naming the tensor, nothing sent),
then broadcasts W2 in buckets: greedy tokens equal HF transformers on W2, at
``--tensor-parallel-size`` 1 and 2 (each rank keeps its slice). A trainer that dies
mid-broadcast turns the server UNHEALTHY with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from executor.config import CacheConfig, ExecutorConfig, ModelConfig
from executor.weights.random_weights import write_random_model
from executor.weights.tiny import tiny_config
from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.helpers.serving import ROOT, ServeProcess
from tests.service.harness import ServerHarness
from tests.service.test_weights_update import PROMPTS, STEPS, generate, hf_greedy


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("transfer")
    return {"w1": write_random_model(root / "w1", tiny_config(), seed=31),
            "w2": write_random_model(root / "w2", tiny_config(), seed=32)}


@pytest.fixture(scope="module")
def expected(dirs: dict[str, Path]) -> list[list[int]]:
    return [hf_greedy(dirs["w2"], p, STEPS) for p in PROMPTS]


def trainer(target: str, weights: Path, mode: str = "ok") -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.trainer", "--target", target, "--weights",
         str(weights), "--mode", mode, "--version", "trained-1"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=120)
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == (0 if mode == "ok" else 3), proc.stdout + proc.stderr[-3000:]
    assert events[0]["event"] == "joined"
    return events


def check_trainer_events(events: list[dict[str, Any]], ranks: list[int]) -> None:
    by = {e["event"]: e for e in events}
    assert by["joined"]["ranks"] == ranks
    assert by["refused"]["code"] == "INVALID_ARGUMENT"
    assert "model.layers.0.mlp.down_proj.weight" in by["refused"]["details"]
    assert by["updated"]["version"] == "trained-1" and by["updated"]["tensors"] == 39


@pytest.fixture(scope="module")
def server(dirs: dict[str, Path]) -> Iterator[ServerHarness]:
    config = ExecutorConfig(model=ModelConfig(source=str(dirs["w1"])), device="cpu",
                            cache=CacheConfig(kv_tokens=1024, max_sequences=8,
                                              max_context=256),
                            max_prefill_tokens=1024, max_decode_batch=8)
    harness = ServerHarness(config)
    try:
        harness.wait_ready()
        yield harness
    finally:
        harness.close()


def test_a_trainer_process_updates_the_weights(server: ServerHarness, dirs: dict[str, Path],
                                               expected: list[list[int]]) -> None:
    before = generate(server, "before")
    assert before != expected
    # a trainer gone after its manifest was accepted, before a byte was written: the old
    # weights serve on, the group is left, and another trainer can join afterwards
    trainer(server.target, dirs["w2"], mode="die-early")
    deadline = time.monotonic() + 60
    while server.executor.weights.group is not None and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.1)
    health = server.stub.Health(pb.HealthRequest(), timeout=5)
    assert health.state == pb.SERVER_STATE_READY and health.model.weight_version == "initial"
    assert generate(server, "still-before") == before
    check_trainer_events(trainer(server.target, dirs["w2"]), [1])
    versions: set[str] = set()
    assert generate(server, "after", versions) == expected and versions == {"trained-1"}
    health = server.stub.Health(pb.HealthRequest(), timeout=5)
    assert health.model.weight_version == "trained-1"


def test_a_trainer_dying_mid_broadcast_makes_the_server_unhealthy(
        dirs: dict[str, Path]) -> None:
    config = ExecutorConfig(model=ModelConfig(source=str(dirs["w1"])), device="cpu",
                            cache=CacheConfig(kv_tokens=256, max_sequences=4,
                                              max_context=128))
    harness = ServerHarness(config)
    try:
        harness.wait_ready()
        events = trainer(harness.target, dirs["w2"], mode="die")
        assert [e["event"] for e in events] == ["joined", "dying"]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            health = harness.stub.Health(pb.HealthRequest(), timeout=5)
            if health.state == pb.SERVER_STATE_UNHEALTHY:
                break
            time.sleep(0.2)
        assert health.state == pb.SERVER_STATE_UNHEALTHY
        assert "weight update failed" in harness.server.lifecycle.reason
        assert harness.check("") == 2  # liveness NOT_SERVING: restart it
    finally:
        harness.close()


def test_tensor_parallel_ranks_each_keep_their_slice(dirs: dict[str, Path],
                                                     expected: list[list[int]]) -> None:
    server = ServeProcess(["--model", str(dirs["w1"]), "--tensor-parallel-size", "2",
                           "--kv-tokens", "1024", "--max-context", "256", "--max-sequences",
                           "8", "--drain-delay", "0", "--weight-version", "w1"])
    try:
        server.wait_ready()
        harness: Any = server  # generate() needs .stub only
        versions: set[str] = set()
        before = generate(harness, "before", versions)
        assert before != expected and versions == {"w1"}
        check_trainer_events(trainer(server.target, dirs["w2"]), [1, 2])
        versions = set()
        assert generate(harness, "after", versions) == expected
        assert versions == {"trained-1"}
        # the other paths every rank joins: an update from disk, Sleep and WakeUp
        server.stub.UpdateWeights(pb.UpdateWeightsRequest(weight_version="w1-disk",
                                                          path=str(dirs["w1"])), timeout=60)
        assert generate(harness, "disk") == before
        slept = server.stub.Sleep(pb.SleepRequest(), timeout=60)
        assert list(slept.sleeping) == ["weights", "kv_cache"]
        assert slept.freed_bytes > 0
        server.stub.WakeUp(pb.WakeUpRequest(), timeout=60)
        assert generate(harness, "woken") == before
    finally:
        assert server.stop() == 0, "".join(server.lines)[-3000:]
