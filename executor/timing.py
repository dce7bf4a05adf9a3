"""The one CUDA-graph timer: capture a callable once, time its replays with CUDA events.

The all-reduce planner probes its algorithms with it at start-up, and every benchmark that
times kernels uses it, so a figure in ``docs/performance.md`` and a start-up choice are
measured the same way.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def capture(fn: Callable[[], object], warmup: int = 2) -> torch.cuda.CUDAGraph:
    """``fn`` captured as one CUDA graph, after ``warmup`` eager calls on a side stream
    (lazy initialisation, autotuning and allocator growth happen outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, calls: int = 1, replays: int = 100,
              before: Callable[[], object] | None = None, warmup: int = 2) -> float:
    """Median µs per call of ``graph`` (holding ``calls`` calls back to back) over
    ``replays`` replays timed by CUDA events, after ``warmup`` untimed replays; ``before``
    runs ahead of each replay (a barrier that lines tensor-parallel ranks up)."""
    for _ in range(warmup):
        graph.replay()
    samples = []
    for _ in range(replays):
        if before is not None:
            before()
        start, end = (torch.cuda.Event(enable_timing=True),
                      torch.cuda.Event(enable_timing=True))
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def time_us(fn: Callable[[], object], calls: int = 1, replays: int = 100) -> float:
    """Median µs per call of ``fn`` (which makes ``calls`` calls), captured and replayed."""
    graph = capture(fn)
    try:
        return replay_us(graph, calls, replays, warmup=10)
    finally:
        del graph
