"""Mistral and Qwen2 with a sliding window (8) shorter than the prompts, at
``--tensor-parallel-size 2`` on CPU (gloo): greedy tokens of 3 prompts x 32 steps equal HF
``generate``'s, top log-probabilities within 1e-4 (``tests.helpers.family_parity``)."""

from __future__ import annotations

import pytest

from tests.helpers import family_parity


@pytest.mark.parametrize("kind", ["mistral_window", "qwen2_window"])
def test_windowed_at_tp2_matches_hf(
        family_references: family_parity.References, kind: str) -> None:
    family_parity.serve_and_check(family_references, kind, tp=2)
