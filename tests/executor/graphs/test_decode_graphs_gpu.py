"""Decode CUDA graphs against eager decode on the GPU (marker ``gpu``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor.api import DecodeItem, FallbackReason, PrefillItem, SamplingParams
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from executor.executor import Executor
from tests.helpers.gpu import (
    LOGIT_ATOL,
    LOGIT_RTOL,
    assert_same_greedy,
    clear_choices_agree,
    gpu_model,
    graph_and_eager,
)

pytestmark = pytest.mark.gpu

BUCKETS = (1, 2, 4, 8, 16, 24, 32)


def make(path: Path, decode_mode: str = "full") -> Executor:
    cfg = ExecutorConfig(
        model=ModelConfig(source=str(path), dtype="bfloat16"), device="cuda",
        cache=CacheConfig(kv_tokens=64 * 1024, max_sequences=64, max_context=2048),
        graphs=GraphConfig(decode_mode=decode_mode, prefill_mode="disabled",  # type: ignore[arg-type]
                           decode_buckets=BUCKETS),
        attention_backend="triton", max_decode_batch=32)
    return Executor(cfg)


@pytest.fixture(scope="module")
def ex(tmp_path_factory: pytest.TempPathFactory) -> Executor:
    ex = make(gpu_model(tmp_path_factory.mktemp("m")))
    results = ex.capture(["decode"])
    assert all(b.ok for b in results[0].buckets), results
    assert ex.status().graphs[0].captured_sizes == BUCKETS
    return ex


def _prefill(ex: Executor, n: int, tag: str) -> dict[str, int]:
    """Admit ``n`` sequences of random lengths 1..599, in calls that fit the token limit."""
    gen = torch.Generator().manual_seed(n)
    lens = torch.randint(1, 600, (n,), generator=gen).tolist()
    items = [PrefillItem(f"{tag}{i}", torch.randint(0, 1024, (ln,), generator=gen).tolist())
             for i, ln in enumerate(lens)]
    out: dict[str, int] = {}
    call: list[PrefillItem] = []
    for item in [*items, None]:
        if item is None or sum(len(c.token_ids) for c in call) + len(item.token_ids) > 8192:
            out.update({o.seq_id: int(o.token_id)  # type: ignore[arg-type]
                        for o in ex.prefill(call).outputs})
            call = []
        if item is not None:
            call.append(item)
    return out


@pytest.mark.parametrize("bs", [1, 2, 3, 5, 8, 13, 24, 32])
def test_graph_logits_equal_eager_at_every_bucket(ex: Executor, bs: int) -> None:
    """Same batch through eager and through the graph (KV writes are identical)."""
    last = _prefill(ex, bs, f"b{bs}-")
    runner = ex.runners["decode"]
    for _ in range(12):  # growing contexts
        alloc = ex.kv.allocate([(sid, 1) for sid in last])
        decision = ex.forward.decide("decode", bs)
        assert decision.use_graph and decision.bucket is not None
        graph, eager = graph_and_eager(ex, runner, "decode", list(last.values()), alloc,
                                       decision.bucket)
        torch.testing.assert_close(graph, eager, atol=LOGIT_ATOL, rtol=LOGIT_RTOL)
        assert_same_greedy(graph, eager)
        last = dict(zip(last, graph.argmax(-1).tolist(), strict=True))
    ex.release(list(last))
    ex.kv.check_invariants()


def test_context_tier_twins_serve_short_batches(ex: Executor) -> None:
    """Small buckets get a twin graph per context tier that cuts their attention's split
    count at least threefold; a step takes the smallest tier its longest sequence fits, and
    its logits match eager decode (which launches for the same tier) and the general
    graph of the bucket on the same batch."""
    runner, attn = ex.runners["decode"], ex.attn
    # The test model has 2 KV heads: 64 splits at batch 1 and 2 for 2048 tokens, 33 at 4;
    # 16 for 512 tokens.
    assert attn.decode_context_tiers == (512,)
    assert runner.context_tiers() == {1: (512,), 2: (512,)}
    gen = torch.Generator().manual_seed(3)
    for n, tier in ((300, 512), (511, 512), (512, None), (1500, None)):
        prompt = torch.randint(0, 1024, (n,), generator=gen).tolist()
        token = int(ex.prefill([PrefillItem(f"tier{n}", prompt)]).outputs[0].token_id)  # type: ignore[arg-type]
        alloc = ex.kv.allocate([(f"tier{n}", 1)])  # the step's sequence has n + 1 tokens
        assert attn.decode_tier(1, n + 1) == tier
        twin, eager = graph_and_eager(ex, runner, "decode", [token], alloc, 1)
        torch.testing.assert_close(twin, eager, atol=LOGIT_ATOL, rtol=LOGIT_RTOL)
        assert_same_greedy(twin, eager)
        tiers = runner._tiers.pop(1)  # the same batch through the general graph
        try:
            general, _ = graph_and_eager(ex, runner, "decode", [token], alloc, 1)
        finally:
            runner._tiers[1] = tiers
        if tier is None:
            assert torch.equal(twin, general)
        else:
            torch.testing.assert_close(twin, general, atol=LOGIT_ATOL, rtol=LOGIT_RTOL)
        ex.release([f"tier{n}"])
    ex.kv.check_invariants()


def test_greedy_tokens_equal_eager_executor(ex: Executor, tmp_path: Path) -> None:
    """Public decode API, graph executor vs an eager one on the same weights, 30 steps.

    Both are fed the graph executor's tokens (teacher forcing), so one bf16 near-tie cannot
    make the sequences diverge; the tokens must agree at every step whose top-2 logprob
    margin is clear of bf16 noise, and nearly everywhere overall.
    """
    eager = make(gpu_model(tmp_path), decode_mode="disabled")
    params = SamplingParams(logprobs=True, top_logprobs=2)
    toks = _prefill(ex, 11, "g")
    assert _prefill(eager, 11, "g") == toks
    agree = total = 0
    for _ in range(30):
        items = [DecodeItem(s, t, params) for s, t in toks.items()]
        g, e = ex.decode(items), eager.decode(items)
        agree += clear_choices_agree(g, e)
        total += len(g.outputs)
        toks = {o.seq_id: int(o.token_id) for o in g.outputs}  # type: ignore[arg-type]
    assert agree / total > 0.97, (agree, total)
    for e in (ex, eager):
        e.release(list(toks))
        assert e.kv_stats().free_tokens == e.kv_stats().total_tokens


def test_batch_above_max_falls_back_with_reason(tmp_path: Path) -> None:
    cfg_ex = make(gpu_model(tmp_path))
    cfg_ex.capture(["decode"])
    toks = _prefill(cfg_ex, 40, "big")  # 40 > largest bucket 32, but <= max_sequences
    # The executor's decode batch limit is 32, so ask the decision directly for 40.
    assert cfg_ex.forward.decide("decode", len(toks)).reason == FallbackReason.TOO_LARGE


def test_recapture_with_force_and_injected_failure(tmp_path: Path) -> None:
    e = make(gpu_model(tmp_path))
    runner = e.runners["decode"]

    def fail_at_4(bucket: int) -> None:
        if bucket == 4:
            raise torch.cuda.OutOfMemoryError("injected capture failure")

    runner.before_capture = fail_at_4  # type: ignore[attr-defined]
    res = e.capture(["decode"])[0]
    failed = [b for b in res.buckets if not b.ok]
    assert [b.size for b in failed] == [4] and "injected" in failed[0].error
    assert set(e.status().graphs[0].captured_sizes) == set(BUCKETS) - {4}
    toks = _prefill(e, 3, "f")
    res3 = e.decode([DecodeItem(s, t) for s, t in toks.items()])
    assert (res3.step.path, res3.step.fallback_reason) == ("eager", "capture_failed")
    toks5 = _prefill(e, 5, "h")
    res5 = e.decode([DecodeItem(s, t) for s, t in toks5.items()])
    assert res5.step.path == "graph" and res5.step.padded_tokens == 3
    runner.before_capture = None  # type: ignore[attr-defined]
    again = e.capture(["decode"], force=True)[0]
    assert all(b.ok for b in again.buckets) and len(again.buckets) == len(BUCKETS)
    res3 = e.decode([DecodeItem(s, o.token_id) for s, o in  # type: ignore[misc]
                     zip(toks, res3.outputs, strict=True)])
    assert res3.step.path == "graph"
    torch.cuda.synchronize()
    seconds = e.drain_replay_seconds()["decode"]
    assert len(seconds) >= 2 and all(0 < x < 1 for x in seconds)
    assert e.drain_replay_seconds()["decode"] == []  # drained


def test_a_greedy_step_samples_the_graph_argmax(ex: Executor,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each decode graph computes its rows' argmax after the logits (and their masks): it
    is the split argmax of the replay's logits exactly, and a greedy step samples it
    instead of launching an argmax of its own. A multi-step decode keeps each step's
    tokens (the graph's buffer is the next replay's): its steps equal single steps."""
    import executor.sampling as sampling_mod
    from executor.kernels import argmax as argmax_mod

    runner = ex.runners["decode"]
    last = _prefill(ex, 5, "am")
    for _ in range(4):
        alloc = ex.kv.allocate([(sid, 1) for sid in last])
        graph, _ = graph_and_eager(ex, runner, "decode", list(last.values()), alloc, 8)
        greedy = runner.greedy(5)
        assert greedy is not None
        assert torch.equal(greedy, argmax_mod.argmax_rows(graph.contiguous()))
        last = dict(zip(last, greedy.tolist(), strict=True))
    ex.release(list(last))

    calls = {"n": 0}
    real = sampling_mod.argmax_rows

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls["n"] += 1
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sampling_mod, "argmax_rows", counted)
    a, b = _prefill(ex, 3, "ma"), _prefill(ex, 3, "mb")
    assert list(a.values()) == list(b.values())
    calls["n"] = 0
    multi = ex.decode([DecodeItem(s, t) for s, t in a.items()], num_steps=4)
    singles = []
    toks = b
    for _ in range(4):
        out = ex.decode([DecodeItem(s, t) for s, t in toks.items()])
        assert out.step.path == "graph"
        toks = {o.seq_id: int(o.token_id) for o in out.outputs}  # type: ignore[arg-type]
        singles.append(list(toks.values()))
    assert calls["n"] == 0  # every greedy step took the graph's argmax
    assert [[s.token_id for s in o.steps] for o in multi.outputs] == \
        [list(col) for col in zip(*singles, strict=True)]
    ex.release([*a, *b])
    ex.kv.check_invariants()


