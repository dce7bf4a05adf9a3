"""The fused layer kernels (``executor.kernels``) on CPU under Triton's interpreter.

Each kernel against the torch ops it replaces (``TORCH_OPS``, the HF-parity path) on
random inputs at small shapes, fp16 and fp32 (the interpreter's bf16 is unreliable); the
custom-op registrations (schema, fake impls) and a Dynamo trace through them; and whole
tiny models of every architecture, fused path vs torch path. Skipped on CUDA machines,
where ``tests/executor/kernels/test_kernels_gpu.py`` runs the compiled kernels instead.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: the gpu tests cover the compiled kernels",
                allow_module_level=True)
# Triton decides at import time whether tl.sum & co. are interpreted, so TRITON_INTERPRET
# must be set before the first ``import triton`` (see
# tests/executor/attention/test_triton_interpret.py).
if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="triton is not installed")
if type(triton.language.sum).__name__ != "InterpretedFunction":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (set it in the "
                "environment or run this file in its own process)", allow_module_level=True)

from executor import kernels  # noqa: E402
from executor.api import Phase  # noqa: E402
from executor.config import CacheConfig, ExecutorConfig, ModelConfig  # noqa: E402
from executor.executor import Executor  # noqa: E402
from executor.kernels.switches import KernelSwitches  # noqa: E402
from executor.model.layers import TORCH_OPS, TRITON_OPS, KernelChoice, select_ops  # noqa: E402
from tests.helpers.models import ARCHS  # noqa: E402

DTYPES = [torch.float16, torch.float32]
EPS = 1e-6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype)


def _norm_weight(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (1.0 + 0.2 * torch.randn(n, generator=_gen(seed))).to(dtype)


def _tables(max_pos: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (1000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # (max_pos, head_dim), like RotaryEmbedding
    return emb.cos(), emb.sin()


def _qk(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as strided views of one fused QKV output, like the model passes them."""
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)


# -- norms -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "n"), [(1, 64), (5, 96), (3, 1000)])
def test_rms_norm(dtype: torch.dtype, rows: int, n: int) -> None:
    wide = _randn(rows, n + 8, dtype=dtype, seed=1, scale=3.0)
    x = wide[:, 4 : 4 + n]  # strided rows
    w = _norm_weight(n, dtype, seed=2)
    got = kernels.rms_norm(x, w, EPS)
    assert got.shape == (rows, n) and got.dtype == dtype
    torch.testing.assert_close(got, TORCH_OPS.rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "n"), [(1, 64), (7, 96)])
def test_add_rms_norm(dtype: torch.dtype, rows: int, n: int) -> None:
    x = _randn(rows, n, dtype=dtype, seed=3)
    res = _randn(rows, n, dtype=dtype, seed=4, scale=4.0)
    x_before, res_before = x.clone(), res.clone()
    w = _norm_weight(n, dtype, seed=5)
    out, new_res = kernels.add_rms_norm(x, res, w, EPS)
    ref_out, ref_res = TORCH_OPS.add_rms_norm(x, res, w, EPS)
    assert torch.equal(new_res, ref_res), "the residual sum must round exactly like torch"
    torch.testing.assert_close(out, ref_out)
    assert torch.equal(x, x_before) and torch.equal(res, res_before), "inputs were written"


# -- RoPE --------------------------------------------------------------------------------
ROPE_SHAPES = [(4, 2, 16), (6, 2, 20), (3, 3, 64), (8, 1, 32)]  # heads, kv_heads, head_dim


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), ROPE_SHAPES)
def test_rope_exact(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    """Without q/k norm the kernel rounds op for op like torch: bit-identical."""
    q, k = _qk(5, heads, kv_heads, head_dim, dtype, seed=6)
    cos, sin = _tables(40, head_dim)
    pos = torch.tensor([0, 39, 7, 1, 7])
    got_q, got_k = kernels.rope_qk(q, k, pos, cos, sin)
    ref_q, ref_k = TORCH_OPS.rope(pos, q, k, cos, sin, None, None, 0.0)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), ROPE_SHAPES[:3])
def test_rope_with_qk_norm(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
                           ) -> None:
    q, k = _qk(4, heads, kv_heads, head_dim, dtype, seed=7)
    cos, sin = _tables(16, head_dim)
    pos = torch.tensor([3, 0, 15, 9])
    qw, kw = _norm_weight(head_dim, dtype, seed=8), _norm_weight(head_dim, dtype, seed=9)
    got = kernels.rope_qk(q, k, pos, cos, sin, qw, kw, EPS)
    ref = TORCH_OPS.rope(pos, q, k, cos, sin, qw, kw, EPS)
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("offset_norm", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(6, 2, 16), (5, 3, 8)])
def test_rope_head_blocks_do_not_change_results(offset_norm: bool, heads: int, kv_heads: int,
                                                head_dim: int) -> None:
    """Programs over (token, head block): every split gives the one-block result bit for
    bit (with the per-head norms too), on strided views of a fused QKV row."""
    from executor.kernels import rope

    assert rope.heads_per_program(1, 32, 4) == 1 and rope.heads_per_program(2048, 32, 4) == 32
    qkv = _qk(3, heads + kv_heads, 1, head_dim, torch.float16, seed=10)[0]
    q, k = qkv[:, :heads], qkv[:, heads:]
    cos, sin = _tables(8, head_dim)
    pos = torch.tensor([7, 0, 3])
    qw, kw = _norm_weight(head_dim, torch.float16, 11), _norm_weight(head_dim, torch.float16, 12)
    whole = rope._launch(q, k, pos, cos, sin, qw, kw, EPS, offset_norm, head_block=8)
    for block in (1, 2, 4):
        got = rope._launch(q, k, pos, cos, sin, qw, kw, EPS, offset_norm, head_block=block)
        assert torch.equal(got[0], whole[0]) and torch.equal(got[1], whole[1]), block


