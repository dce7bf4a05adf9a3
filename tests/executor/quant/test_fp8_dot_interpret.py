"""The FP8 x FP8 kernel (``executor.quant.dot_kernel``) and the norm / SiLU-and-mul that
quantize their own output, on CPU under Triton's interpreter.

``fp8_dot`` against the float32 product of the quantized rows and the dequantized weight
(row and block scales, split-K, both MMA orientations, partial tiles); the split-K
reduction is deterministic and leaves its counters at zero; the fused quantization writes
exactly what the activation quantization writes from the unfused op's output; a prepared
layer's 8-64-row paths and fused hooks equal the unfused ones. fp16 for the GEMMs (the
interpreter's bf16 ``tl.dot`` is wrong); the norms also in bf16. Skipped on CUDA machines
(``test_fp8_gpu.py`` runs the compiled kernels).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tests.helpers.interpret import half_ulp, interpreter_triton

triton = interpreter_triton()

from executor import kernels  # noqa: E402
from executor.kernels.activation import silu_and_mul_quant  # noqa: E402
from executor.kernels.norm import rms_norm_quant  # noqa: E402
from executor.quant import Fp8Linear, gemm, launch, read_scheme  # noqa: E402
from executor.quant import dot_kernel as dk  # noqa: E402
from executor.quant.fp8 import (  # noqa: E402
    dequantize,
    quantize_activations,
    quantize_blocks,
    quantize_rows,
)
from executor.quant.scheme import AT_LOAD  # noqa: E402
from executor.quant.tiles import DotTile  # noqa: E402


def _operands(m: int, n: int, k: int, blocks: bool, seed: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 rows, their scales, e4m3 weight, its kernel scales, float32 reference)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / 16
    x = (torch.randn(m, k, generator=gen) * 3).to(torch.float16)
    qa, sa = quantize_activations(x)
    if blocks:
        q, s = quantize_blocks(w)
        dense = dequantize(q, s, (128, 128), torch.float32)
    else:
        q, s = quantize_rows(w)
        dense = dequantize(q, s, None, torch.float32)
        s = s.reshape(-1).contiguous()
    return qa, sa, q, s, (qa.float() * sa) @ dense.T


@pytest.mark.parametrize("blocks", [False, True])
@pytest.mark.parametrize("tile", [DotTile(32, 64, 1, swap_ab=False), DotTile(64, 128, 1),
                                  DotTile(32, 64, 3), DotTile(16, 128, 2, swap_ab=False)])
@pytest.mark.parametrize(("m", "n", "k"), [(8, 96, 320), (20, 130, 384)])
def test_fp8_dot_equals_dequantized_product(m: int, n: int, k: int, tile: DotTile,
                                            blocks: bool) -> None:
    """Every tile the sweep may pick (split-K over uneven slices, partial row, column and
    K tiles) gives the float32 product, rounded once to fp16."""
    qa, sa, q, s, ref = _operands(m, n, k, blocks, seed=m + n)
    got = dk.fp8_dot(qa, sa, q, s, (128, 128) if blocks else None, torch.float16, tile)
    assert got.dtype == torch.float16 and got.shape == (m, n)
    assert ((got.float() - ref).abs() <= half_ulp(ref)).all(), (got.float() - ref).abs().max()


def test_split_k_is_deterministic_and_resets_its_counters() -> None:
    """The slices are summed in slice order whichever program arrives last: the result is
    the same on every launch and the counters are back at zero for the next one."""
    qa, sa, q, s, _ = _operands(16, 64, 512, False, seed=4)
    tile = DotTile(32, 64, 4)
    first = dk.fp8_dot(qa, sa, q, s, None, torch.float16, tile)
    ws = dk._WORKSPACES[qa.device]
    assert ws.counters is not None and not ws.counters.any()
    assert torch.equal(dk.fp8_dot(qa, sa, q, s, None, torch.float16, tile), first)
    assert not ws.counters.any()
    # the four slices' partials, summed in order, are what the output rounds
    parts = ws.partials[: 2 * 4 * 16 * 32].view(2, 4, 16, 32)  # (tiles, slices, rows, cols)
    total = parts[:, 0] + parts[:, 1] + parts[:, 2] + parts[:, 3]
    want = (total.permute(1, 0, 2).reshape(16, 64) * s[None, :] * sa).to(torch.float16)
    assert torch.equal(first, want)
    dk.reserve(qa.device, 64, 4096, 4096, DotTile(64, 128, 8))  # grows, keeps the old
    assert ws.partials is not None and ws.partials.numel() >= 64 * 4096 * 8
    assert ws._kept


def test_fp8_dot_zero_rows() -> None:
    q, s = quantize_rows(torch.randn(32, 64))
    empty = torch.empty(0, 64).to(q.dtype)
    assert dk.fp8_dot(empty, torch.empty(0, 1), q, s.reshape(-1), None, torch.float16
                      ).shape == (0, 32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_quant_equals_quantized_norm(residual: bool, dtype: torch.dtype) -> None:
    """The norm that quantizes its output writes the e4m3 rows and scales that the
    activation quantization writes from the norm's own output, bit for bit."""
    gen = torch.Generator().manual_seed(7)
    x, res = ((torch.randn(5, 300, generator=gen) * 4).to(dtype) for _ in range(2))
    nw = (1 + 0.3 * torch.randn(300, generator=gen)).to(dtype)
    x[2] = 0  # an all-zero row: the least scale, zeros
    q, s, res_out = rms_norm_quant(x, res if residual else None, nw, 1e-5)
    if residual:
        normed, want_res = kernels.add_rms_norm(x, res, nw, 1e-5)
        assert res_out is not None and torch.equal(res_out, want_res)
    else:
        normed = kernels.rms_norm(x, nw, 1e-5)
        assert res_out is None
    wq, ws = launch.act_quant(normed, None)
    assert q.dtype == wq.dtype and s.shape == (5, 1)
    assert torch.equal(s, ws) and torch.equal(q.float(), wq.float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("whole", [True, False])  # in registers; chunks (a partial one)
def test_silu_and_mul_quant_equals_quantized_product(whole: bool, dtype: torch.dtype,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from executor.kernels import activation

    n = 2500
    if not whole:
        monkeypatch.setattr(activation, "MAX_WHOLE_ROW", 1024)
    gen = torch.Generator().manual_seed(n)
    gate_up = (torch.randn(3, 2 * n, generator=gen) * 3).to(dtype)
    q, s = silu_and_mul_quant(gate_up)
    wq, ws = launch.act_quant(kernels.silu_and_mul(gate_up), None)
    assert torch.equal(s, ws) and torch.equal(q.float(), wq.float())


def _layer(k: int, n: int, blocks: bool, seed: int) -> Fp8Linear:
    sch = read_scheme({"quant_method": "fp8", "weight_block_size": [128, 128]}, None) \
        if blocks else AT_LOAD
    assert sch is not None
    layer = Fp8Linear(k, n, sch, (n,), None, bias=False)
    q, s = (quantize_blocks if blocks else quantize_rows)(
        torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / 16)
    with torch.no_grad():
        layer.weight.copy_(q)
        layer.scales.copy_(s)
    gemm.prepare(layer)
    return layer


@pytest.mark.parametrize("m", [8, 64, 70])
def test_prepared_layer_fuses_the_quantization_from_8_rows(m: int) -> None:
    """Per-channel scales from 8 rows: the FP8 x FP8 kernel (to 64 rows; cuBLAS FP8
    above) after the activation quantization, and the fused hooks, whose norm or
    SiLU-and-mul writes the quantized rows, give the unfused path's output exactly."""
    layer = _layer(256, 48, False, seed=m)
    gen = torch.Generator().manual_seed(m)
    x, res = (torch.randn(m, 256, generator=gen).to(torch.float16) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(256, generator=gen)).to(torch.float16)
    q, s = launch.act_quant(x, None)
    ref = (q.float() * s) @ layer.dense_weight(torch.float32).T
    got = layer(x)
    assert ((got.float() - ref).abs() <= half_ulp(ref) * 2).all()
    for residual in (None, res):
        fused = layer.norm_linear(x, residual, nw, 1e-5)
        assert fused is not None
        if residual is None:
            normed, want_res = kernels.rms_norm(x, nw, 1e-5), x
        else:
            normed, want_res = kernels.add_rms_norm(x, residual, nw, 1e-5)
        assert torch.equal(fused[0], layer(normed)) and torch.equal(fused[1], want_res)
    gate_up = torch.randn(m, 512, generator=gen).to(torch.float16)
    assert torch.equal(layer.silu_mul_linear(gate_up), layer(kernels.silu_and_mul(gate_up)))
    assert "8: dot" in layer.path and "64: dot" in layer.path


def test_block_scales_take_the_dot_kernel_where_tuned(tmp_path: Any, monkeypatch: Any
                                                      ) -> None:
    """Block scales stay on w8a16 by default; a sweep row naming the FP8 x FP8 kernel (and
    its tile) sends its bucket (and untimed buckets nearest to it) there, with the fused
    quantization; other GPUs' rows do not count."""
    from executor.quant import tiles

    layer = _layer(256, 160, True, seed=3)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    nw = torch.ones(256, dtype=torch.float16)
    assert layer.norm_linear(x, None, nw, 1e-5) is None  # w8a16's tl.dot rows
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"tiles": [
        {"device": "", "scales": "blocks", "m": 16, "n": 160, "k": 256, "input_op": 0,
         "tile": [32, 128, 4, 0], "us": 9.0, "dot_tile": [32, 128, 2, 4, 0, True],
         "dot_us": 5.0, "kernel": "dot"},
        {"device": "GPU B", "scales": "blocks", "m": 32, "n": 160, "k": 256, "input_op": 0,
         "tile": [32, 128, 4, 0], "us": 9.0, "kernel": "dot"}]}))
    monkeypatch.setattr(tiles, "TILES_FILE", path)
    tiles._dot_rows.cache_clear()
    try:
        assert tiles.pick_dot_tile(16, 160, 256, True, "") == DotTile(32, 128, 2, 4, 0, True)
        # a bucket the sweep did not time takes the nearest timed one; another GPU's
        # rows do not count
        assert tiles.skinny_kernel(64, 160, 256, True, "") == tiles.DOT_KERNEL
        assert tiles.pick_dot_tile(64, 160, 256, True, "") == DotTile(32, 128, 2, 4, 0, True)
        assert tiles.skinny_kernel(32, 160, 256, True, "GPU C") == tiles.W8A16_KERNEL
        assert tiles.skinny_kernel(8, 160, 256, True, "GPU B") == tiles.DOT_KERNEL
        q, s = launch.act_quant(x, None)
        ref = (q.float() * s) @ layer.dense_weight(torch.float32).T
        got = layer(x)
        assert ((got.float() - ref).abs() <= half_ulp(ref) * 2).all()
        fused = layer.norm_linear(x, None, nw, 1e-5)
        assert fused is not None
        assert torch.equal(fused[0], layer(kernels.rms_norm(x, nw, 1e-5)))
    finally:
        tiles._dot_rows.cache_clear()


def test_default_dot_tile_covers_the_sms() -> None:
    """Untuned: K split until about 200 programs, slices of at least 512 columns."""
    from executor.quant.tiles import default_dot_tile

    assert default_dot_tile(64, 4096, 4096, False) == DotTile(64, 128, 4)
    assert default_dot_tile(64, 28672, 4096, False) == DotTile(64, 128, 1)
    assert default_dot_tile(8, 4096, 14336, False).split_k == 4
    assert default_dot_tile(8, 576, 576, False).split_k == 1  # SmolLM2: K too short
