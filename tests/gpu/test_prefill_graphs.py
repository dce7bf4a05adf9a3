"""Breakable prefill graphs (and breakable decode) against eager on the GPU (marker ``gpu``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from executor.api import DecodeItem, PrefillItem
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from executor.executor import Executor
from executor.forward_batch import ForwardBatch
from tests.gpu.test_decode_graphs import gpu_model

pytestmark = pytest.mark.gpu

PREFILL_BUCKETS = (4, 8, 16, 32, 64, 128, 256, 512)


def make(path: Path, prefill: str = "breakable", decode: str = "full") -> Executor:
    cfg = ExecutorConfig(
        model=ModelConfig(source=str(path), dtype="bfloat16"), device="cuda",
        cache=CacheConfig(kv_tokens=64 * 1024, max_sequences=32, max_context=2048),
        graphs=GraphConfig(decode_mode=decode, prefill_mode=prefill,  # type: ignore[arg-type]
                           decode_buckets=(1, 2, 4, 8, 16), prefill_buckets=PREFILL_BUCKETS),
        attention_backend="triton", max_decode_batch=16, max_prefill_tokens=512)
    return Executor(cfg)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gpu_model(tmp_path_factory.mktemp("m"))


@pytest.fixture(scope="module")
def ex(model_path: Path) -> Executor:
    ex = make(model_path)
    caps = {c.phase: c for c in ex.capture(["decode", "prefill"])}
    assert all(b.ok for b in caps["prefill"].buckets), caps["prefill"]
    assert caps["prefill"].backend == "breakable"
    return ex


def rand_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def compare(ex: Executor, chunks: dict[str, list[int]]) -> None:
    """One packed batch through eager and through the graph: logits of every token."""
    alloc = ex.kv.allocate([(s, len(t)) for s, t in chunks.items()])
    batch = ForwardBatch.build("prefill", [t for ts in chunks.values() for t in ts], alloc, [],
                               ex.device)
    batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens,
                                                                   device=ex.device))
    eager = ex.forward_logits(batch).clone()
    decision = ex._decide(batch)
    assert decision.use_graph, decision
    graph = ex.runners["prefill"].replay(batch, decision.bucket).clone()  # type: ignore[arg-type]
    torch.testing.assert_close(graph, eager, atol=3e-2, rtol=3e-2)
    agree = (graph.argmax(-1) == eager.argmax(-1)).float().mean().item()
    assert agree > 0.99, agree


@pytest.mark.parametrize("n", [1, 4, 5, 31, 64, 100, 257, 512])
def test_single_sequence_every_bucket(ex: Executor, n: int) -> None:
    compare(ex, {"s": rand_tokens(n, n)})
    ex.release(["s"])
    ex.kv.check_invariants()


def test_multi_sequence_new_and_continuing(ex: Executor) -> None:
    compare(ex, {"a": rand_tokens(40, 1), "b": rand_tokens(3, 2)})
    # a and b continue (extend with prefix), c and d are new, all in one batch.
    compare(ex, {"a": rand_tokens(17, 3), "c": rand_tokens(60, 4), "b": rand_tokens(1, 5),
                 "d": rand_tokens(9, 6)})
    ex.release(["a", "b", "c", "d"])
    ex.kv.check_invariants()


def test_greedy_tokens_equal_eager_executor(ex: Executor, model_path: Path) -> None:
    eager = make(model_path, prefill="disabled", decode="disabled")
    runs = []
    for e in (ex, eager):
        res = e.prefill([PrefillItem(f"q{i}", rand_tokens(10 + 37 * i, i)) for i in range(5)])
        assert res.step.path == ("graph" if e is ex else "eager")
        seqs = {o.seq_id: [int(o.token_id)] for o in res.outputs}  # type: ignore[arg-type]
        # a continuing chunk for two of them, then decode
        more = e.prefill([PrefillItem("q0", [5, 6, 7]), PrefillItem("q3", [8])])
        for o in more.outputs:
            seqs[o.seq_id] = [int(o.token_id)]  # type: ignore[arg-type]
        for _ in range(10):
            out = e.decode([DecodeItem(s, t[-1]) for s, t in seqs.items()])
            for o in out.outputs:
                seqs[o.seq_id].append(int(o.token_id))  # type: ignore[arg-type]
        runs.append(seqs)
        e.release(list(seqs))
    assert runs[0] == runs[1]


def test_breakable_decode_equals_full_decode(model_path: Path) -> None:
    full, brk = make(model_path, "disabled", "full"), make(model_path, "disabled", "breakable")
    runs = []
    for e in (full, brk):
        cap = e.capture(["decode"])[0]
        assert cap.backend == e.config.graphs.decode_mode and all(b.ok for b in cap.buckets)
        res = e.prefill([PrefillItem(f"r{i}", rand_tokens(20 + 9 * i, 50 + i)) for i in range(7)])
        seqs = {o.seq_id: [int(o.token_id)] for o in res.outputs}  # type: ignore[arg-type]
        for _ in range(15):
            out = e.decode([DecodeItem(s, t[-1]) for s, t in seqs.items()])
            assert out.step.path == "graph" and out.step.padded_tokens == 1
            for o in out.outputs:
                seqs[o.seq_id].append(int(o.token_id))  # type: ignore[arg-type]
        runs.append(seqs)
    assert runs[0] == runs[1]


def test_too_many_tokens_fall_back(ex: Executor) -> None:
    # 600 tokens: above the largest bucket (512) but allowed by max_context
    ex_big = ex
    alloc = ex_big.kv.allocate([("big", 600)])
    batch = ForwardBatch.build("prefill", rand_tokens(600, 9), alloc, [0], ex.device)
    assert ex_big._decide(batch).reason is not None
    assert ex_big._decide(batch).reason.value == "exceeds_largest_bucket"  # type: ignore[union-attr]
    ex_big.kv.rollback(alloc)