# -- activation --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "n"), [(1, 64), (3, 1500)])  # 1500: 2 programs, masked
def test_silu_and_mul(dtype: torch.dtype, rows: int, n: int) -> None:
    gate_up = _randn(rows, 2 * n, dtype=dtype, seed=10, scale=3.0)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), TORCH_OPS.silu_and_mul(gate_up))


# -- skinny GEMM -------------------------------------------------------------------------
# M, N, K: one to four rows; N and K leave masked columns and a masked last K chunk for
# the tiles tried (N = 34 masks 4- and 16-column blocks; a larger N adds only programs).
SKINNY_SHAPES = [(1, 64, 64), (2, 96, 40), (3, 24, 200), (4, 34, 72)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "n", "k"), SKINNY_SHAPES)
@pytest.mark.parametrize("silu_mul", [False, True])
def test_skinny_gemm(dtype: torch.dtype, m: int, n: int, k: int, silu_mul: bool) -> None:
    """Against the float32 product of the same (rounded) inputs: one rounding of a float32
    sum, so within an ulp of the dtype; the SiLU-and-mul input rounds like the kernel's."""
    from executor.kernels.skinny import Tile, skinny_gemm

    x = _randn(m, 2 * k if silu_mul else k, dtype=dtype, seed=13, scale=2.0)
    w = _randn(n, k, dtype=dtype, seed=14, scale=k**-0.5)
    a = kernels.silu_and_mul(x) if silu_mul else x
    ref = (a.float() @ w.float().T).to(dtype)
    for tile in (None, Tile(2, 32), Tile(16, 64)):  # masked columns and K chunks
        got = skinny_gemm(x, w, silu_mul=silu_mul, tile=tile)
        assert got.shape == (m, n) and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-3
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "n", "k"), SKINNY_SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_skinny_norm_gemm(dtype: torch.dtype, m: int, n: int, k: int, with_residual: bool
                          ) -> None:
    """The fused norm rounds like the norm kernels: its new residual is bit-identical and
    the product is within an ulp of the float32 product of the norm kernel's output."""
    from executor.kernels.skinny import Tile, skinny_norm_gemm

    x = _randn(m, k, dtype=dtype, seed=18, scale=2.0)
    res = _randn(m, k, dtype=dtype, seed=19, scale=3.0) if with_residual else None
    nw = _norm_weight(k, dtype, seed=20)
    w = _randn(n, k, dtype=dtype, seed=21, scale=k**-0.5)
    x_before = x.clone()
    if res is None:
        normed, ref_res = kernels.rms_norm(x, nw, EPS), None
    else:
        normed, ref_res = kernels.add_rms_norm(x, res, nw, EPS)
    ref = (normed.float() @ w.float().T).to(dtype)
    for tile in (None, Tile(2, 32), Tile(16, 64)):
        got, got_res = skinny_norm_gemm(x, res, nw, EPS, w, tile=tile)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
        if ref_res is None:
            assert got_res is None
        else:
            assert got_res is not None and torch.equal(got_res, ref_res)
    assert torch.equal(x, x_before), "the input was written"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "n", "k"), SKINNY_SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_skinny_norm_gemm_one_pass(dtype: torch.dtype, m: int, n: int, k: int,
                                   with_residual: bool) -> None:
    """One-pass tiles apply the norm's scale after the product: within an ulp of the
    float32 norm-and-product of the (rounded) residual sum, which no intermediate rounds;
    the new residual is the norm kernel's, bit for bit, over several K chunks too. A
    scale applied per chunk, or a sum of squares missing a chunk, fails the bound."""
    from executor.kernels.skinny import Tile, skinny_norm_gemm

    x = _randn(m, k, dtype=dtype, seed=22, scale=2.0)
    res = _randn(m, k, dtype=dtype, seed=23, scale=3.0) if with_residual else None
    nw = _norm_weight(k, dtype, seed=24)
    w = _randn(n, k, dtype=dtype, seed=25, scale=k**-0.5)
    s = x if res is None else kernels.add_rms_norm(x, res, nw, EPS)[1]
    s32 = s.float()
    normed32 = s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + EPS) * nw.float()
    ref32 = normed32 @ w.float().T
    ulp = 2.0**-23 if dtype == torch.float32 else 2.0**-10
    for tile in (Tile(2, 32, one_pass=True), Tile(16, 64, num_stages=2, one_pass=True),
                 Tile(4, 4096, one_pass=True)):
        got, got_res = skinny_norm_gemm(x, res, nw, EPS, w, tile=tile)
        err = (got.float() - ref32).abs()
        assert (err <= 2 * ulp * ref32.abs() + 1e-4).all(), (tile, err.max())
        if res is None:
            assert got_res is None
        else:
            assert got_res is not None and torch.equal(got_res, s)


