"""FP8 (e4m3) expert weights in the fused-MoE kernels, on CPU under Triton's interpreter.

Weights quantized per expert (``executor.quant.fp8``: per output channel, or per 128x128
block) and the kernels' result against the experts computed on the dequantized float32
weights: float32 activations against ``experts_reference`` itself (1e-5 relative: only the
summation order and where the row scale multiplies differ), half activations against the
same float32 GEMMs rounded where the kernels round (a few ulp: a float32 sum on either side
of a rounding boundary moves one intermediate by one ulp). The decode path (1 to 4 tokens,
norm fused or not) in bf16 and float32; the grouped path (9, 33, 37 tokens) in fp16 and
float32 (the interpreter's bf16 ``tl.dot`` is wrong: ``test_moe_fp8_gpu.py`` runs bf16).
Top-1/2/8, uneven loads, idle experts; with unit scales and e4m3-exact weights the FP8
path equals the unquantized one bit for bit; bad scale arguments are refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tests.helpers.interpret import interpreter_triton

triton = interpreter_triton()

from executor import kernels  # noqa: E402
from executor.kernels.moe import decode, fused, scales  # noqa: E402
from executor.kernels.moe.reference import experts_reference, route  # noqa: E402
from tests.helpers.moe_fp8 import (  # noqa: E402
    BLOCK,
    dequantize_experts,
    quantize_experts,
    rounded_reference,
)

#: float32 activations: relative, and absolute as a fraction of the output's largest value
F32_TOL = (1e-5, 1e-5)
#: half activations, in ulps of the output's largest value (and relative ulps)
HALF_ULPS = 4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _problem(tokens: int, experts: int, hidden: int, inter: int, layout: str, seed: int
             ) -> dict[str, Any]:
    g = _gen(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    # rows of different magnitudes, so per-row and per-block scales differ
    w13 = w13 * torch.rand(experts, 2 * inter, 1, generator=g).add(0.25)
    q13, s13 = quantize_experts(w13, layout)
    q2, s2 = quantize_experts(w2, layout)
    return {"x": torch.randn(tokens, hidden, generator=g),
            "logits": torch.randn(tokens, experts, generator=g),
            "q13": q13, "q2": q2, "w13": w13, "w2": w2,
            "fp8": {"w13_scale": s13, "w2_scale": s2,
                    "block": BLOCK if layout == "block" else None},
            "d13": dequantize_experts(q13, s13, layout), "d2": dequantize_experts(q2, s2, layout)}


def _assert_matches(got: torch.Tensor, x: torch.Tensor, p: dict[str, Any],
                    weights: torch.Tensor, ids: torch.Tensor) -> None:
    assert got.shape == x.shape and got.dtype == x.dtype
    if x.dtype == torch.float32:
        want = experts_reference(x, p["d13"], p["d2"], weights, ids)
        rtol, frac = F32_TOL
        torch.testing.assert_close(got, want, rtol=rtol, atol=frac * float(want.abs().max()))
        # not merely the unquantized experts' result: the FP8 rounding is there
        exact = experts_reference(x, p["w13"], p["w2"], weights, ids)
        assert not torch.allclose(got, exact, rtol=rtol, atol=frac * float(want.abs().max()))
        return
    want = rounded_reference(x, p["d13"], p["d2"], weights, ids)
    eps = torch.finfo(x.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=HALF_ULPS * eps,
                               atol=HALF_ULPS * eps * float(want.abs().max()))


@pytest.mark.parametrize("layout", ["channel", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inter"),
                         [(1, 8, 1, 160, 128), (1, 16, 8, 160, 128), (4, 32, 2, 96, 256)])
def test_decode_path_fp8(layout: str, dtype: torch.dtype, tokens: int, experts: int,
                         top_k: int, hidden: int, inter: int) -> None:
    """``decode.routed`` on e4m3 experts, its routing as ``route``'s; hidden sizes off the
    128 blocks give partial scale blocks."""
    assert decode.takes(tokens, top_k, experts)
    p = _problem(tokens, experts, hidden, inter, layout, tokens * 100 + top_k)
    x, logits = p["x"].to(dtype), p["logits"].to(dtype)
    out, weights, ids = decode.routed(x, logits, p["q13"], p["q2"], top_k, True, True,
                                      **p["fp8"])
    ref_w, ref_i = route(logits, top_k, True, True)
    assert torch.equal(ids, ref_i)
    # one ulp of the activation dtype where the weights are rounded to it
    torch.testing.assert_close(weights, ref_w, atol=1e-6 if dtype == torch.float32 else 4e-3,
                               rtol=1e-5)
    _assert_matches(out, x, p, weights, ids)


@pytest.mark.parametrize("layout", ["channel", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inter"),
                         [(9, 8, 2, 160, 256), (33, 6, 1, 128, 128), (9, 16, 8, 96, 128)])
def test_grouped_path_fp8(layout: str, dtype: torch.dtype, tokens: int, experts: int,
                          top_k: int, hidden: int, inter: int) -> None:
    """``route_and_experts`` past the decode path: routing, align, the two grouped GEMMs
    on e4m3 weights converted to the activation dtype (``tl.dot``), the sum."""
    assert not decode.takes(tokens, top_k, experts)
    p = _problem(tokens, experts, hidden, inter, layout, tokens * 10 + top_k)
    x, logits = p["x"].to(dtype), p["logits"].to(dtype)
    got = fused.route_and_experts(x, logits, p["q13"], p["q2"], top_k, False, False,
                                  **p["fp8"])
    weights, ids = route(logits, top_k, False, False)
    _assert_matches(got, x, p, weights, ids)


@pytest.mark.parametrize("layout", ["channel", "block"])
def test_uneven_loads_and_idle_experts(layout: str) -> None:
    """Expert 0 takes every token (two 16-row blocks), expert 3 most, expert 5 a few,
    the rest none; grouped tiles of two sizes, and the decode path with every token on
    the same two experts, chunks wider than a scale block, its weight chunks prefetched
    in registers and through the pipelined loop."""
    tokens, experts = 20, 8
    p = _problem(tokens, experts, 160, 128, layout, 5)
    x = p["x"]
    ids = torch.zeros(tokens, 2, dtype=torch.int32)
    ids[:, 1] = 3
    ids[::7, 1] = 5
    weights = torch.rand(tokens, 2, generator=_gen(6))
    for tiles in (fused.MoeTiles(16, 64, 64), fused.MoeTiles(64, 64, 128, block_n_down=32)):
        got = fused.fused_experts(x, p["q13"], p["q2"], weights, ids, tiles, **p["fp8"])
        _assert_matches(got, x, p, weights, ids)
    p = _problem(3, experts, 320, 128, layout, 7)
    x, logits = p["x"], p["logits"]
    logits[:, 5] = 8.0
    logits[:, 2] = 6.0
    # (block scales: gate_up's chunks span two blocks, the last a partial one and one
    # past the end; down's one and one past the end)
    wide = decode.DecodeTiles(16, 256, 16, 256)
    out, w, i = decode.routed(x, logits, p["q13"], p["q2"], 2, True, False, tiles=wide,
                              **p["fp8"])
    assert i.tolist() == [[5, 2]] * 3
    _assert_matches(out, x, p, w, i)
    # the weight chunks through the pipelined loop: the same products in the same order
    piped = dataclasses.replace(wide, stages=3, stages_down=2)
    again = decode.routed(x, logits, p["q13"], p["q2"], 2, True, False, tiles=piped,
                          **p["fp8"])[0]
    assert torch.equal(again, out)


@pytest.mark.parametrize("layout", ["channel", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_path_fp8_fused_norm(layout: str, dtype: torch.dtype) -> None:
    """With a norm weight the kernel normalizes the residual sum: ``fused_moe`` (which
    takes the decode path at two tokens) gives the result of the norm kernel followed by
    the unnormed path, and of the reference on the normed rows."""
    p = _problem(2, 32, 160, 128, layout, 11)
    x, logits = (p["x"] * 3.0).to(dtype), p["logits"].to(dtype)
    nw = (1.0 + 0.2 * torch.randn(160, generator=_gen(12))).to(dtype)
    got = fused.fused_moe(x, logits, p["q13"], p["q2"], 4, True, True, nw, 1e-6, **p["fp8"])
    normed = kernels.rms_norm(x, nw, 1e-6)
    want, weights, ids = decode.routed(normed, logits, p["q13"], p["q2"], 4, True, True,
                                       **p["fp8"])
    assert torch.equal(got, want)
    # (the kernel's own routing: equal bf16 logits tie, and ``route`` may pick the other)
    _assert_matches(got, normed, p, weights, ids)


@pytest.mark.parametrize("layout", ["channel", "block"])
@pytest.mark.parametrize(("dtype", "tokens"), [(torch.float32, 1), (torch.bfloat16, 2),
                                               (torch.float16, 33)])
def test_unit_scales_equal_the_unquantized_path(layout: str, dtype: torch.dtype,
                                                tokens: int) -> None:
    """Weights that are e4m3 values with scales of 1: the FP8 path's result is the
    unquantized path's, bit for bit (the same products, sums and roundings)."""
    p = _problem(tokens, 16, 160, 128, layout, 21)
    # e4m3 values of the weights' own magnitude (the quantized ones reach 448, which
    # overflows fp16 in the products)
    q13 = (p["d13"] * 2).to(scales.FP8)
    q2 = (p["d2"] * 2).to(scales.FP8)
    ones = {"w13_scale": torch.ones_like(p["fp8"]["w13_scale"]),
            "w2_scale": torch.ones_like(p["fp8"]["w2_scale"]), "block": p["fp8"]["block"]}
    x, logits = p["x"].to(dtype), p["logits"].to(dtype)
    # exact: every e4m3 value is a bf16 / fp16 value
    want = fused.route_and_experts(x, logits, q13.to(dtype), q2.to(dtype), 2, True, True)
    got = fused.route_and_experts(x, logits, q13, q2, 2, True, True, **ones)
    assert want.isfinite().all() and want.abs().amax() > 0.01
    assert torch.equal(got, want)


