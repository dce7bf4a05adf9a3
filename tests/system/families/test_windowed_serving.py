"""Mistral and Qwen2 configs with a sliding window (8) shorter than the prompts, and
Phi-3 (fused qkv / gate_up tensors, a window, partial rotary), through the real gRPC
server on CPU (float32): greedy tokens of 3 prompts x 32 steps (chunked prefill, then
decode) equal HF ``generate``'s, every step's top log-probabilities within 1e-4 of HF's
(``tests.helpers.family_parity``)."""

from __future__ import annotations

import pytest

from tests.helpers import family_parity


@pytest.mark.parametrize("kind", ["mistral_window", "qwen2_window", "phi3"])
def test_windowed_greedy_parity_through_grpc(
        family_references: family_parity.References, kind: str) -> None:
    family_parity.serve_and_check(family_references, kind)
