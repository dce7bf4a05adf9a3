"""``bench.kernels.moe_decode``'s expert bytes (its floor) on CPU (the timing needs a GPU)."""

from __future__ import annotations

import pytest

from bench.kernels import moe_decode


def test_expert_bytes_count_fp8_weights_at_one_byte_plus_scales() -> None:
    _, _, hidden, inter = moe_decode.SHAPES["qwen3-30b-a3b"]
    weights = 3 * hidden * inter
    assert moe_decode.expert_bytes("bf16", hidden, inter) == 2 * weights
    # per channel: one float32 a row of gate_up (2I) and of down (H)
    assert moe_decode.expert_bytes("fp8-channel", hidden, inter) == (
        weights + 4 * (2 * inter + hidden))
    # 128x128 blocks: gate_up (2I/128 x H/128) and down (H/128 x I/128)
    assert moe_decode.expert_bytes("fp8-block", hidden, inter) == (
        weights + 4 * (12 * 16 + 16 * 6))


def test_weights_flag() -> None:
    with pytest.raises(SystemExit):
        moe_decode.main(["--weights", "int4"])
