"""FP8 (e4m3) expert weights in the fused-MoE kernels on the GPU (marker ``gpu``).

The Qwen3-30B-A3B expert shape (128 experts, top 8, hidden 2048, width 768) in bf16, its
weights quantized per output channel and per 128x128 block, at 1 and 4 tokens (the
decode path) and 64 and 512 (the grouped path): against the experts on the dequantized
float32 weights (float32 activations: within 3e-2, the bf16 roundings' few ulps) and
against those float32 GEMMs rounded where the kernels round (4 bf16 ulps); unit scales
on e4m3-exact weights give the bf16 decode path's bits (the grouped path's within 4 ulps);
no host sync, and a CUDA graph replayed on new inputs gives the eager run's bits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.moe_fp8 import (
    LAYOUTS,
    dequantize_experts,
    fp8_kwargs,
    quantize_experts,
    rounded_reference,
)

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

# (experts, top_k, hidden, expert width)
QWEN3_30B = (128, 8, 2048, 768)
#: bf16 output against the float32 reference on the dequantized weights
F32_ATOL = F32_RTOL = 3e-2
#: against the float32 GEMMs rounded where the kernels round, in bf16 ulps
ROUNDED_ULPS = 4

_CACHE: dict[str, tuple[torch.Tensor, ...]] = {}


def _experts(layout: str) -> tuple[torch.Tensor, ...]:
    """``(q13, q2, s13, s2, d13, d2, router)``, drawn once per layout."""
    if layout not in _CACHE:
        e, _, h, i = QWEN3_30B
        g = torch.Generator(device="cuda").manual_seed(7)
        w13 = torch.randn(e, 2 * i, h, device="cuda", generator=g).div_(h**0.5)
        w13 *= torch.rand(e, 2 * i, 1, device="cuda", generator=g).add_(0.25)
        w2 = torch.randn(e, h, i, device="cuda", generator=g).div_(i**0.5)
        router = torch.randn(e, h, device="cuda", generator=g).div_(h**0.5).bfloat16()
        q13, s13 = quantize_experts(w13, layout)
        q2, s2 = quantize_experts(w2, layout)
        del w13, w2
        _CACHE[layout] = (q13, q2, s13, s2, dequantize_experts(q13, s13, layout),
                          dequantize_experts(q2, s2, layout), router)
    return _CACHE[layout]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokens", [1, 4, 64, 512])
def test_fp8_experts_match_dequantized_reference(layout: str, tokens: int) -> None:
    from executor.kernels.moe import decode, scales
    from executor.kernels.moe.fused import route_and_experts
    from executor.kernels.moe.reference import experts_reference

    q13, q2, s13, s2, d13, d2, router = _experts(layout)
    top_k = QWEN3_30B[1]
    x = torch.randn(tokens, QWEN3_30B[2], device="cuda",
                    generator=torch.Generator(device="cuda").manual_seed(tokens)).bfloat16()
    logits = x @ router.t()
    fp8 = fp8_kwargs(s13, s2, layout)
    others = []  # other tiles' results, within the same tolerance
    if decode.takes(tokens, top_k, QWEN3_30B[0]):
        got, weights, ids = decode.routed(x, logits, q13, q2, top_k, True, True, **fp8)
        assert torch.equal(got, route_and_experts(x, logits, q13, q2, top_k, True, True,
                                                  **fp8))
        # the weight chunks through Triton's pipelined loop: the same bits
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        mode = scales.CHANNEL if layout == "channel" else scales.BLOCKS
        tiles = decode.pick_tiles(tokens, top_k, QWEN3_30B[2], QWEN3_30B[3], torch.bfloat16,
                                  sms, mode)
        tiles = dataclasses.replace(tiles, stages=3, stages_down=3)
        piped = decode.routed(x, logits, q13, q2, top_k, True, True, tiles=tiles, **fp8)[0]
        assert torch.equal(piped, got)
        if layout == "block":  # chunks of two scale blocks, split into them in the kernel
            wide = dataclasses.replace(tiles, block_k=256, block_k_down=256, stages=0,
                                       stages_down=0)
            others.append(decode.routed(x, logits, q13, q2, top_k, True, True, tiles=wide,
                                        **fp8)[0])
    else:
        from executor.kernels.moe.fused import fused_experts
        from executor.kernels.moe.route import route_topk

        weights, ids = route_topk(logits, top_k, True, True)
        got = fused_experts(x, q13, q2, weights, ids, **fp8)
    want = experts_reference(x.float(), d13, d2, weights, ids)
    torch.testing.assert_close(got.float(), want, atol=F32_ATOL, rtol=F32_RTOL)
    rounded = rounded_reference(x, d13, d2, weights, ids).float()
    eps = torch.finfo(torch.bfloat16).eps
    err = (got.float() - rounded).abs()
    print(f"{layout} x{tokens}: max |got - f32 ref| {(got.float() - want).abs().max():.3g}, "
          f"|got - rounded ref| {err.max():.3g} (amax {rounded.abs().max():.3g})")
    for out in (got, *others):
        torch.testing.assert_close(out.float(), rounded, rtol=ROUNDED_ULPS * eps,
                                   atol=ROUNDED_ULPS * eps * float(rounded.abs().max()))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokens", [1, 4, 64])
def test_unit_scales_give_the_bf16_paths_values(layout: str, tokens: int) -> None:
    """e4m3-exact weights with scales of 1 against the same weights in bf16: within the
    rounded reference's tolerance, the share of equal bits printed. (Not bit-equal on the
    GPU: FP8 weights take their own decode tiles, a pipelined stream and other chunks,
    so the float32 sums run in another order; the grouped path's converted operand may
    take another MMA schedule. The interpreter tests check the bits at equal tiles.)"""
    from executor.kernels.moe import decode
    from executor.kernels.moe.fused import route_and_experts

    q13, q2, s13, s2, *_, router = _experts(layout)
    q13 = (q13.float() * 0.25).to(torch.float8_e4m3fn)  # a decent output magnitude
    x = torch.randn(tokens, QWEN3_30B[2], device="cuda").bfloat16()
    logits = x @ router.t()
    ones = fp8_kwargs(torch.ones_like(s13), torch.ones_like(s2), layout)
    want = route_and_experts(x, logits, q13.bfloat16(), q2.bfloat16(), 8, True, True)
    got = route_and_experts(x, logits, q13, q2, 8, True, True, **ones)
    assert want.isfinite().all()
    path = "decode" if decode.takes(tokens, 8, QWEN3_30B[0]) else "grouped"
    print(f"{layout} x{tokens} ({path}): {(got == want).float().mean().item():.2%} bits equal")
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(got, want, rtol=ROUNDED_ULPS * eps,
                               atol=ROUNDED_ULPS * eps * float(want.abs().max()))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokens", [1, 4, 64])
def test_fp8_experts_never_sync_and_replay_in_a_graph(layout: str, tokens: int) -> None:
    """``fused_moe`` on e4m3 experts (the norm fused where the decode path serves): no
    host sync, and a CUDA graph replayed on new inputs gives the eager run's bits."""
    from executor.kernels.moe import decode
    from executor.kernels.moe.fused import fused_moe

    q13, q2, s13, s2, *_, router = _experts(layout)
    fp8 = fp8_kwargs(s13, s2, layout)
    x = torch.randn(tokens, QWEN3_30B[2], device="cuda").bfloat16()
    nw = (1.0 + 0.1 * torch.randn(QWEN3_30B[2], device="cuda")).bfloat16()
    norm = (nw, 1e-6) if decode.takes(tokens, 8, QWEN3_30B[0]) else (None, 0.0)

    def step() -> torch.Tensor:
        return fused_moe(x, x @ router.t(), q13, q2, 8, True, True, *norm, **fp8)

    step()  # compile the kernels outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(seed)))
        graph.replay()
        torch.testing.assert_close(out, step(), atol=0, rtol=0)
