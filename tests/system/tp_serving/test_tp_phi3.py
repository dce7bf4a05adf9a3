"""Phi-3 at ``--tensor-parallel-size 2`` on CPU (gloo): its checkpoint's fused qkv_proj
and gate_up_proj are cut per part (each rank reads its rows of q, k and v, of gate and
up), with a sliding window and partial rotary; greedy tokens of 3 prompts x 32 steps equal
HF ``generate``'s, top log-probabilities within 1e-4 (``tests.helpers.family_parity``)."""

from __future__ import annotations

from tests.helpers import family_parity


def test_phi3_at_tp2_matches_hf(family_references: family_parity.References) -> None:
    family_parity.serve_and_check(family_references, "phi3", tp=2)