# (N, K) with row tiles whose programs loop over several column blocks, a last block
# past N (masked columns) and a row shorter than its power-of-two block (masked K).
ROW_CASES = [(37, 48, (4, 4, 2)), (64, 96, (2, 4, 3)), (10, 33, (8, 4, 1))]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "k", "tile"), ROW_CASES)
@pytest.mark.parametrize("prologue", ["plain", "silu_mul", "norm", "add_norm"])
def test_skinny_row_kernel(dtype: torch.dtype, n: int, k: int, tile: tuple[int, int, int],
                           prologue: str) -> None:
    """The persistent one-row kernel (``RowTile``) with each prologue: within an ulp of
    the float32 product of what the unfused kernels compute first (SiLU-and-mul, the norm
    kernel's rounded output), the new residual the norm kernel's bit for bit, and as close
    to the classic kernel as the classic kernel is to the reference."""
    from executor.kernels.skinny import RowTile, Tile, skinny_gemm, skinny_norm_gemm

    x = _randn(1, 2 * k if prologue == "silu_mul" else k, dtype=dtype, seed=40, scale=2.0)
    w = _randn(n, k, dtype=dtype, seed=41, scale=k**-0.5)
    res = _randn(1, k, dtype=dtype, seed=42, scale=3.0) if prologue == "add_norm" else None
    nw = _norm_weight(k, dtype, seed=43)
    ref_res = None
    if prologue == "plain":
        a = x
    elif prologue == "silu_mul":
        a = kernels.silu_and_mul(x)
    elif res is None:
        a = kernels.rms_norm(x, nw, EPS)
    else:
        a, ref_res = kernels.add_rms_norm(x, res, nw, EPS)
    ref32 = a.float() @ w.float().T
    ulp = 2.0**-23 if dtype == torch.float32 else 2.0**-10
    outs = []
    for t in (RowTile(*tile), Tile(16, 64)):
        if prologue in ("plain", "silu_mul"):
            got, got_res = skinny_gemm(x, w, silu_mul=prologue == "silu_mul", tile=t), None
        else:
            got, got_res = skinny_norm_gemm(x, res, nw, EPS, w, tile=t)
        assert got.shape == (1, n) and got.dtype == dtype
        err = (got.float() - ref32).abs()
        assert (err <= 2 * ulp * ref32.abs() + 1e-4).all(), (t, err.max())
        assert (got_res is None) == (ref_res is None)
        assert ref_res is None or torch.equal(got_res, ref_res)
        outs.append(got.float())
    assert ((outs[0] - outs[1]).abs() <= 4 * ulp * ref32.abs() + 1e-4).all()


