"""The FP8 persistent row kernel (``executor.quant.row_kernel``) under Triton's interpreter.

One row against the float32 product of the dequantized weight (row and 128x128 block
scales, partial blocks, grids whose programs loop over several column blocks), with each
fused input op against the unfused kernel's output; and the tile choice (``kernel`` field
of a tuned row, the default rule). Skipped on CUDA machines (``test_fp8_gpu.py``).
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from tests.helpers.interpret import interpreter_triton

triton = interpreter_triton()
import triton.language as tl  # noqa: E402

from executor import kernels  # noqa: E402
from executor.quant import launch, tiles  # noqa: E402
from executor.quant.fp8 import dequantize, quantize_blocks, quantize_rows  # noqa: E402
from executor.quant.row_kernel import _chunk_words, _half_pairs  # noqa: E402
from executor.quant.tiles import (  # noqa: E402
    ADD_RMS_NORM,
    PLAIN,
    RMS_NORM,
    SILU_MUL,
    Fp8RowTile,
    Fp8Tile,
)


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within half an fp16 ulp (2^-11) of the float32 reference, plus float32
    summation-order slack; bf16 within a whole ulp (2^-7)."""
    # NOTE: the interpreter's float32 -> bf16 conversion truncates (the GPU's rounds to
    # nearest), hence a whole bf16 ulp.
    ulp = 2.0**-11 if got.dtype == torch.float16 else 2.0**-7
    return bool(((got.float() - ref).abs() <= ref.abs() * ulp + ref.abs().amax() * 1e-5
                 + 1e-6).all())


def _weight(n: int, k: int, block: bool, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None, torch.Tensor]:
    """e4m3 weight, its scales as the launcher takes them, the block, the float32 dense."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / 16
    if block:
        q, s = quantize_blocks(w)
        return q, s, (128, 128), dequantize(q, s, (128, 128), torch.float32)
    q, s = quantize_rows(w)
    return q, s.reshape(-1).contiguous(), None, dequantize(q, s, None, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize(("n", "k", "tile"), [(40, 600, Fp8RowTile(2, 4, 1, 0)),
                                              (97, 320, Fp8RowTile(4, 8, 2, 3)),
                                              (33, 256, Fp8RowTile(1, 4, 4, 2))])
def test_row_kernel_equals_dequantized_product(n: int, k: int, tile: Fp8RowTile, block: bool,
                                               dtype: torch.dtype) -> None:
    """Partial column blocks (N not a multiple of the tile), K not a power of two and
    partial scale blocks; the interpreter's grid is sized for 2 SMs, so programs loop."""
    q, s, blk, dense = _weight(n, k, block, seed=n + k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    got = launch.w8a16(x, q, s, blk, tile=tile)
    ref = x.float() @ dense.T
    assert got.dtype == dtype and got.shape == (1, n)
    assert _close(got, ref), (got.float() - ref).abs().max()
    # the FP8 rounding is there: not the product of the unquantized weight
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) / 16
    assert not torch.allclose(got.float(), x.float() @ w.T, atol=1e-3)


@pytest.mark.parametrize("stages", [0, 3])
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("op", [SILU_MUL, RMS_NORM, ADD_RMS_NORM])
def test_row_kernel_fused_input_ops(op: int, block: bool, stages: int) -> None:
    """The fused input op's row is the unfused kernel's output (same roundings), and the
    product is that row's float32 product with the dequantized weight; with a residual,
    ``x + residual`` comes back as the add-norm kernel returns it."""
    n, k = 72, 384
    q, s, blk, dense = _weight(n, k, block, seed=op)
    gen = torch.Generator().manual_seed(op + 7)
    x = torch.randn(1, 2 * k if op == SILU_MUL else k, generator=gen).to(torch.float16)
    res = torch.randn(1, k, generator=gen).to(torch.float16)
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(torch.float16)
    residual = res if op == ADD_RMS_NORM else None
    norm = op != SILU_MUL
    got, got_res = launch.w8a16_fused(x, q, s, blk, op, residual, nw if norm else None,
                                      1e-5, tile=Fp8RowTile(2, 4, 2, stages))
    if op == SILU_MUL:
        row, want_res = kernels.silu_and_mul(x), None
    elif op == RMS_NORM:
        row, want_res = kernels.rms_norm(x, nw, 1e-5), None
    else:
        row, want_res = kernels.add_rms_norm(x, res, nw, 1e-5)
    ref = row.float() @ dense.T
    assert _close(got, ref), (got.float() - ref).abs().max()
    assert (got_res is None) == (want_res is None)
    if want_res is not None:
        assert got_res is not None and torch.equal(got_res, want_res)


