"""The decode kernels load their weights with the L2 evict-first policy
(``executor.kernels.cache_policy``) and their activations with the default one.

Each kernel is compiled for sm_90 (no GPU needed) in a process without Triton's
interpreter (``tests.helpers.ptx_loads``): in its PTX the weight loads carry an
``L2::cache_hint`` under an ``evict_first`` policy, and the loads of the input row (and
of the MoE scratch, through L2) carry none, so those lines stay in L2 while the weights
pass through.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _loads(kernel: str) -> tuple[bool, list[str], list[str]]:
    """(evict_first policy created, hinted loads, other loads; atomics aside)."""
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this Triton has no CUDA backend to compile for sm_90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.helpers.ptx_loads", kernel], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    loads = found["loads"]
    hinted = [ld for ld in loads if "L2::cache_hint" in ld]
    plain = [ld for ld in loads if "L2::cache_hint" not in ld and ".acquire" not in ld]
    return found["evict_first_policy"], hinted, plain


def test_skinny_row_kernel_streams_its_weight_evict_first() -> None:
    policy, hinted, plain = _loads("skinny_row")
    assert policy
    assert hinted and all("evict_first" in ld for ld in hinted)
    assert plain, "the input row loads without the weights' policy"


def test_one_launch_moe_streams_its_experts_evict_first() -> None:
    policy, hinted, plain = _loads("moe_one_launch")
    assert policy
    assert hinted and all("evict_first" in ld for ld in hinted)
    # the logits, input row, norm weight and the activations down reads back (``.cg``)
    assert any(".cg" in ld for ld in plain) and len(plain) >= 3
