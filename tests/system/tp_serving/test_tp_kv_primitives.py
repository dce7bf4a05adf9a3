"""Fork and every_position under tensor parallelism (CPU, gloo): the other ranks copy a
forked child's table row and inherited last token (``ForkHeader``), and keep one last token
per sequence when an every_position item samples at many rows. TP=2 on ``tiny`` must give
TP=1's tokens and log-probabilities."""

from __future__ import annotations

import pytest

from tests.helpers.serving import ServeProcess
from tests.system.tp_serving.kv_primitives import LOGPROB_ATOL, script


def test_forks_and_every_position_under_tp2_equal_tp1(tiny_tp1: ServeProcess,
                                                      tiny_tp2: ServeProcess) -> None:
    want = script(tiny_tp1)
    got = script(tiny_tp2)
    assert [(s, t) for s, t, _ in got] == [(s, t) for s, t, _ in want]
    assert [lp for _, _, lp in got] == pytest.approx([lp for _, _, lp in want],
                                                     abs=LOGPROB_ATOL)
