"""Step latency through ``Executor``: decode (graph vs eager) and prefill per size, and the
two call medians that A/B runs of two trees compare.

``measure_decode`` and ``measure_prefill`` are the step tables of ``bench.e2e.run``: for
decode, ``step_ms`` is one ``Executor.decode`` call as the service makes it (host work,
forward, sampling, results on the host), the median of many steps, and ``forward_ms`` the
graph replay alone (CUDA events); for prefill, the median of calls that each admit fresh
sequences (one, or several sharing the tokens), sample and release them.

``python -m bench.e2e.step_latency /tmp/model-executor-bench/llama-3.2-1b`` prints one line:
the call medians of a 128-token breakable prefill and a batch-1 full-graph decode (host
work included) and the median replay spans. Run it from each tree's root, alternating the
trees several times: a host's speed drifts within minutes, so only interleaved rounds
compare. Only the two buckets used are captured, so a run takes seconds after the load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from bench.common import switches as bench_switches
from executor.api import DecodeItem, PrefillItem
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from executor.executor import Executor


def _admit(ex: Executor, bs: int, ctx: int, tag: str) -> dict[str, int]:
    gen = torch.Generator().manual_seed(bs * 7919 + ctx)
    vocab = ex.model_info.vocab_size
    tokens: dict[str, int] = {}
    chunk = max(1, ex.config.max_prefill_tokens // ctx)
    ids = [f"{tag}{i}" for i in range(bs)]
    for start in range(0, bs, chunk):
        items = [PrefillItem(sid, torch.randint(0, vocab, (ctx,), generator=gen).tolist())
                 for sid in ids[start : start + chunk]]
        for o in ex.prefill(items).outputs:
            tokens[o.seq_id] = int(o.token_id)  # type: ignore[arg-type]
    return tokens


def measure_decode(ex: Executor, bs: int, ctx: int, steps: int, use_graph: bool
                   ) -> dict[str, Any]:
    """Decode ``steps`` steps (after 5 untimed) of ``bs`` fresh sequences of ``ctx``
    prompt tokens, through the decode graph or (``use_graph`` False) eagerly."""
    runners = dict(ex.runners)
    if not use_graph:
        ex.runners.pop("decode", None)
    try:
        toks = _admit(ex, bs, ctx, f"bench{bs}-{ctx}-{use_graph}-")
        times, paths = [], set()
        for i in range(steps + 5):
            t0 = time.perf_counter()
            res = ex.decode([DecodeItem(s, t) for s, t in toks.items()])
            dt = (time.perf_counter() - t0) * 1e3
            if i >= 5:  # warm-up steps excluded
                times.append(dt)
            paths.add(res.step.path)
            toks = {o.seq_id: int(o.token_id) for o in res.outputs}  # type: ignore[arg-type]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        replays = ex.drain_replay_seconds().get("decode", [])[5:] if use_graph else []
        ex.release(list(toks))
    finally:
        ex.runners.clear()
        ex.runners.update(runners)
    return {
        "batch": bs, "context": ctx, "mode": "graph" if use_graph else "eager",
        "paths": sorted(paths), "steps": steps,
        "step_ms_median": statistics.median(times),
        "step_ms_p10": sorted(times)[len(times) // 10],
        "forward_ms_median": statistics.median(replays) * 1e3 if replays else None,
    }


def decode_kernels(ex: Executor, bs: int, ctx: int) -> dict[str, Any]:
    """Kernels per eager decode step and the largest ones (where the time goes)."""
    from torch.profiler import ProfilerActivity, profile

    runners = dict(ex.runners)
    ex.runners.pop("decode", None)
    try:
        toks = _admit(ex, bs, ctx, "prof-")
        ex.decode([DecodeItem(s, t) for s, t in toks.items()])
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            ex.decode([DecodeItem(s, t) for s, t in toks.items()])
        ex.release(list(toks))
    finally:
        ex.runners.update(runners)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total_kernels = sum(e.count for e in events)
    top = sorted(events, key=lambda e: e.device_time_total, reverse=True)[:8]
    return {
        "kernels_per_step": total_kernels,
        "top": [{"name": e.key[:80], "count": e.count, "us_total": e.device_time_total}
                for e in top],
    }


def measure_prefill(ex: Executor, tokens: int, num_seqs: int, repeats: int) -> dict[str, Any]:
    """Median of ``repeats`` prefill calls (after 2 untimed) of ``tokens`` tokens over
    ``num_seqs`` fresh sequences, each sampling its last token, released after."""
    vocab = ex.model_info.vocab_size
    gen = torch.Generator().manual_seed(tokens * 31 + num_seqs)
    per_seq = [tokens // num_seqs + (1 if i < tokens % num_seqs else 0) for i in range(num_seqs)]
    times, paths, reasons = [], set(), set()
    for r in range(repeats + 2):
        items = [PrefillItem(f"p{r}-{i}", torch.randint(0, vocab, (n,), generator=gen).tolist())
                 for i, n in enumerate(per_seq)]
        t0 = time.perf_counter()
        res = ex.prefill(items)
        dt = (time.perf_counter() - t0) * 1e3
        ex.release([it.seq_id for it in items])
        if r >= 2:  # warm-up excluded
            times.append(dt)
        paths.add(res.step.path)
        reasons.add(res.step.fallback_reason)
    return {"tokens": tokens, "sequences": num_seqs, "ms_median": statistics.median(times),
            "paths": sorted(paths), "fallback_reasons": sorted(r for r in reasons if r)}


def ab_medians(source: str, rounds: int, calls: int, tokens: int = 128,
              switches: dict[str, str] | None = None) -> str:
    """The A/B line: ``rounds`` blocks of ``calls`` prefill calls then ``calls`` decode
    calls (the first third of each kind left out), and the median replay spans."""
    ex = Executor(ExecutorConfig(
        model=ModelConfig(source=source, dtype="bfloat16"), device="cuda",
        cache=CacheConfig(kv_tokens=64 * 1024, max_sequences=64, max_context=4096),
        graphs=GraphConfig(decode_mode="full", prefill_mode="breakable", decode_buckets=(1, 2),
                           prefill_buckets=(tokens // 2, tokens)),
        attention_backend="triton", max_decode_batch=64, max_prefill_tokens=4096,
        **(switches or {})))
    ex.capture(["decode", "prefill"])
    ids = torch.randint(0, ex.model_info.vocab_size, (tokens,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    first = ex.prefill([PrefillItem("d", list(range(1, 200)))]).outputs[0].token_id
    assert first is not None
    tok, n = first, 0
    prefill_s: list[float] = []
    decode_s: list[float] = []
    for _ in range(rounds):  # the two kinds of call alternate in blocks
        for _ in range(calls):
            n += 1
            t0 = time.perf_counter()
            ex.prefill([PrefillItem(f"p{n}", ids)])
            prefill_s.append(time.perf_counter() - t0)
            ex.release([f"p{n}"])
        for _ in range(calls):
            t0 = time.perf_counter()
            out = ex.decode([DecodeItem("d", tok)]).outputs[0]
            decode_s.append(time.perf_counter() - t0)
            assert out.token_id is not None
            tok = out.token_id
    spans = ex.drain_replay_seconds()
    warm = calls // 3  # the first calls of a process are slower
    return (f"prefill{tokens} {statistics.median(prefill_s[warm:]) * 1e3:.3f} ms  "
            f"decode1 {statistics.median(decode_s[warm:]) * 1e3:.3f} ms  "
            f"spans prefill {statistics.median(spans['prefill']) * 1e3:.3f} "
            f"decode {statistics.median(spans['decode']) * 1e3:.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Call medians of a 128-token breakable prefill "
                                 "and a batch-1 full-graph decode, for A/B runs of two trees.")
    ap.add_argument("model", help="HF model directory (e.g. a bench shape)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=60, help="calls per kind per round")
    bench_switches.add_arguments(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.e2e.step_latency needs a CUDA device", file=sys.stderr)
        return 2
    print(ab_medians(args.model, args.rounds, args.calls,
                     switches=bench_switches.overrides(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
