"""The fused layer kernels (``executor.kernels``) vs the torch ops on the GPU.

Each kernel against ``TORCH_OPS`` (the HF-parity path it replaces) on fresh random inputs
(never zeros) over several shapes, bf16 and fp16; then whole tiny models of every
architecture, fused path vs torch path, eager with Triton attention. The kernels compile
per dtype and a few constexprs, so the sweeps stay cheap (seconds).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from executor.api import Phase
from executor.config import CacheConfig, DType, ExecutorConfig, ModelConfig
from executor.executor import Executor
from executor.model.layers import (
    TORCH_OPS,
    TRITON_OPS,
    KernelChoice,
    rope_inv_freq,
    select_ops,
)
from executor.model.spec import RopeSpec
from tests.helpers.models import ARCHS

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from executor import kernels  # noqa: E402

DEVICE = torch.device("cuda")
DTYPES = [torch.bfloat16, torch.float16]
EPS = 1e-5


def _randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def _norm_weight(n: int, dtype: torch.dtype) -> torch.Tensor:
    return (1.0 + 0.2 * torch.randn(n, device=DEVICE)).to(dtype)


def _tables(max_pos: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama-3 scaled RoPE tables, as ``RotaryEmbedding`` builds them."""
    rope = RopeSpec(theta=500000.0, rope_type="llama3", factor=32.0)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32, device=DEVICE),
                        rope_inv_freq(rope, head_dim, DEVICE))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _qk(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as strided views of one fused QKV output, like the model passes them."""
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, scale=2.0)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)


# -- norms -------------------------------------------------------------------------------
NORM_SHAPES = [(1, 2048), (7, 4096), (33, 5120), (256, 896), (1000, 64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "n"), NORM_SHAPES)
def test_rms_norm(dtype: torch.dtype, rows: int, n: int) -> None:
    torch.manual_seed(rows + n)
    x = _randn(rows, n, dtype=dtype, scale=3.0)
    w = _norm_weight(n, dtype)
    _assert_close_norm(kernels.rms_norm(x, w, EPS), TORCH_OPS.rms_norm(x, w, EPS))


def _assert_close_norm(got: torch.Tensor, ref: torch.Tensor) -> None:
    """The float32 sum order differs from torch's, so ``x * rstd`` can round one ulp apart
    (seen: 1 element in 64000, fp16), and the weight multiply's rounding can make it two."""
    eps = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got, ref, atol=eps, rtol=3 * eps)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "n"), NORM_SHAPES)
def test_add_rms_norm(dtype: torch.dtype, rows: int, n: int) -> None:
    torch.manual_seed(rows * n)
    x, res = _randn(rows, n, dtype=dtype), _randn(rows, n, dtype=dtype, scale=5.0)
    x_before, res_before = x.clone(), res.clone()
    w = _norm_weight(n, dtype)
    out, new_res = kernels.add_rms_norm(x, res, w, EPS)
    ref_out, ref_res = TORCH_OPS.add_rms_norm(x, res, w, EPS)
    assert torch.equal(new_res, ref_res), "the residual sum must round exactly like torch"
    _assert_close_norm(out, ref_out)
    assert torch.equal(x, x_before) and torch.equal(res, res_before), "inputs were written"


# -- RoPE --------------------------------------------------------------------------------
# (heads, kv_heads, head_dim): Llama-3.2-1B, Llama-3-8B, Qwen2-7B, GQA 1, odd half-dim,
# SmolLM2-135M (9 query and 3 KV heads).
ROPE_SHAPES = [(32, 8, 64), (32, 8, 128), (28, 4, 128), (16, 16, 64), (12, 4, 80),
               (9, 3, 64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), ROPE_SHAPES)
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rope(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, tokens: int
              ) -> None:
    torch.manual_seed(tokens + heads + head_dim)
    q, k = _qk(tokens, heads, kv_heads, head_dim, dtype)
    cos, sin = _tables(8192, head_dim)
    pos = torch.randint(0, 8192, (tokens,), device=DEVICE)
    got_q, got_k = kernels.rope_qk(q, k, pos, cos, sin)
    ref_q, ref_k = TORCH_OPS.rope(pos, q, k, cos, sin, None, None, 0.0)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    # Op for op the same roundings as torch, and no FMA contraction (rope.LAUNCH_OPTIONS):
    # bit-identical (with contraction on, about 20% of elements differed, on an H200).
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)


