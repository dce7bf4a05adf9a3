"""Decode step latency: graph vs eager, per batch size, on a real model shape.

Two figures per point: ``step_ms`` is one ``Executor.decode`` call as the service makes it
(host work, forward, sampling, results on the host), the median of many steps; and
``forward_ms`` is the graph replay alone, timed with CUDA events (graph path only).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from executor.api import DecodeItem, PrefillItem
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


def measure(ex: Executor, bs: int, ctx: int, steps: int, use_graph: bool) -> dict[str, Any]:
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


def kernel_profile(ex: Executor, bs: int, ctx: int) -> dict[str, Any]:
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
