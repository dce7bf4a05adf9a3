"""A world of one rank in this process: the distributed code path (process groups,
collectives, the step channel's sampled-token broadcast) without other processes."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from executor.api import DecodeItem, PrefillItem
from executor.distributed import bootstrap
from executor.distributed.group import TensorParallel


@contextmanager
def world_of_one(device: torch.device) -> Iterator[TensorParallel]:
    """Rank 0 of 1 over a TCP store on a free loopback port (NCCL on CUDA, gloo on CPU)."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True,
                          timeout=datetime.timedelta(seconds=60))
    tp = bootstrap.init(0, 1, device, store, datetime.timedelta(seconds=60))
    try:
        yield tp
    finally:
        bootstrap.shutdown(tp)


def transcript(ex: object, prompts: list[list[int]], steps: int = 6) -> list[list[int]]:
    """Greedy tokens of a batch: a chunked prefill, decode steps with explicit tokens,
    then k steps in one call continuing from the tokens on the device."""
    run = ex  # an Executor
    ids = [f"s{i}" for i in range(len(prompts))]
    run.prefill([PrefillItem(sid, p[: len(p) // 2], sample=False)  # type: ignore[attr-defined]
                 for sid, p in zip(ids, prompts, strict=True)])
    out = run.prefill([PrefillItem(sid, p[len(p) // 2 :])  # type: ignore[attr-defined]
                       for sid, p in zip(ids, prompts, strict=True)])
    tokens = [[int(o.token_id)] for o in out.outputs]
    for _ in range(steps):
        out = run.decode([DecodeItem(sid, t[-1])  # type: ignore[attr-defined]
                          for sid, t in zip(ids, tokens, strict=True)])
        for t, o in zip(tokens, out.outputs, strict=True):
            t.append(int(o.token_id))
    out = run.decode([DecodeItem(sid, None) for sid in ids], num_steps=4)  # type: ignore[attr-defined]
    for t, o in zip(tokens, out.outputs, strict=True):
        t.extend(int(s.token_id) for s in o.steps)
    run.release(ids)  # type: ignore[attr-defined]
    return tokens