def _assert_close_terms(got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> None:
    """Close to within two ulps of the *terms* (``x * cos``, ``rotate_half(x) * sin``), not
    of the result: where the two terms cancel, one ulp of a term is far more than one ulp
    of the result. Prints how many elements differ at all (seen: under 0.004%)."""
    eps = torch.finfo(got.dtype).eps
    scale = x.float().abs().amax().item()
    torch.testing.assert_close(got, ref, atol=2 * eps * scale, rtol=2 * eps)
    print(f"rope {tuple(got.shape)} {got.dtype}: "
          f"{(got != ref).float().mean().item():.4%} of elements differ from torch")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(16, 8, 128), (32, 4, 64)])
@pytest.mark.parametrize("tokens", [1, 65])
def test_rope_with_qk_norm(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                           tokens: int) -> None:
    torch.manual_seed(tokens * heads)
    q, k = _qk(tokens, heads, kv_heads, head_dim, dtype)
    cos, sin = _tables(4096, head_dim)
    pos = torch.randint(0, 4096, (tokens,), device=DEVICE)
    qw, kw = _norm_weight(head_dim, dtype), _norm_weight(head_dim, dtype)
    got = kernels.rope_qk(q, k, pos, cos, sin, qw, kw, 1e-6)
    ref = TORCH_OPS.rope(pos, q, k, cos, sin, qw, kw, 1e-6)
    for g, e in zip(got, ref, strict=True):
        _assert_close_terms(g, e, e)  # normed heads: terms of the output's own magnitude


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 4, 128), (16, 8, 128),
                                                             (9, 3, 64)])
@pytest.mark.parametrize("tokens", [1, 4, 65])
def test_rope_head_blocks_bit_identical(dtype: torch.dtype, heads: int, kv_heads: int,
                                        head_dim: int, tokens: int) -> None:
    """Decode splits the heads over programs (``rope.heads_per_program``): bit-identical
    to one program per token holding every head, with the q/k norms."""
    from executor.kernels import rope

    torch.manual_seed(tokens + heads)
    q, k = _qk(tokens, heads, kv_heads, head_dim, dtype)
    cos, sin = _tables(4096, head_dim)
    pos = torch.randint(0, 4096, (tokens,), device=DEVICE)
    qw, kw = _norm_weight(head_dim, dtype), _norm_weight(head_dim, dtype)
    whole = rope._launch(q, k, pos, cos, sin, qw, kw, 1e-6, head_block=64)
    for block in (None, 1, 4):
        got = rope._launch(q, k, pos, cos, sin, qw, kw, 1e-6, head_block=block)
        assert torch.equal(got[0], whole[0]) and torch.equal(got[1], whole[1]), block


# -- activation --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "n"), [(1, 8192), (5, 14336), (64, 11008), (300, 896)])
def test_silu_and_mul(dtype: torch.dtype, rows: int, n: int) -> None:
    torch.manual_seed(rows + n)
    gate_up = _randn(rows, 2 * n, dtype=dtype, scale=3.0)
    got, ref = kernels.silu_and_mul(gate_up), TORCH_OPS.silu_and_mul(gate_up)
    # tl.exp is not torch's expf: SiLU may round one ulp apart, then the product with
    # ``up`` (up to ~15) turns that into a few ulps of the result.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got, ref, atol=2 * eps, rtol=4 * eps)
    print(f"silu_and_mul {tuple(got.shape)} {dtype}: "
          f"{(got != ref).float().mean().item():.4%} of elements differ from torch")


