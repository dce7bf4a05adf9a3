"""The decode launch's memo (``step_plan.DecodeMemo``, ``Executor._decode_memo``): a launch
whose items are the previous launch's objects, all continuing from their last samples,
skips validation and reuses that launch's columns, only while the KV cache changed in
nothing else.

Two executors on the same weights take the same random operations; one sends its
decode steps as the same item objects step after step (the memo may answer), the other
as new, equal objects every time (validated in full). Every outcome must be the same:
the outputs, the exception's type and message, and the cache's accounting."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from executor.api import DecodeItem, PrefillItem, SamplingParams
from executor.config import CacheConfig, ExecutorConfig
from executor.errors import ExecutorError
from executor.executor import Executor
from executor.steps import PendingStep

MAX_CONTEXT = 64


def make() -> Executor:
    return Executor(ExecutorConfig(cache=CacheConfig(kv_tokens=320, max_sequences=6,
                                                     max_context=MAX_CONTEXT),
                                   max_decode_batch=6))


def outcome(fn: Callable[..., object], *args: object) -> object:
    """``fn(*args)``: outputs of a step, the launched step itself, the repr of any other
    result, or the refusal's type and message."""
    try:
        result = fn(*args)
    except (ExecutorError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    if isinstance(result, PendingStep):
        return result
    outputs = getattr(result, "outputs", None)
    if outputs is None:
        return repr(result)
    return [(o.seq_id, o.token_id, o.seq_len, tuple(s.token_id for s in o.steps))
            for o in outputs]


@pytest.mark.parametrize("seed", range(12))
def test_the_memo_answers_as_full_validation_would(seed: int) -> None:
    rng = random.Random(seed)
    memo, full = make(), make()
    live: list[str] = []
    items: list[DecodeItem] = []  # the memo side's batch: the same objects each step
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.8, seed=seed)
    hits = 0
    for n in range(120):
        op = rng.choice(["prefill", *["decode"] * 8, "decode2", "release", "truncate",
                         "fork", "pipelined_abort", "rebatch", "rebatch"])
        if op == "prefill" or not live:
            sid = f"s{n}"
            req = [PrefillItem(sid, [rng.randrange(3, 200) for _ in range(rng.randint(2, 9))],
                               sample=rng.random() < 0.8)]
            got = [outcome(ex.prefill, req) for ex in (memo, full)]
            if isinstance(got[0], list):
                live.append(sid)
        elif op in ("decode", "decode2") and items:
            steps = 2 if op == "decode2" else 1
            before = memo._decode_memo
            hits += before is not None and before.repeats(
                items, steps, memo.kv.version, memo.limits.servable_context)
            got = [outcome(memo.decode, items, steps),
                   outcome(full.decode, [DecodeItem(*it) for it in items], steps)]
            if isinstance(got[0], tuple) and rng.random() < 0.7:
                items = []  # refused: the scheduler usually makes a new batch
        elif op == "release":
            sid = rng.choice(live)
            got = [outcome(ex.release, [sid]) for ex in (memo, full)]
            live.remove(sid)  # its items stay in the batch: the next decode must refuse
        elif op == "truncate":
            sid = rng.choice(live)
            length = max(1, (memo.kv.length(sid) or 1) - rng.randint(0, 3))
            got = [outcome(ex.truncate, sid, length) for ex in (memo, full)]
        elif op == "fork":
            parent, child = rng.choice(live), f"f{n}"
            got = [outcome(ex.fork, parent, child) for ex in (memo, full)]
            if not isinstance(got[0], tuple):  # not refused
                live.append(child)
        elif op == "pipelined_abort" and items:
            launched = [outcome(memo.launch_decode, items),
                        outcome(full.launch_decode, [DecodeItem(*it) for it in items])]
            got = ["launched" if isinstance(s, PendingStep) else s for s in launched]
            for ex, step in zip((memo, full), launched, strict=True):
                if isinstance(step, PendingStep):
                    ex.abort(step)
        else:  # a new batch, continuing on the device: mostly of sequences that can
            ready = [s for s in live if memo.last.has(s) and
                     (memo.kv.length(s) or 0) < MAX_CONTEXT - 4] if rng.random() < 0.8 else []
            pool = ready or live
            chosen = rng.sample(pool, rng.randint(1, len(pool)))
            items = [DecodeItem(s, None, rng.choice([greedy, sampled])) for s in chosen]
            continue
        assert got[0] == got[1], (n, op, got)
        assert memo.kv.stats() == full.kv.stats(), (n, op)
        memo.kv.check_invariants()
    # A plain pipelined stretch to end with: fresh sequences near the context limit, the
    # same items each step until the limit refuses them (on both sides at the same step).
    for ex in (memo, full):
        ex.release(live)
    fresh = [PrefillItem(f"z{i}", [7 + i] * (MAX_CONTEXT - 6), sample=True) for i in range(2)]
    assert outcome(memo.prefill, fresh) == outcome(full.prefill, fresh)
    items = [DecodeItem("z0", None, greedy), DecodeItem("z1", None, sampled)]
    refused = 0
    for _ in range(8):
        hits += memo._decode_memo is not None and memo._decode_memo.repeats(
            items, 1, memo.kv.version, memo.limits.servable_context)
        got = [outcome(memo.decode, items), outcome(full.decode, [DecodeItem(*it) for it in items])]
        assert got[0] == got[1], got
        refused += isinstance(got[0], tuple) and got[0][0] == "ContextLengthExceeded"
    assert hits >= 2  # the memo answered (inside the stretch at least)
    assert refused >= 2  # and the limit was reached with the memo in place
    assert memo.kv.stats() == full.kv.stats()
