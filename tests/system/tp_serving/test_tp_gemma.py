"""Gemma 2 and Gemma 3 text at ``--tensor-parallel-size 2`` on CPU (gloo, one process per
rank): each rank's heads and MLP rows, the Gemma norms replicated; greedy tokens of 3
prompts x 32 steps equal HF ``generate``'s and the top log-probabilities stay within 1e-4
of HF's (``tests.helpers.family_parity``)."""

from __future__ import annotations

import pytest

from tests.helpers import family_parity


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gemma_at_tp2_matches_hf(
        family_references: family_parity.References, kind: str) -> None:
    family_parity.serve_and_check(family_references, kind, tp=2)
