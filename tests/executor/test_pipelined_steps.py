"""Launched steps (``launch_*`` / ``complete`` / ``abort``), device-resident last tokens and
multi-step decode, against the synchronous calls they must equal.

The reference is a second executor on the same weights driven one synchronous call at a
time with explicit token ids; the pipelined one keeps up to two steps in flight and lets
decode items continue from the token their sequence sampled last, on the device.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from executor.api import DecodeItem, PrefillItem, SamplingParams, StepResult
from executor.config import CacheConfig, ExecutorConfig
from executor.errors import ContextLengthExceeded, InvalidRequest, OutOfResources
from executor.executor import Executor
from executor.steps import PendingStep


def make(kv_tokens: int = 4096) -> Executor:
    return Executor(ExecutorConfig(cache=CacheConfig(kv_tokens=kv_tokens, max_sequences=16,
                                                     max_context=512)))


def params(rng: random.Random) -> SamplingParams:
    if rng.random() < 0.4:
        return SamplingParams(logprobs=True, top_logprobs=2)  # greedy
    return SamplingParams(temperature=0.9, top_p=0.95, seed=rng.randrange(1 << 30),
                          logprobs=True, top_logprobs=2)


def outputs(result: StepResult) -> list[tuple[object, ...]]:
    return [(o.seq_id, o.token_id, o.seq_len, o.stopped,
             tuple(s.token_id for s in o.steps),
             None if o.logprob is None else round(o.logprob, 5)) for o in result.outputs]


class Pipelined:
    """Drives ``ex`` with up to ``depth`` launched steps; results come back in order."""

    def __init__(self, ex: Executor, depth: int) -> None:
        self.ex, self.depth = ex, depth
        self.inflight: deque[PendingStep] = deque()
        self.results: list[StepResult] = []

    def launch(self, step: PendingStep) -> None:
        self.inflight.append(step)
        while len(self.inflight) > self.depth - 1:
            self.results.append(self.ex.complete(self.inflight.popleft()))

    def drain(self) -> None:
        while self.inflight:
            self.results.append(self.ex.complete(self.inflight.popleft()))


@pytest.mark.parametrize("seed", range(8))
def test_pipelined_steps_equal_synchronous_calls(seed: int) -> None:
    """Random mixes of prefill, chunked extend, decode (continuing from the device's last
    sampled token), multi-step decode, fork, truncate and release over many sequences."""
    rng = random.Random(seed)
    ref, ex = make(), make()
    pipe = Pipelined(ex, depth=2)
    expected: list[StepResult] = []
    last: dict[str, int | None] = {}  # reference's last sampled token (None: did not sample)
    for step in range(40):
        live = [s for s in last]
        kind = rng.choice(["prefill", "decode", "decode", "multi", "release", "fork",
                           "truncate"] if live else ["prefill"])
        if kind in ("prefill", "fork") and len(live) > 12:  # 16 slots
            kind = "release"
        if kind == "prefill":
            new = [f"s{step}-{i}" for i in range(rng.randint(1, 3))]
            ext = rng.sample(live, k=min(len(live), rng.randint(0, 1)))
            items = [PrefillItem(s, [rng.randrange(512) for _ in range(rng.randint(1, 9))],
                                 sample=rng.random() < 0.8, sampling=params(rng))
                     for s in new + ext]
            expected.append(ref.prefill(items))
            pipe.launch(ex.launch_prefill(items))
            for it, out in zip(items, expected[-1].outputs, strict=True):
                last[it.seq_id] = out.token_id
        elif kind in ("decode", "multi"):
            chosen = rng.sample(live, k=rng.randint(1, len(live)))
            k = rng.randint(2, 4) if kind == "multi" else 1
            p = {s: params(rng) for s in chosen}
            # The reference gives every token; the pipelined executor continues from the
            # device wherever the sequence's last step sampled.
            ref_items: list[DecodeItem] = []
            dec_items: list[DecodeItem] = []
            for s in chosen:
                tok = last[s] if last[s] is not None else rng.randrange(512)
                ref_items.append(DecodeItem(s, tok, p[s]))
                dec_items.append(DecodeItem(s, None if last[s] is not None else tok, p[s]))
            expected.append(ref.decode(ref_items, num_steps=k))
            pipe.launch(ex.launch_decode(dec_items, num_steps=k))
            for out in expected[-1].outputs:
                last[out.seq_id] = out.token_id
        elif kind == "fork":  # no drain: a fork reads host state and orders on the device
            parent = rng.choice(live)
            length = ref.kv.get(parent).length  # type: ignore[union-attr]
            prefix = length if rng.random() < 0.5 else rng.randint(0, length)
            child = f"f{step}"
            assert ex.fork(parent, child, prefix) == ref.fork(parent, child, prefix)
            last[child] = last[parent] if prefix == length else None
        elif kind == "truncate":  # ordered after the in-flight steps, as a Session does
            s = rng.choice(live)
            length = ref.kv.get(s).length  # type: ignore[union-attr]
            keep = rng.randint(0, length)
            pipe.drain()
            assert ex.truncate(s, keep) == ref.truncate(s, keep)
            if keep < length:
                last[s] = None
        else:  # a release is ordered after the sequence's in-flight steps
            gone = rng.sample(live, k=1)
            pipe.drain()
            assert ex.release(gone) == ref.release(gone)
            for s in gone:
                del last[s]
    pipe.drain()
    assert [outputs(r) for r in pipe.results] == [outputs(r) for r in expected]
    assert [r.step.num_steps for r in pipe.results] == [r.step.num_steps for r in expected]
    assert ex.kv_stats() == ref.kv_stats()
    ex.kv.check_invariants()


def test_multi_step_decode_equals_single_steps() -> None:
    seeded = SamplingParams(temperature=0.8, seed=11, logprobs=True, top_logprobs=3)
    one, many = make(), make()
    prompt = [PrefillItem("a", [3, 1, 4, 1, 5], sampling=seeded),
              PrefillItem("b", [2, 7], sampling=SamplingParams(logprobs=True))]
    first = one.prefill(prompt)
    assert outputs(first) == outputs(many.prefill(prompt))
    toks = {o.seq_id: o.token_id for o in first.outputs}
    singles = []
    for _ in range(6):
        res = one.decode([DecodeItem(s, t, seeded if s == "a" else SamplingParams(logprobs=True))
                          for s, t in toks.items()])
        singles.append(res)
        toks = {o.seq_id: o.token_id for o in res.outputs}
    multi = many.decode([DecodeItem("a", None, seeded),
                         DecodeItem("b", None, SamplingParams(logprobs=True))], num_steps=6)
    assert multi.step.num_steps == 6 and multi.step.num_tokens == 12
    for i, out in enumerate(multi.outputs):
        assert [s.token_id for s in out.steps] == [r.outputs[i].token_id for r in singles]
        assert [s.logprob for s in out.steps] == [r.outputs[i].logprob for r in singles]
        assert [s.top_logprobs for s in out.steps] == [r.outputs[i].top_logprobs
                                                       for r in singles]
        assert out.token_id == out.steps[-1].token_id and not out.stopped
        assert out.seq_len == singles[-1].outputs[i].seq_len
    assert one.kv_stats() == many.kv_stats()


def test_stop_tokens_end_a_sequence_output_and_keep_its_kv_counted() -> None:
    ref, ex = make(), make()
    ref.prefill([PrefillItem("a", [9, 8, 7])])
    ex.prefill([PrefillItem("a", [9, 8, 7])])
    free = ref.decode([DecodeItem("a", None)], num_steps=5).outputs[0]
    stop = free.steps[2].token_id
    assert stop not in [s.token_id for s in free.steps[:2]]
    out = ex.decode([DecodeItem("a", None, stop_token_ids=(stop,))], num_steps=5).outputs[0]
    assert [s.token_id for s in out.steps] == [s.token_id for s in free.steps[:3]]
    assert out.stopped and out.token_id == stop
    assert out.seq_len == free.seq_len == 3 + 5  # the KV of all five steps stays counted
    ex.kv.check_invariants()


def test_aborted_steps_roll_back_newest_first_and_forget_their_samples() -> None:
    ex = make()
    ex.prefill([PrefillItem("a", [1, 2, 3])])
    before = ex.kv_stats()
    a = ex.launch_decode([DecodeItem("a", None)], num_steps=3)
    b = ex.launch_prefill([PrefillItem("a", [4]), PrefillItem("new", [5, 6])])
    ex.abort(b)
    ex.abort(a)
    assert ex.kv_stats() == before and ex.kv.get("a").length == 3  # type: ignore[union-attr]
    ex.kv.check_invariants()
    # The device token was overwritten by the aborted step: it cannot be continued from.
    with pytest.raises(InvalidRequest, match="no sampled token to continue from"):
        ex.decode([DecodeItem("a", None)])
    assert ex.decode([DecodeItem("a", 7)]).outputs[0].seq_len == 4
    with pytest.raises(ValueError, match="completed step"):
        ex.abort(a)


def test_failed_launch_applies_nothing() -> None:
    ex = make(kv_tokens=64)
    ex.prefill([PrefillItem("a", [1, 2, 3]), PrefillItem("b", list(range(50)))])
    before = ex.kv_stats()
    with pytest.raises(OutOfResources):  # 20 tokens asked, 11 free: retryable
        ex.launch_decode([DecodeItem("a", None)], num_steps=20)
    with pytest.raises(ContextLengthExceeded):  # past the pool itself: never fits
        ex.launch_decode([DecodeItem("a", None)], num_steps=100)
    with pytest.raises(InvalidRequest, match="num_steps"):
        ex.launch_decode([DecodeItem("a", None)], num_steps=0)
    assert ex.kv_stats() == before
    ex.prefill([PrefillItem("a", [4], sample=False)])
    with pytest.raises(InvalidRequest, match=r"items\[0\]\.use_last_sampled"):
        ex.launch_decode([DecodeItem("a", None)])
    ex.kv.check_invariants()


def test_a_step_hands_its_buffers_back_once_when_completed_or_aborted() -> None:
    """``recycle`` (the event and staging buffers' way back to the launcher's pools) runs
    exactly once: after a completed step's outputs are read, or after an abort."""
    ex = make()
    ex.prefill([PrefillItem("a", [1, 2, 3]), PrefillItem("b", [4, 5])])
    recycled: list[PendingStep] = []
    done = ex.launch_decode([DecodeItem("a", None), DecodeItem("b", None)])
    aborted = ex.launch_decode([DecodeItem("a", None)])
    for step in (done, aborted):
        step.recycle = recycled.append  # on CUDA the executor sets its own
    ex.abort(aborted)
    assert recycled == [aborted]
    result = ex.complete(done)
    assert recycled == [aborted, done] and [o.seq_len for o in result.outputs] == [4, 3]
    done.recycled()  # a second hand-back does nothing
    assert recycled == [aborted, done]
