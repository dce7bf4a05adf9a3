"""Measure the device: memory read bandwidth and matmul rate (medians).

On CUDA: HBM read bandwidth and the bf16 matmul rate, timed with CUDA events. On a CPU-only
machine (the smoke profile) the same measurements, smaller, in float32, timed on the host:
enough to compute a floor, not a hardware characterization.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch


def release_memory() -> None:
    """Give back the device memory of executors the caller has dropped: their reference
    cycles are collected first, so the next capture's memory figure does not see them
    freed in the middle of it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_ms(fn: Callable[[], object], repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn``: CUDA events on the current stream, or host time on a
    machine without CUDA."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        host = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(host)
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
    if not torch.cuda.is_available():
        nbytes = min(nbytes, 256 * 2**20)
        x = torch.rand(nbytes // 4, dtype=torch.float32)
        return nbytes / (time_ms(x.sum, repeats=5) / 1e3) / 1e9
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    ms = time_ms(lambda: x.sum(dtype=torch.float32))

    return nbytes / (ms / 1e3) / 1e9


def matmul_tflops(n: int = 8192) -> float:
    if not torch.cuda.is_available():
        n = min(n, 1024)
        a, b = torch.randn(n, n), torch.randn(n, n)
        return 2 * n**3 / (time_ms(lambda: a @ b, repeats=5) / 1e3) / 1e12
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: a @ b, repeats=10)
    return 2 * n**3 / (ms / 1e3) / 1e12
