"""Every windowed / soft-capped / fused-checkpoint family under CUDA graphs (marker
``gpu``): Mistral and Qwen2 with a window (64) shorter than the prompts, Gemma 2 and
Gemma 3 at head_dim 256, Phi-3; bf16, Triton attention. Decode full graphs and breakable
prefill capture at every bucket; no step falls back to eager (every step's path is
``graph``); graph logits equal eager's and greedy choices agree wherever clear of bf16
noise, through prefill, a continuing prefill and ten decode steps past the window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor.executor import Executor
from tests.helpers.gpu import compare, greedy_agrees, make_prefill_executor, rand_tokens
from tests.helpers.models import GPU_WINDOW, WINDOWED_ARCHS, write_gpu_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=WINDOWED_ARCHS)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[str, Path]:
    kind: str = request.param
    return kind, write_gpu_model(tmp_path_factory.mktemp(kind), kind, seed=5)


@pytest.fixture(scope="module")
def graphs(family: tuple[str, Path]) -> Executor:
    _, path = family
    ex = make_prefill_executor(path, prefill="breakable", decode="full")
    for result in ex.capture(["decode", "prefill"]):
        assert all(b.ok for b in result.buckets), result
    assert ex.model.spec.sliding_window == GPU_WINDOW
    return ex


def test_graphs_equal_eager_and_never_fall_back(family: tuple[str, Path],
                                                graphs: Executor) -> None:
    _, path = family
    eager = make_prefill_executor(path, prefill="disabled", decode="disabled")
    greedy_agrees(graphs, eager)  # asserts every graph-side step ran as a graph
    graphs.kv.check_invariants()


def test_prefill_graph_logits_equal_eager(graphs: Executor) -> None:
    """Packed prefill and chunked extends past the window: every token's logits."""
    compare(graphs, {"x": rand_tokens(200, 1), "y": rand_tokens(30, 2)})
    compare(graphs, {"x": rand_tokens(90, 3), "z": rand_tokens(5, 4)})
    graphs.release(["x", "y", "z"])
    torch.cuda.synchronize()
