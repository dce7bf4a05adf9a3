"""World size 1 through the tensor-parallel code path on one GPU (marker ``gpu``): a real
NCCL process group, the model's all-reduces and the logits all-gather captured inside the
decode and prefill graphs, replayed against eager and against the plain executor.

With one rank NCCL's collectives change no value, so the distributed executor must give
the plain executor's tokens exactly (same graphs, same kernels); its graph logits must
match its own eager forward within the bf16 tolerances of the other graph tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from executor.api import DecodeItem, PrefillItem
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from executor.distributed.group import TensorParallel
from executor.executor import Executor
from tests.executor.distributed.world import transcript, world_of_one
from tests.helpers.gpu import (
    LOGIT_ATOL,
    LOGIT_RTOL,
    assert_same_greedy,
    graph_and_eager,
    greedy_agrees,
    rand_tokens,
)

pytestmark = pytest.mark.gpu

DEVICE = "cuda:0"
DECODE_BUCKETS = (1, 2, 4, 8)
PREFILL_BUCKETS = (16, 64, 256, 512)
# (decode graph mode, prefill graph mode): every capture backend once
MODES = [("full", "breakable"), ("breakable", "tc_piecewise"), ("full", "fixed_grid")]


def make(path: Path, decode: str, prefill: str, tp: TensorParallel | None = None) -> Executor:
    cfg = ExecutorConfig(
        model=ModelConfig(source=str(path), dtype="bfloat16"), device=DEVICE,
        cache=CacheConfig(kv_tokens=16 * 1024, max_sequences=16, max_context=1024),
        graphs=GraphConfig(decode_mode=decode, prefill_mode=prefill,  # type: ignore[arg-type]
                           decode_buckets=DECODE_BUCKETS, prefill_buckets=PREFILL_BUCKETS),
        attention_backend="triton", max_decode_batch=8, max_prefill_tokens=512)
    return Executor(cfg, tp)


@pytest.fixture(scope="module")
def tp() -> Iterator[TensorParallel]:
    with world_of_one(torch.device(DEVICE)) as group:
        yield group


@contextmanager
def counting(tp: TensorParallel) -> Iterator[dict[str, int]]:
    """Count the collectives the model calls while the block runs. Only around the decode
    capture (full or breakable: no Dynamo): a compiled tc_piecewise piece that traced these
    wrappers would guard on the counter's value and recompile on every call past its limit."""
    calls = {"reduce": 0, "gather": 0}
    reduce, gather = tp.all_reduce, tp.all_gather

    def counted_reduce(x: torch.Tensor) -> torch.Tensor:
        calls["reduce"] += 1
        return reduce(x)

    def counted_gather(x: torch.Tensor) -> torch.Tensor:
        calls["gather"] += 1
        return gather(x)

    object.__setattr__(tp, "all_reduce", counted_reduce)
    object.__setattr__(tp, "all_gather", counted_gather)
    try:
        yield calls
    finally:
        object.__delattr__(tp, "all_reduce")
        object.__delattr__(tp, "all_gather")


@pytest.mark.parametrize(("decode", "prefill"), MODES)
def test_world_of_one_graphs_replay_the_plain_executors_tokens(
        model_path: Path, tp: TensorParallel, decode: str, prefill: str) -> None:
    plain = make(model_path, decode, prefill)
    plain.capture(["decode", "prefill"])
    prompts = [rand_tokens(n, seed=n) for n in (5, 40, 90)]
    want = transcript(plain, prompts, steps=8)
    del plain
    torch.cuda.empty_cache()

    ex = make(model_path, decode, prefill, tp)
    assert ex.channel is not None  # the distributed path: steps go through the channel
    with counting(tp) as calls:
        for phase in ex.capture(["decode"]):
            assert all(b.ok for b in phase.buckets), phase
    # every captured decode forward has its 2 per layer + the embedding's all-reduce and
    # the LM head's all-gather (warm-up and capture: at least one forward each)
    assert calls["reduce"] >= len(DECODE_BUCKETS) * (1 + 2 * ex.spec.num_layers), calls
    assert calls["gather"] >= len(DECODE_BUCKETS), calls
    for phase in ex.capture(["prefill"]):
        assert all(b.ok for b in phase.buckets), phase
    _check_world_of_one(ex, prompts, want)


def _check_world_of_one(ex: Executor, prompts: list[list[int]], want: list[list[int]]) -> None:
    assert ex.status().graphs[0].captured_sizes == DECODE_BUCKETS
    assert transcript(ex, prompts, steps=8) == want

    # the decode steps really replayed graphs holding the collectives
    out = ex.prefill([PrefillItem("g", prompts[1])])
    step = ex.decode([DecodeItem("g", int(out.outputs[0].token_id))])  # type: ignore[arg-type]
    assert step.step.path == "graph", step.step
    ex.release(["g"])

    # graph logits against the same executor's eager forward, at every decode bucket
    for bs in DECODE_BUCKETS:
        ids = [f"d{bs}-{i}" for i in range(bs)]
        ex.prefill([PrefillItem(sid, rand_tokens(7 + i, seed=i)) for i, sid in enumerate(ids)])
        alloc = ex.kv.allocate([(sid, 1) for sid in ids])
        graph, eager = graph_and_eager(ex, ex.runners["decode"], "decode",
                                       rand_tokens(bs, seed=bs), alloc, bs)
        torch.testing.assert_close(graph, eager, atol=LOGIT_ATOL, rtol=LOGIT_RTOL)
        assert_same_greedy(graph, eager)
        ex.release(ids)
    ex.kv.check_invariants()


def test_world_of_one_graphs_agree_with_eager_greedy(model_path: Path,
                                                     tp: TensorParallel) -> None:
    ex = make(model_path, "full", "breakable", tp)
    ex.capture(["decode", "prefill"])
    eager = make(model_path, "disabled", "disabled")
    greedy_agrees(ex, eager)