def test_row_kernel_takes_one_stored_or_sent_row_within_its_k_range(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the row kernel serves one-row launches storing their output or sending
    it into the push all-reduce (SEND) with ``K`` in ``ROW_KERNEL_K``; more rows, other
    ``K`` keep the classic kernel. A default launch in range runs it (and is right)."""
    from executor.kernels import skinny as sg
    from executor.kernels.skinny import ops

    lo, hi = sg.ROW_KERNEL_K
    least = sg.ROW_KERNEL_MIN_BLOCKS
    plain = sg.ROW_KERNEL_MIN_BLOCKS_PLAIN
    assert sg.row_tile(sg.SILU_MUL, 1, 64, lo, sms=2) == sg.RowTile(2, 8, 2)
    assert sg.row_tile(sg.ADD_RMS_NORM, 1, 64, lo, sms=2) == sg.RowTile(4, 8, 4)
    assert sg.row_tile(sg.PLAIN, 1, 64, hi, sms=2) == sg.RowTile(2, 8, 4)
    # too few column blocks for the grid: 32 blocks of two, 4 programs on each of 132 SMs
    assert sg.row_tile(sg.PLAIN, 1, 64, hi, sms=132) is None
    assert sg.row_tile(sg.PLAIN, 1, 2 * 4 * 132 * plain, hi, sms=132) == sg.RowTile(2, 8, 4)
    assert sg.row_tile(sg.PLAIN, 1, 2 * 4 * 132 * plain - 2, hi, sms=132) is None
    # an input op needs more blocks a program: Qwen3-30B-A3B's o_proj (2048 x 4096) takes
    # the row kernel, the 1B's qkv (3072 x 2048) with its norm does not
    assert plain < least
    assert sg.row_tile(sg.PLAIN, 1, 2048, 4096, sms=132) == sg.RowTile(2, 8, 4)
    assert sg.row_tile(sg.ADD_RMS_NORM, 1, 3072, 2048, sms=132) is None
    assert sg.row_tile(sg.ADD_RMS_NORM, 1, 4 * 4 * 132 * least, lo, sms=132) == \
        sg.RowTile(4, 8, 4)
    assert sg.row_tile(sg.ADD_RMS_NORM, 1, 4 * 4 * 132 * least - 4, lo, sms=132) is None
    assert sg.row_tile(sg.SILU_MUL, 1, 64, lo, sg.SEND, sms=2) == sg.RowTile(2, 8, 2)
    assert sg.row_tile(sg.PLAIN, 1, 64, hi, sg.SEND, sms=132) is None  # too few blocks
    for m, k, reduce in ((2, lo, sg.NO_REDUCE), (1, lo - 1, sg.NO_REDUCE),
                         (1, hi + 1, sg.NO_REDUCE), (2, lo, sg.SEND), (1, hi + 1, sg.SEND)):
        assert sg.row_tile(sg.PLAIN, m, 64, k, reduce, sms=2) is None
    launched: list[sg.RowTile] = []
    real = ops._launch_row
    monkeypatch.setattr(ops, "_launch_row", lambda *a: launched.append(a[8]) or real(*a))
    x = _randn(1, lo, dtype=torch.float32, seed=44)
    w = _randn(4 * 4 * 2 * least, lo, dtype=torch.float32, seed=45, scale=lo**-0.5)
    torch.testing.assert_close(sg.skinny_gemm(x, w), x @ w.T, atol=1e-5, rtol=1e-5)
    assert launched == [sg.RowTile(4, 8, 4)]
    sg.skinny_gemm(torch.cat([x, x]), w)  # two rows: the classic kernel
    sg.skinny_gemm(x, w[:4 * 4 * 2 * plain - 4])  # a block too few: the classic kernel
    assert len(launched) == 1
    with KernelSwitches(row_kernel=False):  # an executor's --skinny-row-kernel off
        assert sg.row_tile(sg.PLAIN, 1, 64, lo, sms=2) is None
        torch.testing.assert_close(sg.skinny_gemm(x, w), x @ w.T, atol=1e-5, rtol=1e-5)
        assert len(launched) == 1


def test_logits_into_streams_one_row_through_the_row_kernel_into_the_buffer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The LM head (``logits_into``): one row whose shape the row kernel's default rule
    takes runs there, writing the caller's rows of a buffer and nothing else; two rows,
    a shape the rule leaves, or the row kernel switched off take cuBLAS's mm into the same
    rows; without a buffer, a new tensor."""
    from executor.kernels.skinny import ops

    lo = kernels.skinny.ROW_KERNEL_K[0]
    launched: list[Any] = []
    real = ops._launch_row
    monkeypatch.setattr(ops, "_launch_row", lambda *a: launched.append(a[8]) or real(*a))
    w = _randn(64, lo, dtype=torch.float32, seed=46, scale=lo**-0.5)
    x = _randn(2, lo, dtype=torch.float32, seed=47)
    ref = x @ w.T
    head, short = torch.nn.Linear(lo, 64, bias=False), torch.nn.Linear(lo - 1, 64, bias=False)
    head.weight.data, short.weight.data = w, w[:, :lo - 1].contiguous()
    head.requires_grad_(False), short.requires_grad_(False)  # as a served model's
    buf = torch.full((3, 64), 7.0)
    got = kernels.logits_into(head, x[:1], buf[:1])
    assert launched == [kernels.skinny.RowTile(4, 8, 4)]
    assert got.data_ptr() == buf.data_ptr() and got.shape == (1, 64)
    torch.testing.assert_close(buf[:1], ref[:1], atol=1e-5, rtol=1e-5)
    assert (buf[1:] == 7.0).all()
    torch.testing.assert_close(kernels.logits_into(head, x[:1], None), ref[:1], atol=1e-5,
                               rtol=1e-5)
    assert len(launched) == 2
    buf.fill_(7.0)
    kernels.logits_into(head, x, buf[:2])  # two rows: cuBLAS
    kernels.logits_into(short, x[:1, :lo - 1], buf[2:])  # K below the rule's range
    with KernelSwitches(row_kernel=False):
        kernels.logits_into(head, x[:1], buf[:1])
    assert len(launched) == 2
    torch.testing.assert_close(buf[:2], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(buf[2:], x[:1, :lo - 1] @ w[:, :lo - 1].T, atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_token_embedding_copies_the_rows_bit_for_bit(dtype: torch.dtype) -> None:
    """The whole-table lookup returns ``weight[ids]`` exactly, repeated ids included."""
    w = _randn(50, 96, dtype=dtype, seed=48)
    ids = torch.tensor([3, 0, 49, 3, 17])
    got = kernels.token_embedding(ids, w)
    assert got.dtype == dtype and torch.equal(got, w[ids])
    assert kernels.token_embedding(ids[:0], w).shape == (0, 96)


@pytest.mark.parametrize("resident", [None, 4, 3, 1, 9])
@pytest.mark.parametrize(("blocks", "sms"), [(768, 132), (1024, 132), (4096, 132),
                                              (1001, 132), (529, 132), (7, 2), (8, 2), (9, 2)])
def test_row_kernel_grid_takes_its_blocks_in_the_fewest_rounds_evenly(
        blocks: int, sms: int, resident: int | None) -> None:
    """The row kernel's grid: no more programs than a full grid (the tile's 4 programs per
    SM, or fewer where fewer are resident), no more rounds of blocks than a full grid
    needs, and fewer than a round's count of programs one block short."""
    from executor.kernels.skinny import RowTile, row_programs

    tile = RowTile(4, 8, 4)
    full = min(4, resident or 4) * sms
    programs = row_programs(tile, 4 * blocks, sms, resident)
    rounds = -(-blocks // programs)
    assert programs <= full and rounds == -(-blocks // min(full, blocks))
    # program p takes blocks p, p + programs, ...: all take `rounds` but the last few
    taken = [len(range(p, blocks, programs)) for p in range(programs)]
    assert sum(taken) == blocks and set(taken) <= {rounds, rounds - 1}
    assert taken.count(rounds - 1) < rounds
    if blocks == 768 and resident in (None, 4, 9):
        assert programs == 384  # the 1B qkv's 768 blocks: two each, not 240 of two


@pytest.mark.parametrize(("n_regs", "warps", "shared", "fit"), [
    (64, 8, 1024, 4),  # the 8B's TP = 2 gate_up on an H200: 4 x 8 warps x 64 = the file
    (65, 8, 1024, 3),  # one register more: 72 allocated a thread, 3 programs
    (78, 8, 1024, 3),  # the receiving variant of that kernel
    (128, 8, 0, 2),  # down_proj's SiLU-and-mul prologue
    (255, 8, 0, 1),  # a kernel that spills: still one program
    (16, 1, 0, 32),  # tiny programs: the SM's 32-program cap (warps would allow 64)
    (32, 4, 100 * 1024, 2),  # shared memory: 228 KiB over 101 KiB a program
])
def test_resident_programs_are_the_fewest_registers_warps_and_shared_memory_allow(
        n_regs: int, warps: int, shared: int, fit: int) -> None:
    """What an H100/H200 SM holds at once (64 Ki registers allocated 256 to a warp, 64 warps,
    228 KiB shared with 1 KiB reserved a program, 32 programs); the row kernel's grid uses
    it where the tile asks for more."""
    from executor.kernels.skinny import resident_programs

    assert resident_programs(n_regs, warps, shared, max_warps=64,
                             shared_per_sm=228 * 1024) == fit


def test_tuned_tiles_are_read_from_the_tiles_file(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from executor.kernels import skinny as sg
    from executor.kernels.skinny import tiles

    path = tmp_path / "tiles.json"
    path.write_text('{"tiles": [{"prologue": 3, "n": 96, "k": 40, "tile": [8, 64, 4]},'
                    ' {"prologue": 0, "n": 96, "k": 40, "tile": [4, 32, 8]},'
                    ' {"prologue": 0, "n": 64, "k": 40, "tile": [2, 64, 4], "device": "A"},'
                    ' {"prologue": 0, "n": 64, "k": 40, "tile": [8, 32, 4, 4, true],'
                    ' "device": "B"}]}')
    monkeypatch.setattr(tiles, "TILES_FILE", path)
    monkeypatch.setattr(tiles, "_TUNED", None)
    # by device: its own tile, else the first GPU's the file names
    assert sg.pick_tile(sg.PLAIN, 1, 64, 40, "B") == sg.Tile(8, 32, 4, 4, True)
    assert sg.pick_tile(sg.PLAIN, 1, 64, 40, "A") == sg.Tile(2, 64, 4)
    assert sg.pick_tile(sg.PLAIN, 1, 64, 40, "C") == sg.Tile(2, 64, 4)
    assert sg.pick_tile(sg.ADD_RMS_NORM, 1, 96, 40) == sg.Tile(8, 64, 4)
    assert sg.pick_tile(sg.RMS_NORM, 1, 96, 40) == sg.Tile(8, 64, 4)  # its add-norm twin's
    assert sg.pick_tile(sg.PLAIN, 1, 96, 40) == sg.Tile(4, 32, 8)
    assert sg.pick_tile(sg.PLAIN, 2, 96, 40) == sg.default_tile(2, 96, 40)  # tuned at M = 1
    assert sg.pick_tile(sg.SILU_MUL, 1, 96, 40) == sg.default_tile(1, 96, 40, sg.SILU_MUL)
    x = _randn(1, 40, dtype=torch.float32, seed=22)
    w = _randn(96, 40, dtype=torch.float32, seed=23)
    torch.testing.assert_close(sg.skinny_gemm(x, w), x @ w.T, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(tiles, "TILES_FILE", tmp_path / "absent.json")
    monkeypatch.setattr(tiles, "_TUNED", None)
    assert sg.pick_tile(sg.PLAIN, 1, 96, 40) == sg.default_tile(1, 96, 40)


def test_shapes_whose_sweep_found_cublas_faster_are_left_to_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tuned row whose unfused time (norm or SiLU kernel, then cuBLAS) was at least 5 %
    below the tile's sends that shape, with that input op, at one row, to the unfused path
    (the norm kernels and ``layer``); 3 % below, or two rows, stays with the skinny kernel."""
    from executor.kernels import skinny as sg
    from executor.kernels.skinny import tiles

    # (the package's ``linear`` is the function: the module comes from the import system)
    sg_linear = importlib.import_module("executor.kernels.skinny.linear")

    rows = [{"prologue": p, "n": 48, "k": 32, "tile": [4, 32, 4], "us": 10.0,
             "unfused_us": us} for p, us in ((sg.PLAIN, 9.0), (sg.ADD_RMS_NORM, 9.5),
                                             (sg.SILU_MUL, 9.7))]
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"tiles": rows}))
    monkeypatch.setattr(tiles, "TILES_FILE", path)
    monkeypatch.setattr(tiles, "_TUNED", None)
    calls: list[str] = []
    real_gemm, real_norm_gemm = sg.skinny_gemm, sg.skinny_norm_gemm
    monkeypatch.setattr(sg_linear, "skinny_gemm", lambda *a, **kw: calls.append("gemm")
                        or real_gemm(*a, **kw))
    monkeypatch.setattr(sg_linear, "skinny_norm_gemm", lambda *a, **kw: calls.append("norm_gemm")
                        or real_norm_gemm(*a, **kw))
    dt = torch.float32
    layer = torch.nn.Linear(32, 48, bias=False)
    x, res = _randn(1, 32, dtype=dt, seed=30), _randn(1, 32, dtype=dt, seed=31)
    nw = _norm_weight(32, dt, seed=32)
    with torch.no_grad():
        torch.testing.assert_close(sg.linear(layer, x), layer(x))
        assert calls == []  # PLAIN: 9.0 <= 0.95 * 10
        out, new_res = sg.add_rms_norm_linear(x, res, nw, EPS, layer, kernels.rms_norm,
                                              kernels.add_rms_norm)
        normed, want_res = kernels.add_rms_norm(x, res, nw, EPS)
        torch.testing.assert_close(out, layer(normed))
        assert torch.equal(new_res, want_res) and calls == []  # 9.5 <= 9.5: cuBLAS
        out, new_res = sg.add_rms_norm_linear(x, None, nw, EPS, layer, kernels.rms_norm,
                                              kernels.add_rms_norm)  # its twin's row
        torch.testing.assert_close(out, layer(kernels.rms_norm(x, nw, EPS)))
        assert new_res is x and calls == []
        gate_up = _randn(1, 64, dtype=dt, seed=33)
        torch.testing.assert_close(sg.silu_and_mul_linear(gate_up, layer, kernels.silu_and_mul),
                                   layer(kernels.silu_and_mul(gate_up)), atol=1e-5, rtol=1e-5)
        assert calls == ["gemm"]  # SILU_MUL: 9.7 is within the margin, the kernel keeps it
        sg.linear(layer, _randn(2, 32, dtype=dt, seed=34))  # tuned at one row only
        assert sg.cublas_faster(sg.PLAIN, x, layer.weight)
        assert not sg.cublas_faster(sg.PLAIN, _randn(2, 32, dtype=dt, seed=34), layer.weight)


def test_skinny_linear_serves_only_plain_linears_with_few_rows() -> None:
    from executor.kernels import skinny

    dt = torch.float16
    plain = torch.nn.Linear(32, 48, bias=False).to(dt)
    biased = torch.nn.Linear(32, 48, bias=True).to(dt)
    x = _randn(skinny.MAX_ROWS, 32, dtype=dt, seed=15)
    many = _randn(skinny.MAX_ROWS + 1, 32, dtype=dt, seed=16)
    assert skinny.serves(x, plain) and not skinny.serves(many, plain)
    assert not skinny.serves(x, biased) and not skinny.serves(x.float(), plain)
    for inp, layer in ((x, plain), (many, plain), (x, biased)):
        torch.testing.assert_close(skinny.linear(layer, inp), layer(inp),
                                   atol=2e-3, rtol=2e-3)
    down = torch.nn.Linear(16, 32, bias=False).to(dt)
    gate_up = _randn(2, 32, dtype=dt, seed=17)
    torch.testing.assert_close(
        skinny.silu_and_mul_linear(gate_up, down, kernels.silu_and_mul),
        down(TORCH_OPS.silu_and_mul(gate_up)), atol=2e-3, rtol=2e-3)


# -- argmax ------------------------------------------------------------------------------
@pytest.mark.parametrize(("rows", "cols", "block"), [(1, 1000, 128), (3, 5000, 256), (2, 7, 8),
                                                     (4, 300, 64), (2, 64, 64)])
def test_argmax_rows_is_torch_argmax_first_index_of_the_max(rows: int, cols: int, block: int
                                                           ) -> None:
    from executor.kernels.argmax import argmax_rows

    x = _randn(rows, cols, dtype=torch.float32, seed=11)
    x[:, [cols // 3, cols // 2, cols - 1]] = 10.0  # ties across chunks: the first one wins
    torch.testing.assert_close(argmax_rows(x, block), x.argmax(-1), rtol=0, atol=0)
    few = torch.randint(0, 3, (rows, cols), generator=_gen(12)).float()  # ties everywhere
    torch.testing.assert_close(argmax_rows(few, block), few.argmax(-1), rtol=0, atol=0)
    flat = torch.full((rows, cols), float("-inf"))  # masked lanes must not win a tie
    assert argmax_rows(flat, block).tolist() == [0] * rows
    view = x[:, 1:]  # rows with a stride above their length
    torch.testing.assert_close(argmax_rows(view, block), view.argmax(-1), rtol=0, atol=0)
    # ``store``: the second launch also writes each row's token at its slot, nowhere else.
    table = torch.full((rows + 5,), -1, dtype=torch.int64)
    slots = torch.randperm(rows + 5, generator=_gen(13))[:rows]
    tokens = argmax_rows(x, block, store=(table, slots))
    expect = torch.full((rows + 5,), -1, dtype=torch.int64)
    expect[slots] = x.argmax(-1)
    assert torch.equal(tokens, x.argmax(-1)) and torch.equal(table, expect)
    # ``padding``: rows marked as a bucket's padding (their slot a placeholder: 0 here,
    # another row's) store nothing; the argmax is still every row's
    marks = torch.arange(rows, dtype=torch.int64) * 3
    padded = torch.arange(rows) % 2 == 1
    marks[padded] = 99
    table.fill_(-1)
    pad_slots = torch.where(padded, 0, slots)
    if rows > 1:  # a live row at slot 0 keeps its token
        pad_slots[0] = 0
    tokens = argmax_rows(x, block, store=(table, pad_slots), padding=(marks, 99))
    expect = torch.full((rows + 5,), -1, dtype=torch.int64)
    expect[pad_slots[~padded]] = x.argmax(-1)[~padded]
    assert torch.equal(tokens, x.argmax(-1)) and torch.equal(table, expect)


def test_empty_batches() -> None:
    x = torch.empty(0, 64, dtype=torch.float16)
    w = torch.ones(64, dtype=torch.float16)
    assert kernels.rms_norm(x, w, EPS).shape == (0, 64)
    assert [t.shape for t in kernels.add_rms_norm(x, x, w, EPS)] == [(0, 64), (0, 64)]
    assert kernels.silu_and_mul(x).shape == (0, 32)
    q, k = _qk(0, 4, 2, 16, torch.float16, seed=0)
    cos, sin = _tables(8, 16)
    got_q, got_k = kernels.rope_qk(q, k, torch.empty(0, dtype=torch.int64), cos, sin)
    assert got_q.shape == (0, 4, 16) and got_k.shape == (0, 2, 16)
    from executor.kernels.argmax import argmax_rows

    assert argmax_rows(torch.empty(0, 10)).shape == (0,)


# -- torch.compile: custom ops with fake impls -------------------------------------------
def _op_cases() -> list[tuple[Any, tuple[Any, ...]]]:
    dt = torch.float16
    x, r, w = _randn(3, 32, dtype=dt, seed=1), _randn(3, 32, dtype=dt, seed=2), _norm_weight(
        32, dt, seed=3)
    q, k = _qk(3, 4, 2, 16, dt, seed=4)
    cos, sin = _tables(8, 16)
    pos = torch.tensor([1, 5, 2])
    qw, kw = _norm_weight(16, dt, seed=5), _norm_weight(16, dt, seed=6)
    ops = torch.ops.model_executor
    return [
        (ops.rms_norm.default, (x, w, EPS)),
        (ops.add_rms_norm.default, (x, r, w, EPS)),
        (ops.rope_qk.default, (q, k, pos, cos, sin, None, None, 0.0)),
        (ops.rope_qk.default, (q, k, pos, cos, sin, qw, kw, EPS)),
        (ops.silu_and_mul.default, (_randn(2, 64, dtype=dt, seed=7),)),
    ]


def test_custom_ops_schema_and_fake_impls() -> None:
    for op, args in _op_cases():
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_dynamo_traces_the_fused_ops_as_custom_op_nodes() -> None:
    dt = torch.float16
    h, heads, kv_heads, head_dim = 64, 4, 2, 16
    x, r = _randn(3, h, dtype=dt, seed=1), _randn(3, h, dtype=dt, seed=2)
    w = _norm_weight(h, dt, seed=3)
    qkv = _randn(3, (heads + 2 * kv_heads) * head_dim, dtype=dt, seed=4)
    cos, sin = _tables(8, head_dim)
    pos = torch.tensor([1, 5, 2])

    def block(x: torch.Tensor, r: torch.Tensor, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ops = select_ops("triton", x)
        normed, res = ops.add_rms_norm(x, r, w, EPS)
        first = ops.rms_norm(normed, w, EPS)
        q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], 1)
        q, k = ops.rope(pos, q.view(3, heads, head_dim), k.view(3, kv_heads, head_dim),
                        cos, sin, None, None, 0.0)
        return first, res, q, k, ops.silu_and_mul(torch.cat((normed, res), dim=-1))

    seen: list[str] = []

    def recording(gm: torch.fx.GraphModule, _inputs: list[torch.Tensor]) -> Callable[..., Any]:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=recording, fullgraph=True)
    got, ref = compiled(x, r, qkv), block(x, r, qkv)
    for g, e in zip(got, ref, strict=True):
        assert torch.equal(g, e)
    for name in ("rms_norm", "add_rms_norm", "rope_qk", "silu_and_mul"):
        assert any(s.startswith(f"model_executor.{name}") for s in seen), (name, seen)


def test_dynamo_traces_the_projection_ops_without_guarding_the_token_count() -> None:
    """Under torch.compile the projections stay F.linear (the norm and SiLU kernels their
    custom ops), and one dynamic graph serves every token count above one (Dynamo itself
    specializes sizes 0 and 1: one more graph for a single row)."""
    dt, h, inter = torch.float16, 32, 48
    norm_w = _norm_weight(h, dt, seed=24)
    gate_up = torch.nn.Linear(h, 2 * inter, bias=False).to(dt)
    down = torch.nn.Linear(inter, h, bias=False).to(dt)

    def block(x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ops = select_ops("triton", x)
        gu, res = ops.add_rms_norm_linear(x, r, norm_w, EPS, gate_up)
        return ops.silu_and_mul_linear(gu, down), ops.linear(down, gu[:, :inter]) + res[:, :h]

    graphs: list[int] = []

    def recording(gm: torch.fx.GraphModule, _inputs: list[torch.Tensor]) -> Callable[..., Any]:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=recording, dynamic=True)
    for t in (5, 3, 2, 1):
        x, r = _randn(t, h, dtype=dt, seed=t), _randn(t, h, dtype=dt, seed=t + 1)
        for g, e in zip(compiled(x, r), block(x, r), strict=True):
            torch.testing.assert_close(g, e, atol=2e-3, rtol=2e-3)
        assert len(graphs) == (1 if t > 1 else 2), (t, graphs)


# -- whole tiny models: fused path vs torch path -----------------------------------------
def _step_logits(ex: Executor, phase: Phase, chunks: dict[str, list[int]]) -> torch.Tensor:
    """One packed batch extending each sequence by its chunk: logits of every new token."""
    alloc = ex.kv.allocate([(sid, len(toks)) for sid, toks in chunks.items()])
    batch = ex.build_batch(phase, [t for toks in chunks.values() for t in toks], alloc, [])
    batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens))
    return ex.forward_logits(batch)


def _run(ex: Executor, choice: KernelChoice, tag: str) -> list[torch.Tensor]:
    """A packed prefill of two prompts, then two decode steps: the logits of each batch."""
    ex.model.kernels = choice
    prompts = {f"{tag}a": [3, 17, 99, 4, 250, 8, 41], f"{tag}b": [5, 6, 7]}
    out = [_step_logits(ex, "prefill", prompts)]
    out.append(_step_logits(ex, "decode", {s: [11] for s in prompts}))
    out.append(_step_logits(ex, "decode", {f"{tag}a": [12]}))  # one row: the skinny GEMMs
    ex.release(list(prompts))
    return out


def _counting(fn: Callable[..., Any], name: str, calls: dict[str, int]) -> Callable[..., Any]:
    def wrapper(*args: Any) -> Any:
        calls[name] = calls.get(name, 0) + 1
        return fn(*args)

    return wrapper


@pytest.mark.parametrize("arch", ARCHS)
def test_model_fused_matches_torch_path(arch: str, model_dirs: dict[str, Path],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 logits of the fused path equal the torch path's (seen bit-identical here; the
    tolerance leaves room for float32 sum order)."""
    cfg = ExecutorConfig(model=ModelConfig(source=str(model_dirs[arch]), dtype="float16"),
                         device="cpu",
                         cache=CacheConfig(kv_tokens=256, max_sequences=4, max_context=64))
    ex = Executor(cfg)
    assert ex.model.kernels == "auto"
    assert select_ops("auto", torch.empty(1, dtype=torch.float16)) is TORCH_OPS  # CPU
    assert select_ops("triton", torch.empty(1)) is TRITON_OPS
    ref = _run(ex, "torch", "t")
    calls: dict[str, int] = {}
    for name in kernels.__all__:
        monkeypatch.setattr(kernels, name, _counting(getattr(kernels, name), name, calls))
    got = _run(ex, "triton", "k")
    layers = ex.spec.num_layers
    # Per forward: 2 norms and 1 RoPE and 1 SiLU-and-mul per layer (the first layer's
    # input norm has no residual to add; the final norm adds the last one).
    # Each norm goes with the projection after it (``add_rms_norm_linear``: qkv, gate_up),
    # o through ``linear``, down through ``silu_and_mul_linear``. The one-row decode runs
    # them as skinny GEMMs with the norm or SiLU-and-mul fused in; the prefill and the
    # two-row decode call the separate kernels (counted when called through ``kernels``).
    # The final norm (add_rms_norm) runs once per forward; a qkv projection with a bias
    # (Qwen2) is no plain skinny GEMM, so its input norm stays a norm kernel. Each forward
    # starts with the embedding kernel and ends with the LM head's ``logits_into``.
    bias = ex.spec.features.qkv_bias
    assert calls == {"add_rms_norm_linear": 3 * 2 * layers, "linear": 3 * layers,
                     "silu_and_mul_linear": 3 * layers, "rope_qk": 3 * layers,
                     "silu_and_mul": 2 * layers, "rms_norm": 2 + (1 if bias else 0),
                     "add_rms_norm": 4 * layers + (layers if bias else 1),
                     "token_embedding": 3, "logits_into": 3}, calls
    for g, e in zip(got, ref, strict=True):
        torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("n", "decode"), [(7, True), (300, False), (1, True)])
def test_graph_prologue_kernel_matches_the_torch_ops(n: int, decode: bool) -> None:
    """The prologue's one-launch scatter (``executor.kernels.graph_prologue``) writes what the
    torch ops of ``Prologue.capture`` write: ids (a negative id takes its slot's last
    sampled token), positions, the table cells (padding rows: the scratch cell), and a
    decode batch's three rows into a strided static block; nothing else."""
    from executor.kernels.graph_prologue import graph_prologue

    gen = _gen(n)
    slots_n, context = 6, 64
    cells = slots_n * context
    pad = 2 if n > 2 else 0
    ids = torch.randint(0, 1000, (n,), generator=gen)
    slots = torch.randint(0, slots_n, (n,), generator=gen)
    if decode:
        ids[torch.randperm(n, generator=gen)[: (n + 1) // 2]] = -1  # USE_LAST_SAMPLED
    positions = torch.randint(0, context, (n,), generator=gen)
    # Distinct real cells; padding rows all write the scratch cell (index ``cells``).
    table_index = torch.randperm(cells, generator=gen)[:n]
    table_index[n - pad:] = cells
    locations = torch.randint(1, 5000, (n,), generator=gen)
    locations[n - pad:] = 0
    last = torch.randint(0, 1000, (slots_n,), generator=gen)
    rows = torch.randint(0, 9999, (3, n), generator=gen)
    static_rows = torch.full((3, n + 5), -7, dtype=torch.int64)  # rows :n of a larger block

    def fresh() -> tuple[torch.Tensor, ...]:
        return (torch.full((n + 3,), -5, dtype=torch.int64),
                torch.full((n + 3,), -5, dtype=torch.int64),
                torch.full((cells + 1,), -3, dtype=torch.int32), static_rows.clone())

    ids_ref, pos_ref, table_ref, rows_ref = fresh()
    if decode:
        torch.where(ids >= 0, ids, last[slots], out=ids_ref[:n])
    else:
        ids_ref[:n].copy_(ids)
    pos_ref[:n].copy_(positions)
    table_ref.index_copy_(0, table_index, locations.to(torch.int32))
    if decode:
        rows_ref[:, :n].copy_(rows)

    ids_out, pos_out, table_out, rows_out = fresh()
    graph_prologue(ids, positions, table_index, locations, ids_out[:n], pos_out[:n],
                   table_out, last if decode else None, slots if decode else None,
                   rows if decode else None, rows_out[:, :n] if decode else None)
    assert torch.equal(ids_out, ids_ref) and torch.equal(pos_out, pos_ref)
    assert torch.equal(table_out, table_ref) and torch.equal(rows_out, rows_ref)
    if decode:
        assert (ids_out[:n] >= 0).all()  # every USE_LAST_SAMPLED row was resolved
