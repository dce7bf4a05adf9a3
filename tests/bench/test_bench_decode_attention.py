"""``bench.kernels.decode_attention``'s case plan (the timing itself needs a GPU)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the decode kernels' module imports triton")

from bench.kernels.decode_attention import Case, plan
from executor.attention.triton_kernels.decode import num_kv_splits


def test_shipped_splits_are_what_a_bucket_of_that_batch_picks() -> None:
    cases = plan(9, 3, 64, [1, 8, 64], [512], ["shipped"], 4096, 132)
    assert [c.splits for c in cases] == [num_kv_splits(b, 3, 4096, 132) for b in (1, 8, 64)]
    # a short bucket picks fewer splits: a 512-token bucket has at most 16 32-token chunks
    assert plan(9, 3, 64, [1], [512], ["shipped"], 512, 132)[0].splits == 16


def test_every_combination_once_and_bytes_count_the_cached_tokens() -> None:
    cases = plan(32, 8, 64, [1, 2], [100, 200], ["16", "shipped", "16"], 4096, 132)
    assert len(cases) == len(set(cases)) == 8  # 2 x 2 x {16, shipped}: 16 asked twice
    one = Case(batch=2, context=100, splits=16, heads=32, kv_heads=8, head_dim=64)
    assert one in cases and one.kv_bytes == 2 * 2 * 2 * 99 * 8 * 64


@pytest.mark.parametrize(("contexts", "splits"), [([1], ["4"]), ([5000], ["4"]),
                                                  ([512], ["0"]), ([512], ["65"])])
def test_cases_past_the_kernels_limits_are_refused(contexts: list[int], splits: list[str]
                                                   ) -> None:
    with pytest.raises(ValueError):
        plan(9, 3, 64, [1], contexts, splits, 4096, 132)