def test_tile_choice_by_kernel_field(tmp_path: Any, monkeypatch: Any) -> None:
    """A tuned row's ``kernel`` says which kernel it is for (no field: w8a16); a row tile
    gives way where the row kernel may not run (``row_sms`` 0); untuned single rows take
    ``default_row_tile`` on a GPU where it takes them."""
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"tiles": [
        {"device": "GPU A", "scales": "rows", "m": 1, "n": 4096, "k": 4096, "input_op": 3,
         "kernel": "row", "tile": [8, 4, 2]},
        {"device": "GPU A", "scales": "rows", "m": 1, "n": 4096, "k": 14336, "input_op": 1,
         "tile": [8, 2048, 4, 3]}]}))
    monkeypatch.setattr(tiles, "TILES_FILE", path)
    tiles.tuned_tiles.cache_clear()
    try:
        assert tiles.pick_tile(1, 4096, 4096, False, RMS_NORM, "GPU A", 132) == \
            Fp8RowTile(8, 4, 2)
        assert tiles.pick_tile(1, 4096, 4096, False, ADD_RMS_NORM, "GPU A", 0) == \
            tiles.default_tile(1, 4096, 4096, False, ADD_RMS_NORM)
        assert tiles.pick_tile(1, 4096, 14336, False, SILU_MUL, "GPU A", 132) == \
            Fp8Tile(8, 2048, 4, 3)  # an old row: the w8a16 kernel's
        assert tiles.pick_tile(1, 6144, 4096, False, PLAIN, "GPU A", 132) == \
            Fp8RowTile(4, 8, 2, 3)  # untuned: the default row tile
        assert tiles.pick_tile(2, 6144, 4096, False, PLAIN, "GPU A", 132) == \
            tiles.default_tile(2, 6144, 4096, False)
    finally:
        tiles.tuned_tiles.cache_clear()
    assert tiles.default_row_tile(4096, 14336, 132) == Fp8RowTile(2, 16, 1, 4)
    assert tiles.default_row_tile(576, 576, 132) is None  # too few blocks for the grid
    assert tiles.default_row_tile(4096, 32768, 132) is None  # the row exceeds registers
    assert tiles.valid(Fp8RowTile(2), 1, blocks=True) and not tiles.valid(Fp8RowTile(2), 2, False)


@triton.jit
def _half_layout_probe(x_ptr, w_ptr, words_ptr, pairs_ptr, inv_ptr, BLOCK_R: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """Stores what ``_chunk_words`` and ``_half_pairs`` deal out: (4, R, G) words,
    (8, G) pairs and 1 / s."""
    G: tl.constexpr = BLOCK_K // 16
    half = _half_pairs(tl.load(x_ptr + tl.arange(0, BLOCK_K)), BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    w = tl.load(w_ptr + offs_r[:, None] * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4)[None, :])
    words = _chunk_words(w, BLOCK_R, BLOCK_K)
    g = tl.arange(0, G)
    for m in tl.static_range(4):
        tl.store(words_ptr + m * BLOCK_R * G + offs_r[:, None] * G + g[None, :], words[m])
    for j in tl.static_range(8):
        tl.store(pairs_ptr + j * G + g, half[j])
    tl.store(inv_ptr, half[8])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amax", [0.0, 3e-3, 1.0, 12.0, 3000.0])
def test_half_products_layout(amax: float, dtype: torch.dtype) -> None:
    """The f16-pair path's data layout (its ``cvt``/``fma`` are PTX, which the interpreter
    cannot run; ``test_fp8_gpu.py`` checks its sums): ``_chunk_words`` gives word
    ``4 g + m`` of each row as ``w[m][r, g]``; ``_half_pairs`` scales the row by the power of
    two ``s`` that puts its largest magnitude in [8, 16), exactly, and packs elements
    ``16 g + 2 j`` (low half) and ``16 g + 2 j + 1`` (high) into ``p[j][g]``."""
    k, r = 256, 4
    g = k // 16
    gen = torch.Generator().manual_seed(int(amax) + 1)
    x = torch.randn(k, generator=gen)
    x = (x / x.abs().max() * amax).to(dtype)
    w = torch.randint(-2**31, 2**31 - 1, (r, k // 4), generator=gen, dtype=torch.int32)
    words = torch.empty(4, r, g, dtype=torch.int32)
    pairs = torch.empty(8, g, dtype=torch.int32)
    inv = torch.empty(1, dtype=torch.float32)
    _half_layout_probe[(1,)](x, w, words, pairs, inv, BLOCK_R=r, BLOCK_K=k)
    assert torch.equal(words, w.reshape(r, g, 4).permute(2, 0, 1))
    s = 1.0 / inv.item()
    assert s == 2.0 ** round(math.log2(s))  # a power of two
    top = x.float().abs().max().item()
    assert 8 <= top * s < 16 or top == 0
    scaled = x.float() * s
    half = scaled.to(torch.float16)
    assert torch.equal(half.float(), scaled)  # exact
    bits = half.view(torch.int16).to(torch.int32) & 0xFFFF
    want = (bits[0::2] | (bits[1::2] << 16)).reshape(g, 8).T
    assert torch.equal(pairs, want)
