"""The kernel table's grouping of a step's kernels into classes
(``bench.profile.kernel_classes``)."""

from __future__ import annotations

import pytest

from bench.common import shapes
from bench.profile.kernel_classes import (
    Kernel,
    class_bytes,
    classify,
    floor_ms,
    kv_read_tokens,
    markdown_case,
    name_class,
    step_table,
)

SPLIT_K = "nvjet_sm90_tst_64x8_64x16_2x1_v_bz_splitK_TNT"
REDUCE = "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>"


def _layer(first: bool) -> list[str]:
    return [("_rms_norm_kernel"), "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", "_rope_kernel",
            "_decode_split_kernel", "_decode_reduce_kernel",
            "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", "_rms_norm_kernel",
            "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", "_silu_and_mul_kernel", SPLIT_K, REDUCE]


def _step(layers: int) -> list[Kernel]:
    names = ["Memcpy HtoD (Pinned -> Device)", "void at::native::index_elementwise_kernel"]
    for i in range(layers):
        names += _layer(i == 0)
    names += ["_rms_norm_kernel", "nvjet_sm90_tst_384x8_64x4_2x1_v_bz_TNT", "_argmax_kernel"]
    # kernel i runs [10 i, 10 i + 8): 2 us idle between each pair
    return [Kernel(n, 10.0 * i, 10.0 * i + 8.0) for i, n in enumerate(names)]


def test_gemm_roles_follow_their_position() -> None:
    step = _step(2)
    classes = classify(step, 2)
    gemms = [c for k, c in zip(step, classes, strict=True) if "nvjet" in k.name
             or "splitK" in k.name]
    assert gemms == ["qkv", "o", "gate_up", "down", "down"] * 2 + ["lm_head"]
    assert classes[:2] == ["copy", "other"]
    assert classes.count("attention") == 4 and classes.count("norm") == 5
    assert classes.count("rope") == 2 and classes.count("silu") == 2
    assert classes[-1] == "other"


def test_adjacent_fused_gemms_are_separate_projections() -> None:
    """skinny GEMMs with the norms fused in: o and gate_up launch back to back."""
    layer = ["_skinny_gemm_kernel", "_rope_kernel", "_decode_split_kernel",
             "_decode_reduce_kernel", "_skinny_gemm_kernel", "_skinny_gemm_kernel",
             "_skinny_gemm_kernel"]
    names = layer * 2 + ["_rms_norm_kernel", "nvjet_sm90_tst_384x8_64x4_2x1_v_bz_TNT"]
    classes = classify([Kernel(n, i, i + 0.5) for i, n in enumerate(names)], 2)
    gemms = [c for n, c in zip(names, classes, strict=True) if "gemm" in n or "nvjet" in n]
    assert gemms == ["qkv", "o", "gate_up", "down"] * 2 + ["lm_head"]
    assert classes[2:4] == ["attention", "attention"]


def test_collectives_of_a_tensor_parallel_step_are_their_own_class() -> None:
    """NCCL's and symmetric memory's all-reduces after o and down, an all-gather of the
    vocabulary-parallel logits: classed as collectives; the GEMM roles still line up."""
    nccl = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    gather = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    one_shot = "void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 2>"
    layer = ["_skinny_gemm_kernel", "_decode_split_kernel", "_decode_reduce_kernel",
             "_skinny_gemm_kernel", nccl, "_skinny_gemm_kernel", "_skinny_gemm_kernel",
             one_shot]
    names = [nccl, *layer, *layer, "_rms_norm_kernel",
             "nvjet_sm90_tst_384x8_64x4_2x1_v_bz_TNT", gather]
    classes = classify([Kernel(n, i, i + 0.5) for i, n in enumerate(names)], 2)
    assert [c for n, c in zip(names, classes, strict=True) if "gemm" in n or "nvjet" in n] \
        == ["qkv", "o", "gate_up", "down"] * 2 + ["lm_head"]
    assert [n for n, c in zip(names, classes, strict=True) if c == "collective"] \
        == [nccl, nccl, one_shot, nccl, one_shot, gather]


def test_a_step_that_does_not_fit_the_layer_count_keeps_gemms_unsplit() -> None:
    classes = classify(_step(2), 3)
    assert "qkv" not in classes and classes.count("gemm") == 11


def test_step_table_sums_time_and_idle() -> None:
    step = _step(2)
    table = step_table(list(reversed(step)), 2)  # order of the input does not matter
    assert table["down"] == {"us": 32.0, "n": 4.0}
    assert table["idle"]["us"] == pytest.approx(2.0 * (len(step) - 1))
    assert table["wait"] == {"us": 0.0, "n": 0.0}
    busy = sum(r["us"] for c, r in table.items() if c not in ("idle", "wait"))
    assert busy + table["idle"]["us"] == step[-1].end_us - step[0].start_us
    late = [*step[:3], *(Kernel(k.name, k.start_us + 50, k.end_us + 50) for k in step[3:])]
    table = step_table(late, 2)  # the host held the GPU back once (a 52 us gap)
    assert table["wait"] == {"us": 52.0, "n": 1.0}
    assert table["idle"]["us"] == pytest.approx(2.0 * (len(step) - 2))


