"""examples/rl_loop.py against a live server, run as a user runs it: each iteration's
generation names the version the trainer pushed, the tokens change with the weights, and
the colocated mode (sleep while training, the update refilling discarded weights) ends
READY with nothing asleep."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from executor.config import CacheConfig, ExecutorConfig, ModelConfig
from executor.weights.random_weights import write_random_model
from executor.weights.tiny import tiny_config
from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.service.harness import ServerHarness

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerHarness, Path]]:
    model = write_random_model(tmp_path_factory.mktemp("rl") / "policy", tiny_config(), seed=5)
    harness = ServerHarness(ExecutorConfig(
        model=ModelConfig(source=str(model)), device="cpu",
        cache=CacheConfig(kv_tokens=512, max_sequences=4, max_context=128)))
    try:
        harness.wait_ready()
        yield harness, model
    finally:
        harness.close()


@pytest.mark.parametrize("colocate", [False, True])
def test_the_rl_loop_runs(served: tuple[ServerHarness, Path], colocate: bool) -> None:
    server, model = served
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "examples/rl_loop.py", "--target", server.target, "--weights",
         str(model), "--iterations", "2", "--tokens", "6", *(["--colocate"] * colocate)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    generations = [line for line in done.stdout.splitlines() if line.startswith("generate")]
    assert len(generations) == 3
    assert "['step-1']" in generations[1] and "['step-2']" in generations[2]
    tokens = [g.split("tokens ", 1)[1] for g in generations]
    assert tokens[0] != tokens[1] != tokens[2]  # the pushed weights changed the answers
    health = server.stub.Health(pb.HealthRequest(), timeout=5)
    assert health.state == pb.SERVER_STATE_READY and not health.model.sleeping
    assert health.model.weight_version == "step-2"
