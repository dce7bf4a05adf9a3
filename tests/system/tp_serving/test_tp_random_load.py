"""``--load-format random`` under tensor parallelism (CPU, gloo): served from a directory
holding only ``config.json``, TP = 2 draws the same weights as TP = 1 (each rank its rows),
so it gives TP = 1's tokens; the server says the weights are random."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from executor.weights.tiny import ensure_tiny_model
from tests.helpers.serving import ServeProcess
from tests.system.tp_serving.kv_primitives import LOGPROB_ATOL, TINY, run, script


def test_random_weights_at_tp2_equal_tp1(tmp_path: Path, tiny_tp1: ServeProcess) -> None:
    shutil.copy(ensure_tiny_model() / "config.json", tmp_path / "config.json")
    args = [*TINY[2:], "--model", str(tmp_path), "--load-format", "random"]
    want = run(args)
    got = run([*args, "--tensor-parallel-size", "2"])
    assert [(s, t) for s, t, _ in got] == [(s, t) for s, t, _ in want]
    assert [lp for _, _, lp in got] == pytest.approx([lp for _, _, lp in want],
                                                     abs=LOGPROB_ATOL)
    # The tiny checkpoint's own weights give other tokens: these are the drawn ones.
    assert [(s, t) for s, t, _ in script(tiny_tp1)] != [(s, t) for s, t, _ in want]
