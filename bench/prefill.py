"""Prefill latency per token count and graph mode, through ``Executor.prefill``.

Each point admits fresh sequences (one, or eight sharing the tokens), samples the last
token of each, and releases them: the median of ``repeats`` such calls, host work included.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from executor.api import PrefillItem
from executor.executor import Executor


def measure(ex: Executor, tokens: int, num_seqs: int, repeats: int) -> dict[str, Any]:
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
