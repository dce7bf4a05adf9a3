"""``fuse_decode_rope`` on a GPU (marker ``gpu``): the Triton decode kernel rotating q and
k itself gives the plain path's logits (bf16 tolerance) and greedy tokens, eagerly and
replayed from full and breakable decode graphs, with one RoPE launch fewer per layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor.api import DecodeItem, PrefillItem, SamplingParams
from executor.executor import Executor
from tests.helpers.gpu import (
    LOGIT_ATOL,
    LOGIT_RTOL,
    MARGIN,
    gpu_model,
    make_prefill_executor,
    rand_tokens,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA")]

SCORED = SamplingParams(logprobs=True, top_logprobs=4)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gpu_model(tmp_path_factory.mktemp("fused-rope"))


def _pair(path: Path, decode: str) -> tuple[Executor, Executor]:
    plain = make_prefill_executor(path, prefill="breakable", decode=decode,
                                  fuse_decode_rope="off")
    fused = make_prefill_executor(path, prefill="breakable", decode=decode,
                                  fuse_decode_rope="on")
    assert fused.fuses_decode_rope and not plain.fuses_decode_rope
    for ex in (plain, fused):
        if decode != "disabled":
            ex.capture(["decode"])
    return plain, fused


def _step(ex: Executor, ids: list[str], tokens: list[int]
          ) -> tuple[torch.Tensor, list[int], list[float]]:
    """One decode step: top log-probabilities, tokens and top-2 margins per sequence."""
    step = ex.decode([DecodeItem(s, t, SCORED) for s, t in zip(ids, tokens, strict=True)])
    tops = torch.tensor([[lp for _, lp in o.top_logprobs] for o in step.outputs])
    return (tops, [int(o.token_id) for o in step.outputs],  # type: ignore[arg-type]
            (tops[:, 0] - tops[:, 1]).tolist())


@pytest.mark.parametrize("decode", ["full", "breakable", "disabled"])
def test_fused_rope_matches_the_plain_path(model_path: Path, decode: str) -> None:
    plain, fused = _pair(model_path, decode)
    ids = [f"s{i}" for i in range(5)]
    prompts = [rand_tokens(7 + 40 * i, seed=i) for i in range(5)]
    firsts = []
    for ex in (plain, fused):
        out = ex.prefill([PrefillItem(s, p) for s, p in zip(ids, prompts, strict=True)])
        firsts.append([int(o.token_id) for o in out.outputs])  # type: ignore[arg-type]
    assert firsts[0] == firsts[1]  # prefill is not fused: identical
    tokens = firsts[0]
    for _ in range(8):  # both continue from the plain path's tokens
        want, want_tokens, margins = _step(plain, ids, tokens)
        got, got_tokens, _ = _step(fused, ids, tokens)
        torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=LOGIT_RTOL)
        assert all(g == w for g, w, m in zip(got_tokens, want_tokens, margins, strict=True)
                   if m > MARGIN)
        tokens = want_tokens
    # both pools hold the same (rotated) keys at the same locations
    torch.testing.assert_close(fused.pool.k_buffer.float(), plain.pool.k_buffer.float(),
                               atol=2e-2, rtol=2e-2)
