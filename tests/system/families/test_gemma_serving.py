"""Gemma 2 and Gemma 3 text through the real gRPC server on CPU (float32): sliding and
global layers with a window (8) shorter than the prompts, soft-caps (Gemma 2), q/k norms
and a local RoPE base (Gemma 3). Greedy tokens of 3 prompts x 32 steps (chunked prefill,
then decode on the device's last token) equal HF ``generate``'s, every step's top
log-probabilities within 1e-4 of HF's, and Health names the window and the features
(``tests.helpers.family_parity``)."""

from __future__ import annotations

import pytest

from tests.helpers import family_parity


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gemma_greedy_parity_through_grpc(
        family_references: family_parity.References, kind: str) -> None:
    family_parity.serve_and_check(family_references, kind)
