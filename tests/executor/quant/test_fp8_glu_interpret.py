"""The FP8 gated (GLU) epilogue under Triton's interpreter: ``launch.w8a16_glu``.

A fused gate|up weight (2I, K) with the norm before it and ``silu(gate) * up`` after it in
one launch must give ``silu_and_mul`` of the unfused GEMM's output bit for bit, at a tile
of the same reduction (a GLU block of ``b`` columns sums ``2b`` weight rows as the plain
launch's ``2b``-row block does): both kernels (the persistent row kernel and the w8a16
kernel's CUDA-core path), row and block scales (I not a multiple of 128: a block of scale
rows holds gate and up rows), RMSNorm and residual-add + RMSNorm (the new residual too),
fp16 and bf16. Then the layer's hook (``Fp8Linear.norm_glu_linear``: where it applies,
the switch), the tiles of its own key, and a small FP8 Llama decoding with the epilogue on
and off. Skipped on CUDA machines (``test_fp8_gpu.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.interpret import interpreter_triton

triton = interpreter_triton()

from executor import kernels  # noqa: E402
from executor.kernels.switches import KernelSwitches  # noqa: E402
from executor.quant import Fp8Linear, gemm, launch, tiles  # noqa: E402
from executor.quant.fp8 import quantize_blocks, quantize_rows  # noqa: E402
from executor.quant.scheme import AT_LOAD  # noqa: E402
from executor.quant.tiles import (  # noqa: E402
    ADD_RMS_NORM,
    RMS_NORM,
    Fp8RowTile,
    Fp8Tile,
)

#: Output columns (I) and K: I not a multiple of 128 (gate and up rows share a block of
#: scale rows), K not a power of two (a partial scale block, masked K).
INTER, K = 40, 200


def _weight(block: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]:
    """A gate|up e4m3 weight (2I, K) and its scales as the launchers take them; the up
    half scaled apart from the gate half, so a swapped pairing cannot pass."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.cat([torch.randn(INTER, K, generator=gen) / 16,
                   torch.randn(INTER, K, generator=gen) / 4])
    if block:
        q, s = quantize_blocks(w)
        return q, s, (128, 128)
    q, s = quantize_rows(w)
    return q, s.reshape(-1).contiguous(), None


