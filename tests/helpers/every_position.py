"""Every-position prefill results against reference log-probabilities: the executor both
the CPU test and the real-model test build, and the comparison they share."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor.api import ItemOutput, SamplingParams
from executor.config import CacheConfig, ExecutorConfig, ModelConfig
from executor.executor import Executor

ATOL = 2e-4
TOP = 5
SCORED = SamplingParams(logprobs=True, top_logprobs=TOP)


def make_executor(path: Path | str) -> Executor:
    cfg = ExecutorConfig(model=ModelConfig(source=str(path), dtype="float32"), device="cpu",
                         cache=CacheConfig(kv_tokens=2048, max_sequences=8, max_context=256))
    return Executor(cfg)


def assert_positions_match(out: ItemOutput, ref: torch.Tensor, new: list[int],
                           atol: float = ATOL) -> None:
    """``out.positions`` against ``ref`` (the reference log-probabilities at the same
    positions, one row per token of ``new``): greedy token, its logprob, the top
    logprobs and each next given token's logprob."""
    assert len(out.positions) == len(new) == ref.shape[0]
    for i, pos in enumerate(out.positions):
        top = torch.topk(ref[i], TOP)
        # The greedy token is the reference's argmax unless two logits tie within ATOL.
        assert pos.token_id == int(top.indices[0]) or \
            float(ref[i, pos.token_id]) == pytest.approx(float(top.values[0]), abs=atol)
        assert pos.logprob == pytest.approx(float(ref[i, pos.token_id]), abs=atol)
        assert [v for _, v in pos.top_logprobs] == pytest.approx(top.values.tolist(), abs=atol)
        if i + 1 < len(new):
            assert pos.next_token_logprob == pytest.approx(float(ref[i, new[i + 1]]), abs=atol)
        else:
            assert pos.next_token_logprob is None
    last = out.positions[-1]
    assert (out.token_id, out.logprob, out.top_logprobs) == \
        (last.token_id, last.logprob, last.top_logprobs)