@pytest.mark.parametrize("bs", [1, 3, 5])
def test_the_graph_stores_greedy_tokens_at_live_slots_only(ex: Executor, bs: int) -> None:
    """A decode graph's argmax also writes each live row's token to its slot of the last
    sampled tokens (the sampler then stores nothing); a padded row of the bucket (3 rows
    in bucket 4, 5 in 8), whose slot is a placeholder, writes nowhere, so every other
    slot keeps its token. Steps reading those tokens on the device equal steps of a twin
    batch (the same prompts) fed the same tokens from the host."""
    assert ex.runners["decode"].stores_greedy
    on_device, from_host = _prefill(ex, bs, f"sd{bs}-"), _prefill(ex, bs, f"sh{bs}-")
    assert list(on_device.values()) == list(from_host.values())
    for _ in range(3):
        slots = [ex.kv.get(s).slot for s in on_device]  # type: ignore[union-attr]
        before = ex.last.tokens.clone()
        out = ex.decode([DecodeItem(s, None) for s in on_device])
        assert out.step.path == "graph"
        toks = [int(o.token_id) for o in out.outputs]  # type: ignore[arg-type]
        after = ex.last.tokens.clone()
        assert after[slots].tolist() == toks
        others = torch.ones_like(after, dtype=torch.bool)
        others[slots] = False
        assert torch.equal(after[others], before[others])
        twin = ex.decode([DecodeItem(s, t) for s, t in from_host.items()])
        assert [int(o.token_id) for o in twin.outputs] == toks  # type: ignore[arg-type]
        from_host = dict(zip(from_host, toks, strict=True))
    ex.release([*on_device, *from_host])
    ex.kv.check_invariants()


def test_replay_timer_records_drained_events_again(ex: Executor) -> None:
    """Each replay is timed by a pair of CUDA events; once drained, a pair is recorded
    again by a later replay (no event made per step), and every replay is still timed."""
    timer = ex.runners["decode"].timer
    toks = _prefill(ex, 2, "rt")
    ex.drain_replay_seconds()
    seen: list[int] = []
    real = timer.start

    def start() -> tuple[torch.cuda.Event, torch.cuda.Event]:
        pair = real()
        seen.append(id(pair[0]))
        return pair

    timer.start = start  # type: ignore[method-assign]
    try:
        for _ in range(12):
            out = ex.decode([DecodeItem(s, t) for s, t in toks.items()])
            toks = {o.seq_id: int(o.token_id) for o in out.outputs}  # type: ignore[arg-type]
            torch.cuda.synchronize()
            spans = ex.drain_replay_seconds()["decode"]
            assert len(spans) == 1 and spans[0] > 0
    finally:
        del timer.start
    assert len(seen) == 12 and len(set(seen)) <= 2, seen
    ex.release(list(toks))
