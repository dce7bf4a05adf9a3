"""The benchmarks' CUDA-graph timing: ``executor.timing`` (the one timer, re-exported) and
the two ways bench uses it, over weight copies that exceed L2 and for one callable."""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor.timing import capture, replay_us, time_us

__all__ = ["L2_BYTES", "capture", "graph_ms", "replay_us", "time_us", "weight_copies",
           "weights_replay_us"]

#: Above the L2 cache of every current data-center GPU, so weight copies whose sum exceeds
#: it are read from HBM on every call, as in a forward.
L2_BYTES = 64 * 2**20


def weight_copies(k: int, n: int, elem_bytes: int = 2) -> int:
    """How many (n, k) weight copies together exceed ``L2_BYTES`` (at least 2)."""
    return max(2, -(-L2_BYTES // (k * n * elem_bytes)) + 1)


def weights_replay_us(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor],
                      replays: int = 100) -> float:
    """Median µs per call of ``fn(w)``, one call per weight back to back in one CUDA graph
    (each weight read from HBM when the copies exceed L2, ``weight_copies``)."""
    graph = capture(lambda: [fn(w) for w in weights])
    try:
        return replay_us(graph, len(weights), replays, warmup=10)
    finally:
        del graph


def graph_ms(fn: Callable[[], object], replays: int = 300) -> float:
    """Median ms of one replay of ``fn`` captured as a CUDA graph."""
    graph = capture(fn, warmup=3)
    try:
        return replay_us(graph, 1, replays, warmup=20) / 1e3
    finally:
        del graph