def _inputs(m: int, dtype: torch.dtype, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x, res = (torch.randn(m, K, generator=gen).to(dtype) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(K, generator=gen)).to(dtype)
    return x, res, nw


def _doubled(tile: Fp8Tile | Fp8RowTile) -> Fp8Tile | Fp8RowTile:
    """The plain launch's tile of the same reduction: twice the rows per block."""
    return dataclasses.replace(tile, block_n=2 * tile.block_n)


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize(("op", "dtype"), [(RMS_NORM, torch.float16),
                                           (ADD_RMS_NORM, torch.bfloat16)])
@pytest.mark.parametrize(("m", "tile"), [(1, Fp8RowTile(2, 4, 2, 0)),
                                         (1, Fp8RowTile(1, 4, 1, 3)),
                                         (1, Fp8Tile(2, 128, 8)),
                                         (3, Fp8Tile(4, 256, 4))])
def test_glu_equals_silu_and_mul_of_the_unfused_gemm(m: int, tile: Fp8Tile | Fp8RowTile,
                                                     op: int, dtype: torch.dtype,
                                                     block: bool) -> None:
    """The row kernel (register prefetch; pipelined loop with programs looping over
    blocks) and the w8a16 kernel (one row; three rows, chunks over two scale blocks)."""
    q, s, blk = _weight(block, seed=op + 2 * block)
    x, res, nw = _inputs(m, dtype, seed=m + op)
    residual = res if op == ADD_RMS_NORM else None
    got, got_res = launch.w8a16_glu(x, q, s, blk, op, residual, nw, 1e-5, tile)
    gate_up, want_res = launch.w8a16_fused(x, q, s, blk, op, residual, nw, 1e-5,
                                           _doubled(tile))
    want = kernels.silu_and_mul(gate_up)
    assert got.shape == (m, INTER) and got.dtype == dtype
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    if residual is None:
        assert got_res is None and want_res is None
    else:
        assert got_res is not None and want_res is not None and torch.equal(got_res, want_res)
        assert torch.equal(want_res, kernels.add_rms_norm(x, res, nw, 1e-5)[1])


def test_glu_refuses_odd_weights() -> None:
    q, s, _ = _weight(False, seed=0)
    nw = torch.ones(K, dtype=torch.float16)
    with pytest.raises(AssertionError):  # no pairs in an odd number of rows
        launch.w8a16_glu(torch.ones(1, K, dtype=torch.float16), q[:-1], s[:-1], None,
                         RMS_NORM, None, nw, 1e-5)


def _layer(kind: str, rows: int = 2 * INTER, bias: bool = False) -> Fp8Linear:
    """A prepared gate|up ``Fp8Linear`` (two shards of ``rows / 2``)."""
    from executor.quant import read_scheme

    scheme = AT_LOAD if kind == "channel" else read_scheme(
        {"quant_method": "fp8", "weight_block_size": [128, 128]}, None)
    assert scheme is not None
    layer = Fp8Linear(K, rows, scheme, (rows // 2, rows - rows // 2), 0, bias=bias)
    q, s, _ = _weight(kind == "block", seed=5)
    with torch.no_grad():
        layer.weight.copy_(q[:rows])
        layer.scales.copy_(s.reshape(layer.scales.shape) if rows == 2 * INTER else
                           s[:rows].reshape(layer.scales.shape))
        if layer.bias is not None:
            layer.bias.zero_()
    gemm.prepare(layer)
    return layer


@pytest.mark.parametrize("kind", ["channel", "block"])
def test_layer_hook_applies_below_dot_rows_with_the_switch_on(kind: str) -> None:
    """``norm_glu_linear`` at 1 and 3 rows equals the norm GEMM's hook then SiLU-and-mul
    (untuned: the GLU default tile is the plain default's reduction); None at 8 rows, with
    the switch off, for a bias, or an odd number of rows."""
    layer = _layer(kind)
    for m in (1, 3):
        x, res, nw = _inputs(m, torch.float16, seed=m)
        for residual in (None, res):
            got = layer.norm_glu_linear(x, residual, nw, 1e-5)
            want = layer.norm_linear(x, residual, nw, 1e-5)
            assert got is not None and want is not None
            assert torch.equal(got[0], kernels.silu_and_mul(want[0]))
            assert torch.equal(got[1], want[1])
    x, res, nw = _inputs(8, torch.float16, seed=8)
    assert layer.norm_glu_linear(x, res, nw, 1e-5) is None  # tensor cores / quantized rows
    x, res, nw = _inputs(1, torch.float16, seed=1)
    with KernelSwitches(fp8_glu=False):
        assert layer.norm_glu_linear(x, res, nw, 1e-5) is None
    assert _layer(kind, bias=True).norm_glu_linear(x, res, nw, 1e-5) is None
    if kind == "channel":
        assert _layer(kind, rows=2 * INTER - 1).norm_glu_linear(x, res, nw, 1e-5) is None


@contextlib.contextmanager
def _tile_file(path: Path, rows: list[dict[str, Any]], monkeypatch: Any) -> Iterator[None]:
    """``rows`` as the tile file while inside (the readers' caches cleared both ways)."""
    path.write_text(json.dumps({"tiles": rows}))
    caches = (tiles.tuned_tiles, tiles._scaled_mm_faster, tiles._dot_rows)
    monkeypatch.setattr(tiles, "TILES_FILE", path)
    for cache in caches:
        cache.cache_clear()
    try:
        yield
    finally:  # (monkeypatch puts the file back at teardown)
        for cache in caches:
            cache.cache_clear()


def test_glu_tiles_are_keyed_apart(tmp_path: Any, monkeypatch: Any) -> None:
    """A ``glu`` row of the tile file is the gated launch's, a row without it the plain
    launch's of the same weight; neither stands in for the other, and a GLU row's cuBLAS
    time decides nothing. Defaults: a GLU block is half the plain block's columns (the
    same weight rows)."""
    plain = {"device": "GPU A", "scales": "rows", "m": 1, "n": 28672, "k": 4096,
             "input_op": 3, "kernel": "row", "tile": [4, 8, 2, 3], "us": 30.0}
    glu = {**plain, "glu": True, "tile": [2, 16, 1, 4], "us": 31.0, "scaled_mm_us": 1.0}
    with _tile_file(tmp_path / "tiles.json", [plain, glu], monkeypatch):
        assert tiles.pick_tile(1, 28672, 4096, False, ADD_RMS_NORM, "GPU A", 132) == \
            Fp8RowTile(4, 8, 2, 3)
        assert tiles.pick_tile(1, 28672, 4096, False, RMS_NORM, "GPU A", 132, glu=True) == \
            Fp8RowTile(2, 16, 1, 4)
        assert not tiles.scaled_mm_faster(1, 28672, 4096, "GPU A")
        # untuned GLU shapes: the plain defaults' weight rows per block
        assert tiles.pick_tile(1, 6144, 4096, False, ADD_RMS_NORM, "GPU A", 132, glu=True) \
            == Fp8RowTile(2, 8, 2, 3)
        assert tiles.pick_tile(3, 28672, 4096, False, ADD_RMS_NORM, "GPU A", glu=True) == \
            Fp8Tile(2, 512, 8)
    assert tiles.default_row_tile(6144, 4096, 132) == Fp8RowTile(4, 8, 2, 3)
    assert tiles.default_row_tile(28672, 14336, 132, glu=True) == Fp8RowTile(1, 16, 1, 4)
    assert tiles.default_row_tile(576, 576, 132, glu=True) is None
    assert tiles.default_tile(1, 28672, 4096, False, ADD_RMS_NORM, glu=True) == \
        Fp8Tile(2, 2048, 8)


def _decode_logits(ex: Any, seq: str, prompt: list[int], token: int) -> torch.Tensor:
    """Logits of a prefill of ``prompt`` (fewer than 8 rows: the epilogue's too) and of
    one decoded row after it, as ``forward_logits`` gives them."""
    out = []
    for phase, toks in (("prefill", prompt), ("decode", [token])):
        alloc = ex.kv.allocate([(seq, len(toks))])
        batch = ex.build_batch(phase, toks, alloc, [])
        batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens))
        out.append(ex.forward_logits(batch))
    ex.release([seq])
    return torch.cat(out)


def _wide_tiles(hidden: int, inter: int) -> list[dict[str, Any]]:
    """A tile file for the small model's projections at 1 and 4 rows: 64-row blocks (few
    programs: the interpreter's cost is per program), the GLU launch's under its own key
    with the same reduction (32 columns, 64 weight rows)."""
    rows = []
    for m in (1, 4):
        for n, k, op, glu, bn in ((3 * hidden, hidden, ADD_RMS_NORM, False, 64),  # qkv
                                  (hidden, hidden, tiles.PLAIN, False, 64),  # o, down plain
                                  (2 * inter, hidden, ADD_RMS_NORM, False, 64),  # gate_up
                                  (2 * inter, hidden, ADD_RMS_NORM, True, 32),  # + GLU
                                  (hidden, inter, tiles.SILU_MUL, False, 64)):  # down
            rows.append({"device": "", "scales": "rows", "m": m, "n": n, "k": k,
                         "input_op": op, "tile": [bn, 64, 4, 0], "us": 1.0,
                         **({"glu": True} if glu else {})})
    return rows


def test_fp8_llama_decodes_alike_with_the_epilogue_on_and_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small per-channel FP8 Llama in fp16, its projections kept in FP8 on the CPU (as on
    an FP8 GPU) and the kernels' ops: a prefill of 3 rows and a decoded row give the same
    logits with the gated epilogue (each layer's gate_up ends in SiLU-and-mul, down takes
    it plainly) as without it (down fuses SiLU-and-mul), and the epilogue ran."""
    from executor.config import CacheConfig, ExecutorConfig, ModelConfig
    from executor.executor import Executor
    from tests.helpers.fp8_models import write_fp8_model

    hidden, inter = 64, 64
    monkeypatch.setattr(gemm, "fp8_supported", lambda device: True)
    path = write_fp8_model(tmp_path / "fp8", "channel", vocab_size=128, hidden_size=hidden,
                           intermediate_size=inter, num_hidden_layers=2,
                           num_attention_heads=1, num_key_value_heads=1, head_dim=64)
    ex = Executor(ExecutorConfig(model=ModelConfig(source=str(path), dtype="float16"),
                                 device="cpu", cache=CacheConfig(kv_tokens=64, max_sequences=2,
                                                                 max_context=32)))
    assert isinstance(ex.model.layers[0].mlp.gate_up_proj, Fp8Linear)  # type: ignore[attr-defined]
    ex.model.kernels = "triton"  # type: ignore[assignment]
    calls = {"glu": 0, "silu_mul": 0}
    real_glu, real_fused = launch.w8a16_glu, launch.w8a16_fused

    def glu(*args: Any, **kwargs: Any) -> Any:
        calls["glu"] += 1
        return real_glu(*args, **kwargs)

    def fused(*args: Any, **kwargs: Any) -> Any:
        calls["silu_mul"] += args[4] == tiles.SILU_MUL
        return real_fused(*args, **kwargs)

    monkeypatch.setattr(launch, "w8a16_glu", glu)
    monkeypatch.setattr(launch, "w8a16_fused", fused)
    with _tile_file(tmp_path / "tiles.json", _wide_tiles(hidden, inter), monkeypatch):
        on = _decode_logits(ex, "on", [3, 17, 99], 11)
        assert calls == {"glu": 4, "silu_mul": 0}  # two forwards, two layers
        with KernelSwitches(fp8_glu=False):
            off = _decode_logits(ex, "off", [3, 17, 99], 11)
        assert calls == {"glu": 4, "silu_mul": 4}
    assert on.shape == (4, 128) and torch.isfinite(on.float()).all()
    assert torch.equal(on, off)