@pytest.mark.parametrize(("rows", "cols"), [(1, 128256), (8, 151936), (64, 32000), (3, 5)])
def test_argmax_rows_equals_torch_argmax(rows: int, cols: int) -> None:
    from executor.api import SamplingParams
    from executor.sampling import Sampler, argmax_rows

    g = torch.Generator(device=DEVICE).manual_seed(rows)
    x = torch.randn(rows, cols, generator=g, device=DEVICE)
    top = x.max() + 1
    x[:, cols // 2] = top  # a tie across chunks: the first index wins, as in torch
    x[:, cols - 1] = top
    x[0, cols // 3] = top
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    greedy = Sampler()(x, [SamplingParams()] * rows, [0] * rows)
    assert greedy.token_ids == x.argmax(-1).tolist()


# -- skinny GEMM (decode projections) ----------------------------------------------------
# (in, out) of the projections of SmolLM2-135M (hidden 576, 9/3 heads), Llama-3.2-1B and
# Llama-3.1-8B (qkv, o, gate_up, down), and odd sizes (masked columns and K chunks).
SKINNY_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576),
                 (2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048),
                 (4096, 6144), (14336, 4096), (1000, 77), (200, 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("k", "n"), SKINNY_SHAPES)
@pytest.mark.parametrize("silu_mul", [False, True])
def test_skinny_gemm(dtype: torch.dtype, k: int, n: int, silu_mul: bool) -> None:
    """Against the float32 product of the same inputs (SiLU-and-mul by the unfused kernel):
    one rounding of a float32 sum, so at most about an ulp of the dtype apart; and
    against cuBLAS (``F.linear``), which rounds the same sum in another order."""
    from executor.kernels.skinny import skinny_gemm

    for m in (1, 3):  # the model uses M = 1 (MAX_ROWS); 3 covers the kernel's row blocks
        x = _randn(m, 2 * k if silu_mul else k, dtype=dtype, scale=2.0)
        w = _randn(n, k, dtype=dtype, scale=k**-0.5)
        a = kernels.silu_and_mul(x) if silu_mul else x
        ref32 = a.float() @ w.float().T
        got = skinny_gemm(x, w, silu_mul=silu_mul)
        assert got.shape == (m, n) and got.dtype == dtype and not got.isnan().any()
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
        err = (got.float() - ref32).abs()
        assert (err <= ulp * ref32.abs() + 1e-3).all(), err.max()
        torch.testing.assert_close(got, torch.nn.functional.linear(a, w),
                                   atol=2e-3, rtol=2 * ulp)
        assert torch.equal(skinny_gemm(x, w, silu_mul=silu_mul), got)  # deterministic


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("k", "n"), SKINNY_SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_skinny_norm_gemm(dtype: torch.dtype, k: int, n: int, with_residual: bool) -> None:
    """The fused norm against the norm kernels: the new residual bit-identical, the product
    within about an ulp of the float32 product of the norm kernel's output."""
    from executor.kernels.skinny import (
        ADD_RMS_NORM,
        device_name,
        pick_tile,
        row_tile,
        skinny_norm_gemm,
        sm_count,
    )

    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    for m in (1, 3):
        # (the row kernel, where it serves, rounds the norm like the two-pass tiles)
        cuda = torch.device("cuda")
        one_pass = row_tile(ADD_RMS_NORM, m, n, k, sms=sm_count(cuda)) is None and pick_tile(
            ADD_RMS_NORM, m, n, k, device_name(cuda)).one_pass
        x = _randn(m, k, dtype=dtype, scale=2.0)
        res = _randn(m, k, dtype=dtype, scale=3.0) if with_residual else None
        nw, w = _norm_weight(k, dtype), _randn(n, k, dtype=dtype, scale=k**-0.5)
        x_before = x.clone()
        if res is None:
            normed, ref_res = kernels.rms_norm(x, nw, EPS), None
        else:
            normed, ref_res = kernels.add_rms_norm(x, res, nw, EPS)
        # a shape tuned to a one-pass tile: the float32 norm, not the norm kernel's output
        ref32 = (_norm32(x if ref_res is None else ref_res, nw) if one_pass
                 else normed.float()) @ w.float().T
        got, got_res = skinny_norm_gemm(x, res, nw, EPS, w)
        assert got.shape == (m, n) and not got.isnan().any()
        # the norm's float32 sum of squares runs in another order: its rounded output can
        # differ by an ulp in a few elements, hence twice the GEMM's own bound
        err = (got.float() - ref32).abs()
        assert (err <= 2 * ulp * ref32.abs() + 2e-3).all(), err.max()
        if ref_res is None:
            assert got_res is None
        else:
            assert got_res is not None and torch.equal(got_res, ref_res)
        assert torch.equal(x, x_before)


@pytest.mark.parametrize(("k", "n"), SKINNY_SHAPES)
@pytest.mark.parametrize("prologue", ["plain", "silu_mul", "add_norm"])
def test_skinny_row_kernel(k: int, n: int, prologue: str, dtype: torch.dtype = torch.bfloat16
                           ) -> None:
    """The persistent one-row kernel with the tiles ``row_tile`` picks (and a wide and a
    one-program-per-SM one) on the model's shapes and odd ones: within about an ulp of
    the float32 product of the unfused kernels' output (SiLU-and-mul, the norm kernel's),
    the new residual the norm kernel's bit for bit, deterministic, and within two ulps of
    the classic kernel (bfloat16 here; float16 and float32 in the interpreter's test)."""
    from executor.kernels import skinny as sg

    x = _randn(1, 2 * k if prologue == "silu_mul" else k, dtype=dtype, scale=2.0)
    w = _randn(n, k, dtype=dtype, scale=k**-0.5)
    res = _randn(1, k, dtype=dtype, scale=3.0) if prologue == "add_norm" else None
    nw = _norm_weight(k, dtype)
    if prologue == "plain":
        a, ref_res = x, None
    elif prologue == "silu_mul":
        a, ref_res = kernels.silu_and_mul(x), None
    else:
        a, ref_res = kernels.add_rms_norm(x, res, nw, EPS)
    ref32 = a.float() @ w.float().T
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10

    def run(tile: sg.Tile | sg.RowTile) -> tuple[torch.Tensor, torch.Tensor | None]:
        if prologue == "add_norm":
            return sg.skinny_norm_gemm(x, res, nw, EPS, w, tile=tile)
        return sg.skinny_gemm(x, w, silu_mul=prologue == "silu_mul", tile=tile), None

    p = {"plain": sg.PLAIN, "silu_mul": sg.SILU_MUL, "add_norm": sg.ADD_RMS_NORM}[prologue]
    # the classic kernel with this GPU's tile, two-pass (a one-pass tile's product is the
    # float32 norm's, not the rounded norm both kernels otherwise compute)
    classic, _ = run(dataclasses.replace(sg.pick_tile(p, 1, n, k, sg.device_name(x.device)),
                                         one_pass=False))
    tiles = [sg.RowTile(8 if k <= 4096 else 1, 8, 1), sg.RowTile(1, 4, 4)]
    picked = sg.row_tile(p, 1, n, k, sms=sg.sm_count(x.device))
    tiles += [picked] if picked is not None else []
    for tile in tiles:
        got, got_res = run(tile)
        assert got.shape == (1, n) and got.dtype == dtype and not got.isnan().any()
        err = (got.float() - ref32).abs()
        assert (err <= 2 * ulp * ref32.abs() + 2e-3).all(), (tile, err.max())
        assert (got.float() - classic.float()).abs().le(
            2 * ulp * ref32.abs() + 2e-3).all(), tile
        assert ref_res is None or (got_res is not None and torch.equal(got_res, ref_res))
        assert torch.equal(run(tile)[0], got)  # deterministic


@pytest.mark.parametrize(("tile", "k", "n"), [
    ((2, 8, 4), 4096, 14336),  # the 8B's TP = 2 gate_up tile
    ((8, 8, 4), 4096, 4096),  # 8 weight rows of 4096 a program, twice: over 64 registers
])
def test_row_kernel_grid_fits_its_compiled_kernel(tile: tuple[int, int, int], k: int,
                                                  n: int) -> None:
    """The persistent grid asks no more programs of an SM than the compiled kernel fits
    there: this GPU's Triton gives the kernel up for inspection (``FastLauncher.compiled``),
    the grid is ``row_programs`` capped at ``resident_programs`` of its registers and
    shared memory, and a tile that cannot fit its 4 programs per SM (two blocks of 8 rows
    of 4096 in registers) gets fewer, with the product still right."""
    from executor.kernels import skinny as sg
    from executor.kernels.skinny import ops

    row_tile = sg.RowTile(*tile)
    x = _randn(1, k, dtype=torch.bfloat16, scale=2.0)
    w = _randn(n, k, dtype=torch.bfloat16, scale=k**-0.5)
    got = sg.skinny_gemm(x, w, tile=row_tile)
    ref32 = x.float() @ w.float().T
    assert (got.float() - ref32).abs().le(2 * 2.0**-7 * ref32.abs() + 2e-3).all()
    grids = {key[0][1:3]: programs for key, programs in ops._ROW_GRIDS.items()
             if key[0][1:3] == (n, k) and key[0][5] == row_tile.block_n
             and key[0][4] == sg.PLAIN and key[1:3] == (row_tile.programs_per_sm,
                                                        row_tile.num_warps)}
    assert list(grids) == [(n, k)]
    constexprs = {"INPUT_OP": sg.PLAIN, "BLOCK_N": row_tile.block_n, "BLOCK_K": k,
                  "REDUCE": sg.NO_REDUCE, "WORLD": 1}
    args = (x, x, x, w, got, got, n, k, w.stride(0), 1.0 / k, 0.0, x, x, 0, 0)
    kernel = ops._row_launcher(row_tile.num_warps).compiled(args, constexprs)
    assert kernel is not None and kernel.n_regs > 0
    props = torch.cuda.get_device_properties(DEVICE)
    fit = sg.resident_programs(kernel.n_regs, row_tile.num_warps, int(kernel.metadata.shared),
                               max_warps=props.max_threads_per_multi_processor // 32,
                               shared_per_sm=props.shared_memory_per_multiprocessor)
    sms = sg.sm_count(x.device)
    assert grids[(n, k)] == sg.row_programs(row_tile, n, sms, fit) <= fit * sms
    if tile == (8, 8, 4):
        assert fit < row_tile.programs_per_sm, (kernel.n_regs, kernel.n_spills)


def _norm32(s: torch.Tensor, nw: torch.Tensor) -> torch.Tensor:
    """RMSNorm of ``s`` in float32 throughout (no rounding to the activation dtype)."""
    s32 = s.float()
    return s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + EPS) * nw.float()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("k", "n"), SKINNY_SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_skinny_norm_gemm_one_pass(dtype: torch.dtype, k: int, n: int, with_residual: bool
                                   ) -> None:
    """One-pass tiles (the norm's scale applied after the product) against the float32
    norm-and-product of the same residual sum: within an ulp of the dtype; the new
    residual bit-identical to the norm kernel's; deterministic."""
    from executor.kernels.skinny import Tile, skinny_norm_gemm

    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    for m in (1, 3):
        x = _randn(m, k, dtype=dtype, scale=2.0)
        res = _randn(m, k, dtype=dtype, scale=3.0) if with_residual else None
        nw, w = _norm_weight(k, dtype), _randn(n, k, dtype=dtype, scale=k**-0.5)
        s = x if res is None else kernels.add_rms_norm(x, res, nw, EPS)[1]
        ref32 = _norm32(s, nw) @ w.float().T
        for tile in (Tile(4, 2048, 4, one_pass=True), Tile(16, 256, 4, 4, one_pass=True)):
            got, got_res = skinny_norm_gemm(x, res, nw, EPS, w, tile=tile)
            err = (got.float() - ref32).abs()
            assert (err <= ulp * ref32.abs() + 1e-3).all(), (tile, err.max())
            assert (got_res is None) if res is None else torch.equal(got_res, s)
            assert torch.equal(skinny_norm_gemm(x, res, nw, EPS, w, tile=tile)[0], got)


