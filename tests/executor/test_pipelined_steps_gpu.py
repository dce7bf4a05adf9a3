"""Launched steps on the GPU (marker ``gpu``): the device-resident last token read by the
captured decode prologue, and steps launched ahead of the device, against eager and
synchronous steps."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import pytest

from executor.api import DecodeItem, PrefillItem, SamplingParams, StepResult
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from executor.executor import Executor
from executor.steps import PendingStep
from tests.helpers.gpu import clear_choices_agree, rand_tokens

pytestmark = pytest.mark.gpu


def make(path: Path, decode: str) -> Executor:
    ex = Executor(ExecutorConfig(
        model=ModelConfig(source=str(path), dtype="bfloat16"), device="cuda",
        cache=CacheConfig(kv_tokens=64 * 1024, max_sequences=32, max_context=2048),
        graphs=GraphConfig(decode_mode=decode, prefill_mode="disabled",
                           decode_buckets=(1, 2, 4, 8, 16)),
        attention_backend="triton", max_decode_batch=16))
    if decode != "disabled":
        assert all(b.ok for b in ex.capture(["decode"])[0].buckets)
    return ex


def flat(result: StepResult) -> list[tuple[object, ...]]:
    return [(o.seq_id, o.token_id, o.logprob, o.top_logprobs, o.seq_len,
             tuple((s.token_id, s.logprob) for s in o.steps)) for o in result.outputs]


PARAMS = [SamplingParams(logprobs=True, top_logprobs=2),
          SamplingParams(temperature=0.9, seed=5, logprobs=True, top_logprobs=2)]


@pytest.mark.parametrize("decode", ["full", "breakable"])
def test_launched_steps_equal_synchronous_steps_bit_for_bit(model_path: Path,
                                                            decode: str) -> None:
    """Two steps in flight, decode items continuing from the device's last samples, a
    multi-step decode among them: every token and logprob equals the synchronous run that
    gives explicit tokens."""
    sync, piped = make(model_path, decode), make(model_path, decode)
    prompt = [PrefillItem(f"s{i}", rand_tokens(10 + 23 * i, i), sampling=PARAMS[i % 2])
              for i in range(5)]
    expected = [sync.prefill(prompt)]
    toks = {o.seq_id: o.token_id for o in expected[0].outputs}
    inflight: deque[PendingStep] = deque([piped.launch_prefill(prompt)])
    got: list[StepResult] = []
    for step in range(12):
        k = 4 if step == 6 else 1
        ids = sorted(toks)[: 5 - step % 3]
        expected.append(sync.decode([DecodeItem(s, toks[s], PARAMS[int(s[1:]) % 2])
                                     for s in ids], num_steps=k))
        inflight.append(piped.launch_decode(
            [DecodeItem(s, None, PARAMS[int(s[1:]) % 2]) for s in ids], num_steps=k))
        if len(inflight) > 1:
            got.append(piped.complete(inflight.popleft()))
        toks.update({o.seq_id: o.token_id for o in expected[-1].outputs})
        assert expected[-1].step.path == "graph"
    got.extend(piped.complete(s) for s in inflight)
    assert [flat(r) for r in got] == [flat(r) for r in expected]
    assert piped.kv_stats() == sync.kv_stats()


def test_last_token_in_the_decode_prologue_equals_eager(model_path: Path) -> None:
    """Graph decode continuing from the device's last tokens vs eager decode given them:
    the same greedy tokens wherever the choice is clear of bf16 noise."""
    graph, eager = make(model_path, "full"), make(model_path, "disabled")
    params = SamplingParams(logprobs=True, top_logprobs=2)
    items = [PrefillItem(f"e{i}", rand_tokens(40 + 17 * i, 90 + i), sampling=params)
             for i in range(7)]
    first = graph.prefill(items)
    assert [o.token_id for o in first.outputs] == \
        [o.token_id for o in eager.prefill(items).outputs]
    toks = {o.seq_id: o.token_id for o in first.outputs}
    agree = total = 0
    for _ in range(10):
        g = graph.decode([DecodeItem(s, None, params) for s in toks])
        e = eager.decode([DecodeItem(s, t, params) for s, t in toks.items()])
        agree += clear_choices_agree(g, e)
        total += len(g.outputs)
        # Teacher forcing: the eager side is given the graph's tokens, which the graph side
        # reads from the device.
        toks = {o.seq_id: o.token_id for o in g.outputs}
    assert agree / total > 0.95


def test_pooled_events_and_buffers_are_reused_and_results_stay_exact(model_path: Path
                                                                    ) -> None:
    """Three steps in flight for 30 steps, then a launch that is aborted: the samples'
    pinned buffers and the steps' events come back to the executor's pools and are reused
    (a handful made, not one per step), and every result equals the synchronous run."""
    sync, piped = make(model_path, "full"), make(model_path, "full")
    params = SamplingParams(logprobs=True, top_logprobs=2)
    prompt = [PrefillItem(f"p{i}", rand_tokens(30 + 11 * i, 40 + i), sampling=params)
              for i in range(3)]
    expected = [sync.prefill(prompt)]
    got = [piped.prefill(prompt)]
    toks = {o.seq_id: o.token_id for o in expected[0].outputs}
    inflight: deque[PendingStep] = deque()
    for _ in range(30):
        expected.append(sync.decode([DecodeItem(s, t, params) for s, t in toks.items()]))
        toks = {o.seq_id: o.token_id for o in expected[-1].outputs}
        inflight.append(piped.launch_decode([DecodeItem(s, None, params) for s in toks]))
        if len(inflight) > 2:
            got.append(piped.complete(inflight.popleft()))
    got.extend(piped.complete(s) for s in inflight)
    assert [flat(r) for r in got] == [flat(r) for r in expected]
    # tokens, logprobs, top ids and top values per step: three kinds of buffer in flight
    # at most three deep (plus the prefill's own shapes)
    assert piped.pools._pinned.allocated <= 4 * 4 + 4
    events = len(piped.pools._events)
    assert 1 <= events <= 4
    step = piped.launch_decode([DecodeItem(s, None, params) for s in toks])
    assert len(piped.pools._events) == events - 1
    piped.abort(step)
    assert len(piped.pools._events) == events
