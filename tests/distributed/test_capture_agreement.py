"""``ranks_differ``: ranks whose captured buckets differ all start over, together."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from executor.graphs.graph_runner import ranks_differ


def _world(n: int) -> list[Callable[[bool], bool]]:
    """``n`` threads' all-ranks AND, as a barrier-backed collective."""
    values: list[bool] = [True] * n
    result: list[bool] = [True]
    first, second = threading.Barrier(n), threading.Barrier(n)

    def agree_for(rank: int) -> Callable[[bool], bool]:
        def agree(ok: bool) -> bool:
            values[rank] = ok
            if first.wait() == 0:
                result[0] = all(values)
            second.wait()
            out = result[0]
            first.wait()  # nobody writes the next round before everyone read this one
            return out
        return agree

    return [agree_for(r) for r in range(n)]


@pytest.mark.parametrize(("captured", "differ"), [
    ([[True, True], [True, True], [True, True]], False),
    ([[False, False], [False, False], [False, False]], False),
    ([[True, True], [True, False], [True, True]], True),
    ([[False, True], [True, True], [True, True]], True),
])
def test_every_rank_reaches_the_same_answer(captured: list[list[bool]], differ: bool) -> None:
    agrees = _world(len(captured))
    answers: list[bool | None] = [None] * len(captured)

    def run(rank: int) -> None:
        answers[rank] = ranks_differ(captured[rank], agrees[rank])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(captured))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert answers == [differ] * len(captured)
