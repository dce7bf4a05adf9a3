"""The FP8 Triton kernels (``executor.quant.kernels``) on CPU under Triton's interpreter.

``w8a16`` (FP8 weight, fp16 rows, dequantized in registers) against the float32 product
of the dequantized weight, for row and block scales, the CUDA-core (< 8 rows) and the
``tl.dot`` variants, partial tiles and blocks; ``act_quant`` against ``fp8.py``. fp16 only:
the interpreter's bf16 ``tl.dot`` is wrong (the GPU tests run bf16). Skipped on CUDA
machines, where ``test_fp8_gpu.py`` runs the compiled kernels.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tests.helpers.interpret import half_ulp, interpreter_triton

triton = interpreter_triton()

from executor.quant import Fp8Linear, gemm, launch, read_scheme  # noqa: E402
from executor.quant.fp8 import (  # noqa: E402
    FP8,
    dequantize,
    quantize_activations,
    quantize_blocks,
    quantize_rows,
    quantize_tensor,
)
from executor.quant.scheme import AT_LOAD  # noqa: E402
from executor.quant.tiles import Fp8Tile  # noqa: E402


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 96, 320), (3, 40, 256), (8, 130, 384),
                                           (20, 64, 200)])
def test_w8a16_equals_dequantized_product(m: int, n: int, k: int, block: bool) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen) / 16
    x = torch.randn(m, k, generator=gen).to(torch.float16)
    if block:
        q, s = quantize_blocks(w)
        dense = dequantize(q, s, (128, 128), torch.float32)
        got = launch.w8a16(x, q, s, (128, 128))
    else:
        q, s = quantize_rows(w)
        dense = dequantize(q, s, None, torch.float32)
        got = launch.w8a16(x, q, s.reshape(-1).contiguous(), None)
    ref = x.float() @ dense.T  # float32, then one rounding to fp16 (the kernel's too)
    assert got.dtype == torch.float16 and got.shape == (m, n)
    assert ((got.float() - ref).abs() <= half_ulp(ref)).all()
    # not merely close to the unquantized weight: the FP8 rounding is there
    assert not torch.allclose(got.float(), x.float() @ w.T, atol=1e-3)


def test_w8a16_zero_rows() -> None:
    q, s = quantize_rows(torch.randn(32, 64))
    assert launch.w8a16(torch.empty(0, 64, dtype=torch.float16), q, s.reshape(-1), None
                        ).shape == (0, 32)


@pytest.mark.parametrize("static", [False, True])
def test_act_quant_matches_reference(static: bool) -> None:
    x = (torch.randn(5, 300, generator=torch.Generator().manual_seed(3)) * 2).to(torch.float16)
    scale = torch.tensor([0.01]) if static else None
    q, s = launch.act_quant(x, scale)
    rq, rs = quantize_activations(x, scale)
    assert q.dtype == FP8 and s.shape == (5, 1)
    torch.testing.assert_close(s, rs, rtol=0, atol=0)
    got, want = q.float(), rq.float()
    exact = (x.float() / rs).clamp(-448, 448)
    # Within half an e4m3 step of the exact quotient (a tie may round either way)...
    step = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(2.0**-6))) - 3)
    near = (got - exact).abs() <= step / 2 + 1e-6
    # NOTE: ...except that the interpreter's float32 -> e4m3 conversion drops the carry
    # when rounding up crosses a power of two (124.3 gives 64, not 128); the GPU's does
    # not. Those elements are half the reference.
    carry = (want.abs() == 2.0 ** torch.log2(want.abs().clamp_min(1e-30)).round()) \
        & (got == want / 2)
    assert (near | carry).all()
    assert (got == want).float().mean() > 0.95


def _layer(kind: str, n_shards: tuple[int, ...], k: int, seed: int) -> Fp8Linear:
    """An ``Fp8Linear`` of random weights (each fused shard its own scales)."""
    scheme = {"block": read_scheme({"quant_method": "fp8", "weight_block_size": [128, 128]},
                                   None),
              "channel": AT_LOAD,
              "tensor": read_scheme({"quant_method": "modelopt", "quant_algo": "FP8"}, None)}
    sch = scheme[kind]
    assert sch is not None
    layer = Fp8Linear(k, sum(n_shards), sch, n_shards, None, bias=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, rows in enumerate(n_shards):
            lo = sum(n_shards[:i])
            w = torch.randn(rows, k, generator=gen) / (8 * (i + 1))  # shards scaled apart
            if kind == "block":
                q, s = quantize_blocks(w)
                layer.scales[lo // 128 : lo // 128 + s.shape[0]] = s
            elif kind == "channel":
                q, s = quantize_rows(w)
                layer.scales[lo : lo + rows] = s
            else:
                q, s = quantize_tensor(w)
                layer.scales[i] = s
                assert layer.input_scale is not None
                layer.input_scale[i] = 0.02 * (i + 1)
            layer.weight[lo : lo + rows] = q
    return layer


@pytest.mark.parametrize("m", [1, 8, 80])
@pytest.mark.parametrize("kind", ["block", "channel", "tensor"])
def test_prepared_layer_equals_dequantized_reference(kind: str, m: int) -> None:
    """``gemm.prepare``'s paths (w8a16 up to 64 rows, but the FP8 x FP8 kernel from 8 rows
    for per-channel scales; above, ``torch._scaled_mm`` after the activation
    quantization, or w8a16 for block scales) against float32 on the values each path
    multiplies: dequantized weights, and the quantized activations where the path
    quantizes them."""
    layer = _layer(kind, (256, 128, 128) if kind != "channel" else (96, 160), 256, seed=m)
    dense = layer.dense_weight(torch.float32)  # before prepare: its own scales
    gemm.prepare(layer)
    if kind == "tensor":  # fused shards requantized to one scale: within an FP8 step
        after = layer.dense_weight(torch.float32)
        assert ((after - dense).abs() <= dense.abs() * 2.0**-3 + 1e-6).all()
        assert bool((layer.scales == layer.scales[0]).all())
        dense = after
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(5)).to(torch.float16)
    got = layer(x)
    rows = x.float()
    if (m > gemm.SKINNY_MAX_ROWS and kind != "block") or (m >= 8 and kind == "channel"):
        static = layer.input_scale.max().reshape(1) if layer.input_scale is not None else None
        # the kernel's own quantized rows (its test above covers the interpreter's carry)
        q, s = launch.act_quant(x, static)
        rows = q.float() * s
    ref = rows @ dense.T
    assert got.shape == (m, dense.shape[0]) and got.dtype == torch.float16
    assert ((got.float() - ref).abs() <= half_ulp(ref) * 2).all(), \
        (got.float() - ref).abs().max()
    assert layer.path.startswith("w8a16")


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("kind", ["block", "channel"])
def test_fused_input_ops_equal_the_unfused_kernels(kind: str, m: int) -> None:
    """RMSNorm, residual-add + RMSNorm and SiLU-and-mul fused into the FP8 GEMM (the
    skinny kernels' hook) give the unfused kernels' results bit for bit: the same
    roundings of the input, the same sums."""
    from executor import kernels

    layer = _layer(kind, (48,), 256, seed=11)  # (a partial block of rows)
    gemm.prepare(layer)
    gen = torch.Generator().manual_seed(m)
    x, res = (torch.randn(m, 256, generator=gen).to(torch.float16) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(256, generator=gen)).to(torch.float16)
    for residual in (None, res):
        got, got_res = kernels.add_rms_norm_linear(x, residual, nw, 1e-5, layer,
                                                   kernels.rms_norm, kernels.add_rms_norm)
        if residual is None:
            normed, want_res = kernels.rms_norm(x, nw, 1e-5), x
        else:
            normed, want_res = kernels.add_rms_norm(x, residual, nw, 1e-5)
        assert torch.equal(got, layer(normed)) and torch.equal(got_res, want_res)
    gate_up = torch.randn(m, 512, generator=gen).to(torch.float16)
    got = kernels.silu_and_mul_linear(gate_up, layer, kernels.silu_and_mul)
    assert torch.equal(got, layer(kernels.silu_and_mul(gate_up)))
    eight = torch.randn(8, 512, generator=gen).to(torch.float16)
    if kind == "block":  # w8a16's tl.dot rows: not fused
        assert layer.silu_mul_linear(eight) is None
    else:  # the FP8 x FP8 kernel's rows: SiLU-and-mul quantizes them
        assert torch.equal(layer.silu_mul_linear(eight), layer(kernels.silu_and_mul(eight)))


@pytest.mark.parametrize("tile", [Fp8Tile(16, 64, 4), Fp8Tile(2, 128, 8), Fp8Tile(8, 256, 4),
                                  Fp8Tile(1, 512, 4, 3)])
@pytest.mark.parametrize("m", [1, 3])
def test_w8a16_any_valid_tile_gives_the_product(tile: Fp8Tile, m: int) -> None:
    """What the tile sweep may pick: chunks inside one 128-column block or of several."""
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(40, 600, generator=gen) / 16
    x = torch.randn(m, 600, generator=gen).to(torch.float16)
    q, s = quantize_blocks(w)
    ref = x.float() @ dequantize(q, s, (128, 128), torch.float32).T
    got = launch.w8a16(x, q, s, (128, 128), tile=tile)
    assert ((got.float() - ref).abs() <= half_ulp(ref)).all()


def test_tuned_tiles_are_read_by_shape_and_device(tmp_path: Any, monkeypatch: Any) -> None:
    from executor.quant import tiles

    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"tiles": [
        {"device": "GPU A", "scales": "rows", "m": 1, "n": 4096, "k": 4096, "input_op": 3,
         "tile": [2, 1024, 8, 3]},
        {"device": "GPU B", "scales": "rows", "m": 1, "n": 4096, "k": 4096, "input_op": 3,
         "tile": [8, 512, 4, 4]}]}))
    monkeypatch.setattr(tiles, "TILES_FILE", path)
    tiles.tuned_tiles.cache_clear()
    tiles._scaled_mm_faster.cache_clear()
    try:
        # the first layer's plain norm shares its add-norm twin's tile
        assert tiles.pick_tile(1, 4096, 4096, False, tiles.RMS_NORM, "GPU B") == \
            Fp8Tile(8, 512, 4, 4)
        assert tiles.pick_tile(1, 4096, 4096, False, tiles.ADD_RMS_NORM, "GPU C") == \
            Fp8Tile(2, 1024, 8, 3)  # another GPU: the first one listed
        assert tiles.pick_tile(2, 4096, 4096, False, tiles.PLAIN, "GPU A") == \
            tiles.default_tile(2, 4096, 4096, False)
        assert not tiles.scaled_mm_faster(1, 4096, 4096, "GPU A")
    finally:
        tiles.tuned_tiles.cache_clear()
        tiles._scaled_mm_faster.cache_clear()
    assert not tiles.valid(Fp8Tile(64, 256), 16, blocks=True)
    assert not tiles.valid(Fp8Tile(4, 192), 1, blocks=True)


def test_measured_cublas_rows_take_scaled_mm(tmp_path: Any, monkeypatch: Any) -> None:
    """A row bucket the sweep found faster on cuBLAS FP8 goes there (activations quantized
    per token) instead of w8a16, fused input ops included."""
    from executor import kernels
    from executor.quant import tiles

    layer = _layer("channel", (96, 160), 256, seed=2)
    gemm.prepare(layer)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    w8a16 = layer(x)
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"tiles": [
        {"device": "", "scales": "rows", "m": 4, "n": 256, "k": 256, "input_op": 0,
         "tile": [4, 256, 8, 0], "us": 10.0, "scaled_mm_us": 5.0}]}))
    monkeypatch.setattr(tiles, "TILES_FILE", path)
    tiles._scaled_mm_faster.cache_clear()
    try:
        got = layer(x)
        q, s = launch.act_quant(x, None)
        ref = (q.float() * s) @ layer.dense_weight(torch.float32).T
        assert ((got.float() - ref).abs() <= half_ulp(ref) * 2).all()
        assert not torch.equal(got, w8a16)
        nw = torch.ones(256, dtype=torch.float16)
        assert layer.norm_linear(x, None, nw, 1e-5) is None  # not fused: cuBLAS here
        fused = kernels.add_rms_norm_linear(x, None, nw, 1e-5, layer, kernels.rms_norm,
                                            kernels.add_rms_norm)[0]
        assert torch.equal(fused, layer(kernels.rms_norm(x, nw, 1e-5)))
    finally:
        tiles._scaled_mm_faster.cache_clear()
