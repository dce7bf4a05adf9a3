"""Gemma 2 and Gemma 3 text at ``--tensor-parallel-size 2`` on CPU (gloo, one process per
rank): each rank's heads and MLP rows, the Gemma norms replicated; greedy tokens of 3
prompts x 32 steps equal HF ``generate``'s and the top log-probabilities stay within 1e-4
of HF's (``tests.helpers.family_parity``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import family_parity


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gemma_at_tp2_matches_hf(tmp_path: Path, kind: str) -> None:
    family_parity.serve_and_check(tmp_path, kind, tp=2)
