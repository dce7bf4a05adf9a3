"""``ranks_differ``: ranks whose captured buckets differ all start over, together.
``agreed_tiers``: ranks try and keep the same context-tier twins."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from executor.graphs.graph_runner import agreed_tiers, ranks_differ


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


def _run_ranks(n: int, fn: Callable[[int, Callable[[bool], bool]], object]) -> list[object]:
    agrees = _world(n)
    answers: list[object] = [None] * n

    def run(rank: int) -> None:
        answers[rank] = fn(rank, agrees[rank])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "a rank is stuck in a collective"
    return answers


@pytest.mark.parametrize(("captured", "differ"), [
    ([[True, True], [True, True], [True, True]], False),
    ([[False, False], [False, False], [False, False]], False),
    ([[True, True], [True, False], [True, True]], True),
    ([[False, True], [True, True], [True, True]], True),
])
def test_every_rank_reaches_the_same_answer(captured: list[list[bool]], differ: bool) -> None:
    answers = _run_ranks(len(captured), lambda rank, agree: ranks_differ(captured[rank], agree))
    assert answers == [differ] * len(captured)


@pytest.mark.parametrize(("helps", "succeeds", "kept"), [
    # every rank: which candidates (256, 512, 1024) help; which captures succeed
    ([{512, 1024}] * 2, [{512, 1024}] * 2, (512, 1024)),
    ([{512}, {512, 1024}], [{512, 1024}] * 2, (512,)),  # 1024 helps on one rank only
    ([{512, 1024}] * 2, [{512, 1024}, {1024}], (1024,)),  # 512 failed on rank 1
    ([set(), set()], [{256, 512, 1024}] * 2, ()),
])
def test_every_rank_keeps_the_same_tiers(helps: list[set[int]], succeeds: list[set[int]],
                                         kept: tuple[int, ...]) -> None:
    """A rank tries a tier only where every rank does (a twin's warm-up runs the
    forward's collectives), and keeps it only where every rank captured it."""
    tried: list[list[int]] = [[] for _ in helps]

    def rank_fn(rank: int, agree: Callable[[bool], bool]) -> tuple[int, ...]:
        def capture(tier: int) -> bool:
            tried[rank].append(tier)
            return tier in succeeds[rank]
        return agreed_tiers((256, 512, 1024), helps[rank].__contains__, capture, agree)

    assert _run_ranks(len(helps), rank_fn) == [kept] * len(helps)
    wanted_everywhere = [t for t in (256, 512, 1024) if all(t in h for h in helps)]
    assert tried == [wanted_everywhere] * len(helps)


def test_one_process_keeps_what_it_captured() -> None:
    tiers = agreed_tiers((512, 1024), lambda t: True, lambda t: t == 1024, None)
    assert tiers == (1024,)
