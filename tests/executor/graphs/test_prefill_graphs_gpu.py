"""Breakable and fixed-grid prefill graphs (and breakable decode) against eager on the GPU
(marker ``gpu``)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from executor.api import DecodeItem, PrefillItem, SamplingParams
from executor.executor import Executor
from tests.helpers.gpu import compare, greedy_agrees, rand_tokens
from tests.helpers.gpu import make_prefill_executor as make

pytestmark = pytest.mark.gpu

@pytest.fixture(scope="module", params=["breakable", "fixed_grid"])
def ex(model_path: Path, request: pytest.FixtureRequest) -> Executor:
    """An executor with prefill graphs of each mode that captures the runner's forward:
    eager attention between segments, or attention inside on a grid the bucket fixes."""
    ex = make(model_path, prefill=request.param)
    caps = {c.phase: c for c in ex.capture(["decode", "prefill"])}
    assert all(b.ok for b in caps["prefill"].buckets), caps["prefill"]
    assert caps["prefill"].backend == request.param
    return ex


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


def test_a_batch_packed_for_one_bucket_is_refused_at_another(ex: Executor) -> None:
    """Graphs take only a batch packed for their bucket: not one packed for another
    bucket, not one packed plain (whose fields are not where the prologue reads)."""
    alloc = ex.kv.allocate([("wrong-bucket", 5)])
    try:
        batch = ex.build_batch("prefill", rand_tokens(5, 3), alloc, [0], 8)
        assert batch.bucket == 8
        with pytest.raises(ValueError, match="packed for bucket 8"):
            ex.runners["prefill"].replay(batch, 16)
        plain = ex.build_batch("prefill", rand_tokens(5, 3), alloc, [0])
        with pytest.raises(ValueError, match="packed for bucket None"):
            ex.runners["prefill"].replay(plain, 8)
    finally:
        ex.kv.rollback(alloc)
    ex.kv.check_invariants()


def test_greedy_tokens_equal_eager_executor(ex: Executor, model_path: Path) -> None:
    """Public API: graph prefill (new + continuing) then decode, against an all-eager
    executor fed the same tokens; greedy choices agree wherever they are clear."""
    greedy_agrees(ex, make(model_path, prefill="disabled", decode="disabled"))


def test_graphs_at_the_smollm2_shape_equal_eager(smollm2_shape: Path) -> None:
    """SmolLM2-135M's odd shape (hidden 576, 9 query and 3 KV heads: a group of three),
    random weights: fixed-grid prefill graphs (attention captured) and full decode graphs
    against an all-eager executor, greedy wherever the choice is clear."""
    path = smollm2_shape
    ex = make(path, prefill="fixed_grid")
    caps = {c.phase: c for c in ex.capture(["decode", "prefill"])}
    assert caps["prefill"].backend == "fixed_grid"
    assert all(b.ok for c in caps.values() for b in c.buckets), caps
    greedy_agrees(ex, make(path, prefill="disabled", decode="disabled"))


def test_breakable_decode_equals_full_decode(model_path: Path) -> None:
    """Segments with eager attention between them vs one graph: same tokens wherever the
    choice is clear of bf16 noise, logprobs within bf16 tolerance (both fed the same
    tokens)."""
    full, brk = make(model_path, "disabled", "full"), make(model_path, "disabled", "breakable")
    for e in (full, brk):
        cap = e.capture(["decode"])[0]
        assert cap.backend == e.config.graphs.decode_mode and all(b.ok for b in cap.buckets)
    items = [PrefillItem(f"r{i}", rand_tokens(20 + 9 * i, 50 + i)) for i in range(7)]
    toks = {o.seq_id: int(o.token_id) for o in full.prefill(items).outputs}  # type: ignore[arg-type]
    brk.prefill(items)
    params = SamplingParams(logprobs=True, top_logprobs=2)
    for _ in range(15):
        dec = [DecodeItem(s, t, params) for s, t in toks.items()]
        a, b = full.decode(dec), brk.decode(dec)
        assert a.step.path == b.step.path == "graph" and a.step.padded_tokens == 1
        for oa, ob in zip(a.outputs, b.outputs, strict=True):
            (_, l1), (_, l2) = oa.top_logprobs[:2]
            if l1 - l2 > 0.05:
                assert oa.token_id == ob.token_id
            assert abs(oa.logprob - ob.logprob) < 0.05  # type: ignore[operator]
        toks = {o.seq_id: int(o.token_id) for o in a.outputs}  # type: ignore[arg-type]


def test_too_many_tokens_fall_back(ex: Executor) -> None:
    # 600 tokens: above the largest bucket (512); the fixture's call limit is 512 too,
    # so ask the decision directly
    decision = ex.forward.decide("prefill", 600)
    assert decision.bucket is None and decision.reason is not None
    assert decision.reason.value == "exceeds_largest_bucket"


def _free_after_gc() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


@pytest.mark.parametrize("prefill", ["breakable", "tc_piecewise", "fixed_grid"])
def test_graph_memory_is_given_back_on_release_and_reported_alike_on_recapture(
        model_path: Path, prefill: str) -> None:
    """A capture/release cycle leaks nothing, and a recapture reports what the first
    capture did: the figure is the graphs' own, not the capture stream's first-use costs
    (its cuBLAS workspace, kernels loaded on first use) nor warm-up activations."""
    e = make(model_path, prefill=prefill, decode="disabled")
    runner = e.runners["prefill"]
    first = e.capture(["prefill"])[0]
    assert all(b.ok for b in first.buckets) and first.memory_bytes > 0
    assert first.memory_bytes >= sum(b.memory_bytes for b in first.buckets)
    runner.release()
    free_a = _free_after_gc()
    again = e.capture(["prefill"], force=True)[0]
    assert abs(again.memory_bytes - first.memory_bytes) <= 0.1 * first.memory_bytes + 4 * 2**20
    runner.release()
    leaked = free_a - _free_after_gc()
    assert leaked <= 4 * 2**20, f"a capture/release cycle kept {leaked / 2**20:.1f} MiB"
    e.capture(["prefill"])
    assert e.prefill([PrefillItem("after", rand_tokens(37, 9))]).step.path == "graph"


def test_fixed_grid_needs_an_attention_backend_that_captures_prefill(model_path: Path
                                                                     ) -> None:
    from executor.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot be captured for prefill"):
        make(model_path, prefill="fixed_grid", decode="disabled", attention="torch_native")


def test_fixed_grid_runs_no_kernel_between_graph_replays(model_path: Path) -> None:
    """The whole prefill is one replay: no eager attention launch for a batch that fits a
    bucket (a breakable prefill launches one per layer)."""
    e = make(model_path, prefill="fixed_grid", decode="disabled")
    e.capture(["prefill"])
    calls = []
    real = e.attn.forward_into

    def spy(*args: object) -> None:
        calls.append(args[-1])
        real(*args)  # type: ignore[arg-type]

    e.attn.forward_into = spy  # type: ignore[method-assign]
    out = e.prefill([PrefillItem("a", rand_tokens(70, 3)), PrefillItem("b", rand_tokens(9, 4))])
    assert out.step.path == "graph" and calls == []