def test_bad_scale_arguments_are_refused() -> None:
    p = _problem(1, 8, 160, 128, "channel", 31)
    q13, q2, s13, s2 = p["q13"], p["q2"], p["fp8"]["w13_scale"], p["fp8"]["w2_scale"]
    x, logits = p["x"], p["logits"]
    b13, b2 = quantize_experts(p["d13"], "block")[1], quantize_experts(p["d2"], "block")[1]
    cases = [
        ({"w13_scale": s13, "w2_scale": None}, "both or neither"),
        ({}, "e4m3 weights need their scales"),
        ({"w13_scale": s13, "w2_scale": s2, "block": (64, 64)}, "128x128"),
        ({"w13_scale": s13[:, :-1].contiguous(), "w2_scale": s2}, "w_gate_up scales"),
        ({"w13_scale": s13, "w2_scale": s2.double()}, "float32"),
        ({"w13_scale": s13, "w2_scale": s2, "block": BLOCK}, "block shape"),
        ({"w13_scale": b13, "w2_scale": b2}, "per-channel shape"),
        ({"block": BLOCK}, "without scales"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            fused.route_and_experts(x, logits, q13, q2, 2, True, True, **kwargs)
    with pytest.raises(ValueError, match="e4m3 weights are expected"):
        fused.route_and_experts(x, logits, p["d13"], p["d2"], 2, True, True, w13_scale=s13,
                                w2_scale=s2)
    # block scales need the experts' width in whole blocks
    q, s = quantize_experts(p["d13"][:, :192], "block")
    with pytest.raises(ValueError, match="multiple of 128"):
        fused.route_and_experts(x, logits, q, quantize_experts(p["d2"][:, :, :96], "block")[0],
                                2, True, True, w13_scale=s, w2_scale=s, block=BLOCK)


def test_custom_op_takes_the_scales_and_tiles_fit_the_blocks() -> None:
    """``model_executor::fused_moe`` with scales: its fake impl (``opcheck``; the schema
    test multiplies the inputs, which CPU e4m3 cannot), a Dynamo trace records one node
    equal to the eager call; the decode tiles of block-scaled weights take whole blocks
    or chunks inside one, through the pipelined stream."""
    p = _problem(1, 8, 160, 128, "block", 41)
    x, logits = p["x"].to(torch.bfloat16), p["logits"].to(torch.bfloat16)
    args = (x, logits, p["q13"], p["q2"], 2, True, True, None, 0.0,
            p["fp8"]["w13_scale"], p["fp8"]["w2_scale"], [128, 128])
    torch.library.opcheck(torch.ops.model_executor.fused_moe.default, args,
                          test_utils=("test_faketensor",))
    want = fused.fused_moe(*args[:9], **p["fp8"])
    assert torch.equal(torch.ops.model_executor.fused_moe(*args), want)
    graphs: list[Any] = []

    def backend(gm: torch.fx.GraphModule, _: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    got = torch.compile(lambda *a: fused.fused_moe(*a, **p["fp8"]), backend=backend,
                        fullgraph=True)(*args[:7])
    assert torch.equal(got, want)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets == ["model_executor.fused_moe"]
    for tokens in (1, 4):
        tiles = decode.pick_tiles(tokens, 8, 2048, 768, torch.bfloat16, 132, scales.BLOCKS)
        # whole blocks (split into them in the kernels) or inside one
        for chunk in (tiles.block_k, tiles.block_k_down):
            assert chunk % 128 == 0 or 128 % chunk == 0, tiles
        plain = decode.pick_tiles(tokens, 8, 2048, 768, torch.bfloat16, 132)
        assert tiles.block_n == plain.block_n and tiles.stages > 0 == plain.stages