def test_every_tuned_tile_matches_the_unfused_path() -> None:
    """The tiles of ``skinny/tiles.json`` (a re-tune rewrites them) on their own shapes."""
    from executor.kernels import skinny as sg

    dt = torch.bfloat16
    assert sg.tuned_tiles(), "no tuned tiles shipped"
    for (prologue, n, k), device, tile in [(key, device, tile) for key, by_device in
                                            sg.tuned_tiles().items()
                                            for device, tile in by_device.items()]:
        w = _randn(n, k, dtype=dt, scale=k**-0.5)
        if prologue == sg.SILU_MUL:
            g = _randn(1, 2 * k, dtype=dt, scale=2.0)
            got = sg.skinny_gemm(g, w, silu_mul=True, tile=tile)
            ref = kernels.silu_and_mul(g) @ w.T
        elif prologue in (sg.RMS_NORM, sg.ADD_RMS_NORM):
            x, r, nw = _randn(1, k, dtype=dt), _randn(1, k, dtype=dt, scale=3.0), \
                _norm_weight(k, dt)
            got = sg.skinny_norm_gemm(x, r, nw, EPS, w, tile=tile)[0]
            normed, s = kernels.add_rms_norm(x, r, nw, EPS)
            # a one-pass tile's input is the float32 norm, never rounded to bf16
            ref = (_norm32(s, nw) @ w.float().T).to(dt) if tile.one_pass else normed @ w.T
        else:
            x = _randn(1, k, dtype=dt)
            got, ref = sg.skinny_gemm(x, w, tile=tile), x @ w.T
        assert sg.pick_tile(prologue, 1, n, k, device) == tile
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=2**-6, msg=str((prologue, n, k)))


