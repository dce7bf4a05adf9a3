"""The FlashInfer backend inside the executor: graph decode and breakable prefill equal
eager (marker ``gpu``; skipped with a reason where FlashInfer is not installed).

Kernel-level checks against torch_native run in ``test_attention_kernels.py`` (its
``backend`` fixture covers flashinfer); docs/flashinfer.md says how to install it on a
machine without a package index.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor.attention.base import AttentionShape
from executor.attention.flashinfer_backend import flashinfer_unusable
from executor.executor import Executor
from tests.helpers.gpu import compare, greedy_agrees, rand_tokens
from tests.helpers.gpu import make_prefill_executor as make

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("flashinfer", reason="flashinfer is not installed (see docs/flashinfer.md)")


@pytest.fixture(scope="module")
def fi(model_path: Path) -> Executor:
    ex = make(model_path, attention="flashinfer")
    assert ex.model_info.attention_backend == "flashinfer"
    for cap in ex.capture(["decode", "prefill"]):
        assert all(b.ok for b in cap.buckets), cap
    return ex


def test_probe_passes_on_this_device() -> None:
    for head_dim in (64, 128):
        shape = AttentionShape(32, 8, head_dim, head_dim**-0.5)
        assert flashinfer_unusable(torch.device("cuda"), torch.bfloat16, shape) is None


@pytest.mark.parametrize("n", [1, 5, 64, 257, 512])
def test_breakable_prefill_equals_eager(fi: Executor, n: int) -> None:
    compare(fi, {"s": rand_tokens(n, n)})
    fi.release(["s"])
    fi.kv.check_invariants()


def test_mixed_new_and_continuing_batch(fi: Executor) -> None:
    compare(fi, {"a": rand_tokens(40, 1), "b": rand_tokens(3, 2)})
    compare(fi, {"a": rand_tokens(17, 3), "c": rand_tokens(60, 4), "b": rand_tokens(1, 5)})
    fi.release(["a", "b", "c"])
    fi.kv.check_invariants()


def test_graphs_equal_eager_flashinfer(fi: Executor, model_path: Path) -> None:
    greedy_agrees(fi, make(model_path, "disabled", "disabled", attention="flashinfer"))


def test_graphs_equal_eager_triton(fi: Executor, model_path: Path) -> None:
    """Across backends: FlashInfer under graphs against Triton run eagerly."""
    greedy_agrees(fi, make(model_path, "disabled", "disabled", attention="triton"))
