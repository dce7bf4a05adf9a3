"""Measure the device: HBM read bandwidth and bf16 matmul rate (CUDA events, medians)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def time_ms(fn: Callable[[], object], repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` on the current stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def read_bandwidth_gbs(nbytes: int = 4 * 2**30) -> float:
    """A reduction over a large buffer reads every byte once (bytes / s, in GB/s)."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    ms = time_ms(lambda: x.sum(dtype=torch.float32))

    return nbytes / (ms / 1e3) / 1e9


def matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: a @ b, repeats=10)
    return 2 * n**3 / (ms / 1e3) / 1e12
