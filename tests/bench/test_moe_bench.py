"""The MoE benchmark's pure parts (``bench.e2e.moe``): the active-weight bytes of a step,
the FLOPs floor over the active parameters, the fused kernels' class, the summary table."""

from __future__ import annotations

import pytest

from bench.common.shapes import moe_step_weight_bytes, spec_weight_bytes
from bench.e2e.moe import table
from bench.profile.kernel_classes import floor_ms, name_class
from executor.weights.catalog import resolve_model_source
from executor.weights.loader import load_hf_config


def test_active_weight_bytes_of_qwen3_30b_a3b() -> None:
    spec = load_hf_config(resolve_model_source("qwen3-30b-a3b"))
    assert spec.moe is not None
    h, v, i = 2048, 151936, 768
    # projections, the two RMSNorms and the per-head q/k norms (2 x head_dim) of each layer
    attention = 48 * (h * (32 * 128 + 2 * 4 * 128) + 32 * 128 * h + 2 * h + 2 * 128)
    routers = 48 * 128 * h
    expert = 3 * h * i
    batch1 = moe_step_weight_bytes(spec, [8] * 48)
    assert batch1 == 2 * (attention + routers + 48 * 8 * expert + v * h + h)
    assert 6.0e9 < batch1 < 7.0e9  # the 3.3B active parameters, bf16, less the embedding
    # FP8: projections and experts at one byte a weight; norms, routers, LM head bf16
    proj = 48 * (h * (32 * 128 + 2 * 4 * 128) + 32 * 128 * h)
    fp8 = moe_step_weight_bytes(spec, [8] * 48, fp8=True)
    assert fp8 == batch1 - proj - 48 * 8 * expert
    every = moe_step_weight_bytes(spec, [128] * 48)
    assert every == spec_weight_bytes(spec)  # all experts touched: the whole model
    with pytest.raises(ValueError, match="47 expert counts for 48 sparse layers"):
        moe_step_weight_bytes(spec, [8] * 47)
    # decode floor: bytes over bandwidth (+ KV); prefill: FLOPs of the active parameters
    ms, by = floor_ms(spec, "decode", 1, 0, 4000.0, 800.0, batch1)
    assert by == "bytes" and ms == pytest.approx(batch1 / 4e12 * 1e3)
    ms, by = floor_ms(spec, "prefill", 2048, 0, 4000.0, 800.0, every)
    assert by == "flops"
    assert ms == pytest.approx(2 * spec.num_params(active=True) * 2048 / 800e12 * 1e3)


def test_fused_moe_kernels_have_their_class() -> None:
    for name in ("_align_kernel", "_gate_up_kernel", "_down_kernel",
                 "_moe_decode_one_token_kernel"):
        assert name_class(name) == "moe"


def test_summary_table() -> None:
    result = {"model": "m", "device": "d", "commit": "c", "read_bandwidth_gbs": 4000.0,
              "matmul_tflops": 800.0, "context": 512, "cases": {"decode:1": {
                  "gpu_ms": 2.0, "moe_kernels_ms": 1.0, "floor_ms": 1.6, "floor_by": "bytes",
                  "experts_touched_mean": 8.0, "ratio": 1.25}}}
    lines = table(result).splitlines()
    assert lines[-1] == "| decode:1 | 2.000 | 1.000 | 1.600 (bytes) | 1.25 | 8.0 |"