def test_bytes_and_floor_of_the_1b_shape() -> None:
    spec = shapes.spec("llama-3.2-1b")
    nbytes = class_bytes(spec, "decode", 1, 512, 1)
    # weights dominate at batch 1: 16 layers of 2048 x 16384 gate_up is 1.07 GB
    assert nbytes["gate_up"] == pytest.approx(16 * 2048 * 16384 * 2, rel=1e-3)
    assert nbytes["lm_head"] == pytest.approx(128256 * 2048 * 2, rel=1e-3)
    # K and V of 512 tokens, 8 heads of 64, 16 layers
    assert nbytes["attention"] > 16 * 512 * 2 * 512 * 2
    weights = shapes.weight_bytes("llama-3.2-1b")
    floor, bound = floor_ms(spec, "decode", 1, 512, 3000.0, 750.0, weights)
    assert bound == "bytes" and floor == pytest.approx(0.83, rel=0.02)
    floor, bound = floor_ms(spec, "prefill", 2048, 0, 3000.0, 750.0, weights)
    assert bound == "flops" and floor > 6.0


def test_sliding_layers_read_only_their_window() -> None:
    """Gemma 3 12B's shape: 40 sliding layers (window 1024) and 8 global ones; a decode at
    4096 tokens reads 1024 cached tokens in a sliding layer, all 4096 in a global one."""
    spec = shapes.spec("gemma-3-12b")
    assert spec.num_layers == 48 and spec.layer_windows.count(1024) == 40
    assert kv_read_tokens(spec, 4096) == 40 * 1024 + 8 * 4096
    assert kv_read_tokens(spec, 100) == 48 * 100  # shorter than the window: all of it
    weights = shapes.weight_bytes("gemma-3-12b")
    assert weights == pytest.approx(23.5e9, rel=0.01)  # bf16, the tied head read once
    kv_per_token = 2 * spec.kv_size * 2
    floor, bound = floor_ms(spec, "decode", 1, 4096, 4000.0, 750.0, weights)
    want = (weights + (40 * 1024 + 8 * 4096) * kv_per_token) / 4000e9 * 1e3
    assert bound == "bytes" and floor == pytest.approx(want)
    nbytes = class_bytes(spec, "decode", 1, 4096, 1)
    assert nbytes["attention"] == (2 * (40 * 1024 + 8 * 4096) * spec.kv_size
                                   + 48 * (2 * spec.q_size + 2 * spec.kv_size)) * 2
    # (a kernel name with "gemm" in it would count as a projection)
    assert name_class("_offset_rms_norm_kernel") == "norm"
    assert name_class("_gelu_tanh_and_mul_kernel") == "silu"
    assert name_class("_fp8_dot_kernel") == name_class("_w8a16_kernel") == "gemm"  # FP8
    assert name_class("_silu_and_mul_quant_kernel") == "silu"


def test_markdown_lists_classes_with_bandwidth() -> None:
    spec = shapes.spec("llama-3.2-1b")
    table = step_table(_step(16), 16)
    nbytes = class_bytes(spec, "decode", 1, 512, 1)
    for cls, row in table.items():
        if cls in nbytes:
            row["bytes"] = nbytes[cls]
    case = {"span_ms": 1.5, "busy_ms": 1.2, "idle_ms": 0.3, "floor_ms": 0.84,
            "floor_by": "bytes", "kernels_per_step": 180.0, "classes": table}
    text = markdown_case("decode:1", case, case)
    assert "| gate_up | 16 | 128.0 | 128.0 |" in text
    idle_ms = table["idle"]["us"] / 1e3
    assert f"{(1.2 + idle_ms) / 0.84:.2f}x" in text and "| idle |" in text


def test_overlapping_kernels_count_their_exclusive_time() -> None:
    """Under PDL a kernel starts early and waits inside: the span is counted once, each
    kernel from where the ones before it ended, and no gap is negative."""
    step = _step(2)
    # every kernel after the first starts 5 us early: 3 us before its predecessor ends
    pdl = [step[0]] + [Kernel(k.name, k.start_us - 5.0, k.end_us) for k in step[1:]]
    table = step_table(pdl, 2)
    span = pdl[-1].end_us - pdl[0].start_us
    assert sum(r["us"] for r in table.values()) == pytest.approx(span)
    assert table["idle"] == {"us": 0.0, "n": float(len(step) - 1)}
    # each runs from its predecessor's end (10 i - 2) to its own (10 i + 8)
    assert table["down"] == {"us": pytest.approx(4 * 10.0), "n": 4.0}
    # a kernel wholly inside an earlier one adds nothing
    inner = step_table([Kernel("_rms_norm_kernel", 0.0, 10.0), Kernel("_rope_kernel", 2.0, 6.0)],
                       0)
    assert sum(r["us"] for r in inner.values()) == pytest.approx(10.0)


def test_kernel_table_lists_the_small_kernels_by_name() -> None:
    """The JSON names what an ``other`` row holds: every kernel that is neither a
    projection nor attention, in launch order, with its time."""
    from bench.profile.kernel_table import small_kernels

    named = small_kernels(_step(2), 2)
    assert named[0] == {"class": "copy", "name": "Memcpy HtoD (Pinned -> Device)", "us": 8.0}
    assert [n["name"] for n in named if n["class"] == "other"] == [
        "void at::native::index_elementwise_kernel", "_argmax_kernel"]
    assert [n["class"] for n in named].count("norm") == 5 and len(named) == 12