def test_auto_picks_the_kernels_for_half_precision_on_cuda() -> None:
    for dtype in DTYPES:
        assert select_ops("auto", torch.empty(1, dtype=dtype, device=DEVICE)) is TRITON_OPS
    assert select_ops("auto", torch.empty(1, device=DEVICE)) is TORCH_OPS  # float32
    assert select_ops("torch", torch.empty(1, dtype=torch.bfloat16, device=DEVICE)) is TORCH_OPS


def test_compiled_ops_match_eager() -> None:
    """Through AOT autograd (functionalization, the fake impls), as torch.compile runs them."""
    dt, h, heads, kv_heads, head_dim, t = torch.bfloat16, 2048, 32, 8, 64, 5
    x, r, w = _randn(t, h, dtype=dt), _randn(t, h, dtype=dt), _norm_weight(h, dt)
    qkv = _randn(t, (heads + 2 * kv_heads) * head_dim, dtype=dt)
    cos, sin = _tables(1024, head_dim)
    pos = torch.randint(0, 1024, (t,), device=DEVICE)

    def block(x: torch.Tensor, r: torch.Tensor, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ops = select_ops("auto", x)
        normed, res = ops.add_rms_norm(x, r, w, EPS)
        q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], 1)
        q, k = ops.rope(pos, q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim),
                        cos, sin, None, None, 0.0)
        return ops.rms_norm(normed, w, EPS), res, q, k, ops.silu_and_mul(qkv)

    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    for g, e in zip(compiled(x, r, qkv), block(x, r, qkv), strict=True):
        assert torch.equal(g, e)


