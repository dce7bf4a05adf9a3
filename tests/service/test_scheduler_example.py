"""examples/scheduler_loop.py against a live server: run as a user runs it, it prints the
unary loop's tokens, the pipelined Session's equal tokens and a KV cache left as found;
its loops give the same tokens at every depth."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests.service.harness import ServerHarness

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "scheduler_loop.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("scheduler_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_runs_against_a_server(server: ServerHarness) -> None:
    before = server.kv()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--target", server.target, "--tokens", "12"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = dict(line.split(":", 1) for line in done.stdout.splitlines())
    unary = [int(t) for t in lines["unary"].strip(" []").split(",")]
    assert len(unary) == 12
    assert lines["pipelined"].strip().startswith(lines["unary"].strip())
    assert lines["same tokens"].strip() == "yes"
    assert "all released" in lines["kv free tokens before / after"]
    assert server.kv() == before


def test_the_loops_give_the_same_tokens_at_every_depth(server: ServerHarness) -> None:
    loops = load_example()
    before = server.kv()
    prompt = [5, 17, 99, 3, 250, 41]
    unary = loops.generate(server.stub, "example-unary", prompt, 24)
    for depth in (1, 2, 3):
        assert loops.generate_pipelined(server.stub, f"example-piped-{depth}", prompt, 24,
                                        depth) == unary
    assert len(unary) == 24
    assert server.kv() == before
