"""``RowSlices``: contiguous slices covering every row once, at least ``MIN_ROWS`` each,
run on several threads at once (the first on the caller's), errors raised after every
slice finished."""

from __future__ import annotations

import itertools
import threading

import pytest

from executor.row_slices import MIN_ROWS, RowSlices


@pytest.mark.parametrize("rows", [0, 1, MIN_ROWS - 1, MIN_ROWS * 2, 37, 64, 257])
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_slices_cover_each_row_once(rows: int, threads: int) -> None:
    bounds = RowSlices(threads).slices(rows)
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert len(bounds) <= threads
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1
    if len(bounds) > 1:
        assert min(sizes) >= MIN_ROWS


def test_slices_run_concurrently_and_write_their_rows() -> None:
    pool = RowSlices(4)
    out = [-1] * 64
    barrier = threading.Barrier(4, timeout=10)  # only passes if all four run at once
    names: set[str] = set()

    def fn(i: int, lo: int, hi: int) -> None:
        names.add(threading.current_thread().name)
        barrier.wait()
        out[lo:hi] = [i] * (hi - lo)
    pool.run(64, fn)
    assert out == [i for i in range(4) for _ in range(16)]
    assert threading.current_thread().name in names and len(names) == 4
    pool.close()


def test_an_error_is_raised_after_every_slice_finished() -> None:
    pool = RowSlices(3)
    finished: list[int] = []

    def fn(i: int, lo: int, hi: int) -> None:
        if i == 1:
            raise ValueError("slice 1")
        threading.Event().wait(0.05)
        finished.append(i)
    with pytest.raises(ValueError, match="slice 1"):
        pool.run(3 * MIN_ROWS, fn)
    assert sorted(finished) == [0, 2]
    pool.close()