# -- whole tiny models: fused path vs torch path -----------------------------------------
def _step_logits(ex: Executor, phase: Phase, chunks: dict[str, list[int]]) -> torch.Tensor:
    alloc = ex.kv.allocate([(sid, len(toks)) for sid, toks in chunks.items()])
    batch = ex.build_batch(phase, [t for toks in chunks.values() for t in toks], alloc, [])
    batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens,
                                                                   device=DEVICE))
    return ex.forward_logits(batch)


def _run(ex: Executor, choice: KernelChoice, tag: str) -> list[torch.Tensor]:
    """A packed prefill of three prompts, four decode steps of all three and two of one:
    the logits of each batch."""
    ex.model.kernels = choice
    gen = torch.Generator().manual_seed(0)
    prompts = {f"{tag}{i}": torch.randint(0, 256, (n,), generator=gen).tolist()
               for i, n in enumerate((37, 5, 120))}
    out = [_step_logits(ex, "prefill", prompts)]
    for step in range(4):
        out.append(_step_logits(ex, "decode", {s: [17 + step] for s in prompts}))
    for step in range(2):  # one row: the skinny GEMMs with the norms and SiLU fused in
        out.append(_step_logits(ex, "decode", {f"{tag}0": [30 + step]}))
    ex.release(list(prompts))
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("arch", [*ARCHS, "smollm2-135m-shape"])
def test_model_fused_matches_torch_path(arch: str, dtype: DType, model_dirs: dict[str, Path],
                                        request: pytest.FixtureRequest) -> None:
    """The model with every fused kernel (``auto``) against its torch ops, prefill and
    decode (one row: the skinny GEMMs), on the tiny models of each architecture and on
    SmolLM2-135M's odd shape."""
    path = model_dirs[arch] if arch in model_dirs else request.getfixturevalue("smollm2_shape")
    cfg = ExecutorConfig(model=ModelConfig(source=str(path), dtype=dtype),
                         device="cuda",
                         cache=CacheConfig(kv_tokens=4096, max_sequences=8, max_context=512),
                         attention_backend="triton")
    ex = Executor(cfg)
    assert ex.model.kernels == "auto"
    ref = _run(ex, "torch", "t")
    got = _run(ex, "auto", "k")
    for g, e in zip(got, ref, strict=True):
        assert (g.argmax(-1) == e.argmax(-1)).float().mean() > 0.9
        if arch in model_dirs:
            # Logits of magnitude < 64 in bf16: a few ulps of noise from float32 sum order.
            torch.testing.assert_close(g, e, atol=0.25, rtol=0.02)
        else:
            # 30 random-weight layers: logits spread ~24 (up to ~180); on the CPU bf16
            # against float32 differs by 0.29 at the median, 2.5 at most. Bounds relative
            # to that spread (a wrong head or row would move logits by about the spread).
            diff, spread = (g.float() - e.float()).abs(), e.float().std()
            assert diff.mean() <= 0.05 * spread and diff.max() <= 0.25 * spread, \
                (diff.mean(), diff.max(), spread)
