"""``RowSlices``: a batch's rows cut into contiguous slices, run on persistent threads.

Grammar masks are per row and xgrammar's C++ releases the GIL for a whole batch call, so a
batch's masks fill faster as one call per slice on a few threads. (xgrammar's own batch
threading starts a new thread pool on every call, of half the host's cores: costlier than
the masks of a step.) The calling thread runs the first slice itself; with one thread, or
few rows, everything runs on the calling thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

#: Fewest rows per slice: below this a thread's hand-off costs more than it saves.
MIN_ROWS = 16


def default_threads() -> int:
    """A quarter of the CPUs this process may use, at most 4 (each slice is one call that
    takes the GIL twice; the launching thread, the mask worker and the server's threads
    need the rest)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus // 4))


class RowSlices:
    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None  # made at the first parallel call

    def slices(self, rows: int) -> list[tuple[int, int]]:
        """``rows`` cut into at most ``threads`` contiguous (start, stop) slices of at
        least ``MIN_ROWS`` rows (one slice for few rows), sizes differing by at most one."""
        n = max(1, min(self.threads, rows // MIN_ROWS))
        base, extra = divmod(rows, n)
        bounds, start = [], 0
        for i in range(n):
            stop = start + base + (1 if i < extra else 0)
            bounds.append((start, stop))
            start = stop
        return bounds

    def run(self, rows: int, fn: Callable[[int, int, int], None]) -> None:
        """``fn(slice_index, start, stop)`` for each slice of ``rows``, in parallel; returns
        when all are done, raising the first slice's error if any failed."""
        bounds = self.slices(rows)
        if len(bounds) == 1:
            fn(0, *bounds[0])
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="grammar-rows")
        futures = [self._pool.submit(fn, i, lo, hi) for i, (lo, hi) in enumerate(bounds)
                   if i > 0]
        error: BaseException | None = None
        try:
            fn(0, *bounds[0])
        except BaseException as exc:
            error = exc
        for f in futures:  # (every slice finishes before the rows are read or reused)
            failed = f.exception()  # (waits for the slice)
            error = error or failed
        if error is not None:
            raise error

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
