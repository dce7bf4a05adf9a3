"""FP8 on an FP8 GPU (compute capability 8.9+): the GEMM paths, graphs, and agreement.

* every GEMM path (``gemm.prepare``: w8a16 up to 64 rows, or the FP8 x FP8 kernel or
  cuBLAS FP8 from 8 rows where measured faster; above, ``torch._scaled_mm`` after the
  activation quantization, or w8a16 on the tensor cores for block scales) against float32
  on the values it multiplies, over the 1B, 8B and SmolLM2 projection shapes at 1, 8, 64
  and 2048 rows; at 1 row the persistent row kernel (its fused input ops too, with the
  register prefetch and the pipelined loop); the FP8 x FP8 kernel itself at 8 and 64 rows,
  for several tiles (split-K included, deterministic). Tolerance: ``REL`` of the
  reference's largest value (one bf16 rounding of float32 sums; cuBLAS FP8 sums in its own
  order);
* the norm and SiLU-and-mul that quantize their own output give the unfused path's
  result exactly, through the layer's fused hooks at 8 and 64 rows;
* the gated (GLU) epilogue of the gate_up projections at 1 row (and 4): ``silu_and_mul``
  of the unfused launch bit for bit at tiles of the same reduction (both kernels, row and
  block scales), the layer's hook against float32 and replayed in a CUDA graph, and a
  small FP8 model decoding alike with ``--fp8-glu`` on and off;
* the activation quantization kernel equals ``fp8.quantize_activations`` bit for bit;
* graphs (full decode, breakable prefill) give eager's greedy tokens with FP8 weights,
  and the layers keep FP8 (no dequantized fallback);
* a bf16 checkpoint with ``--quantization fp8`` agrees with its bf16 self on >= 90 % of
  greedy tokens over 8 prompts x 64 steps (the figure is printed).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from executor.api import DecodeItem, PrefillItem, SamplingParams
from executor.config import ModelConfig
from executor.quant import Fp8Linear, gemm, launch, read_scheme
from executor.quant.fp8 import (
    quantize_activations,
    quantize_blocks,
    quantize_rows,
    quantize_tensor,
)
from executor.quant.scheme import AT_LOAD
from executor.quant.tiles import Fp8RowTile, Fp8Tile
from tests.helpers.fp8_models import write_fp8_model
from tests.helpers.gpu import greedy_agrees, make_prefill_executor

pytestmark = pytest.mark.gpu
FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
needs_fp8 = pytest.mark.skipif(not FP8_GPU, reason="needs compute capability 8.9+")
#: |got - ref| <= REL * max|ref|: bf16 output rounding (2^-9 relative) plus summation order
REL = 8e-3
SHAPES = ("llama-3.2-1b", "llama-3.1-8b", "smollm2-135m")
ROWS = (1, 8, 64, 2048)
DEV = torch.device("cuda")


def _scheme(kind: str):  # type: ignore[no-untyped-def]
    return {"block": read_scheme({"quant_method": "fp8", "weight_block_size": [128, 128]},
                                 None),
            "channel": AT_LOAD,
            "tensor": read_scheme({"quant_method": "modelopt", "quant_algo": "FP8"}, None)}[kind]


def _layer(kind: str, k: int, shards: tuple[int, ...]) -> tuple[Fp8Linear, torch.Tensor]:
    """An ``Fp8Linear`` on the GPU of random weights, and its float32 dequantized weight."""
    scheme = _scheme(kind)
    with torch.device("meta"):
        layer = Fp8Linear(k, sum(shards), scheme, shards, None, bias=False)
    layer.to_empty(device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(k + sum(shards))
    with torch.no_grad():
        lo = 0
        for i, rows in enumerate(shards):
            w = torch.randn(rows, k, generator=gen, device=DEV) / (k ** 0.5 * (i + 1))
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
                layer.input_scale[i] = 4.0 / 448
            layer.weight[lo : lo + rows] = q
            lo += rows
    gemm.prepare(layer)  # (per-tensor: shards re-rounded to one scale first)
    return layer, layer.dense_weight(torch.float32)


def _projection_shards(shape: str) -> dict[str, tuple[int, tuple[int, ...]]]:
    from bench.common import shapes

    s = shapes.spec(shape)
    return {"qkv": (s.hidden_size, (s.q_size, s.kv_size, s.kv_size)),
            "o": (s.q_size, (s.hidden_size,)),
            "gate_up": (s.hidden_size, (s.intermediate_size, s.intermediate_size)),
            "down": (s.intermediate_size, (s.hidden_size,))}


@needs_fp8
@pytest.mark.parametrize("kind", ["block", "channel", "tensor"])
@pytest.mark.parametrize("shape", SHAPES)
def test_gemm_paths_equal_dequantized_float32(shape: str, kind: str) -> None:
    for proj, (k, shards) in _projection_shards(shape).items():
        if kind == "block" and len(shards) > 1 and any(r % 128 for r in shards):
            continue  # SmolLM2's fused 576/192-row q/k/v: blocks the fusion would cut
        layer, dense = _layer(kind, k, shards)
        for m in ROWS:
            x = torch.randn(m, k, device=DEV, generator=torch.Generator(device=DEV)
                            .manual_seed(m)).to(torch.bfloat16)
            got = layer(x)
            rows = x.float()
            # (the path the layer takes for these rows: cuBLAS FP8 and the FP8 x FP8
            # kernel multiply quantized rows)
            assert layer.route_of is not None
            quantized = layer.route_of(x) != "w8a16"
            if quantized:  # what cuBLAS multiplies: the quantized rows
                static = layer.input_scale.max().reshape(1) \
                    if layer.input_scale is not None else None
                q, s = quantize_activations(x, static)
                rows = q.float() * s
            ref = rows @ dense.T
            err = (got.float() - ref).abs().max().item()
            bound = REL * ref.abs().max().item()
            assert err <= bound, f"{shape} {proj} {kind} M={m}: {err:.4g} > {bound:.4g}"
            if quantized:  # and the rows' own quantization stays small against bf16 rows
                plain = x.float() @ dense.T
                assert (got.float() - plain).abs().max() <= 0.1 * plain.abs().max()
            if m == 1:  # the persistent row kernel, whatever the tile file picks
                tile = Fp8RowTile(2, 8, 2, 3)
                got = launch.w8a16(x, layer.weight, _gemm_scale(layer, kind),
                                   layer.scheme.block if kind == "block" else None, tile)
                err = (got.float() - ref).abs().max().item()
                assert err <= bound, f"{shape} {proj} {kind} {tile}: {err:.4g}"


#: Row kernel tiles the fused-input check runs: the register prefetch with one column per
#: block, and Triton's pipeline four stages deep (the plain check: three).
ROW_TILES = (Fp8RowTile(1, 8, 4, 0), Fp8RowTile(2, 16, 1, 4))


def _gemm_scale(layer: Fp8Linear, kind: str) -> torch.Tensor:
    """The scales the layer's GEMM reads: block scales as stored, else (N,) row scales."""
    return layer.scales if kind == "block" else layer.gemm_scale  # type: ignore[return-value]


@needs_fp8
@pytest.mark.parametrize("kind", ["block", "channel"])
def test_row_kernel_half_products(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The row kernel's f16-pair products (``launch.half_products``, on on every FP8 GPU):
    within ``REL`` of float32 for a plain row and for one with outliers near bf16's f16
    limit (no f16 overflow: the row's power-of-two scale), zeros for a zero row, outputs
    scaled bit for bit with a power-of-two scaling of the row (the scale absorbs it, down
    to rows of 2^-24), and within ``REL`` of the float32-product kernel at the same tile."""
    k, shards = _projection_shards("llama-3.2-1b")["o"]
    layer, dense = _layer(kind, k, shards)
    block = layer.scheme.block if kind == "block" else None
    scale = _gemm_scale(layer, kind)
    assert launch.half_products(DEV)
    gen = torch.Generator(device=DEV).manual_seed(11)
    x = torch.randn(1, k, device=DEV, generator=gen).to(torch.bfloat16)
    spiky = x.clone()
    spiky[0, 5], spiky[0, 77] = 30000.0, -20000.0
    for tile in (Fp8RowTile(2, 8, 2, 3), Fp8RowTile(4, 4, 4, 0)):
        for row in (x, spiky):
            got = launch.w8a16(row, layer.weight, scale, block, tile).float()
            ref = row.float() @ dense.T
            assert torch.isfinite(got).all()
            err = (got - ref).abs().max().item()
            assert err <= REL * ref.abs().max().item(), f"{kind} {tile}: {err:.4g}"
        assert not launch.w8a16(torch.zeros_like(x), layer.weight, scale, block, tile).any()
        base = launch.w8a16(x, layer.weight, scale, block, tile).float()
        for e in (-24, -7, 9):
            scaled = launch.w8a16((x.float() * 2.0**e).to(torch.bfloat16), layer.weight,
                                  scale, block, tile)
            assert torch.equal(scaled.float(), base * 2.0**e), (kind, tile, e)
        with monkeypatch.context() as m:
            m.setattr(launch, "half_products", lambda device: False)
            f32 = launch.w8a16(x, layer.weight, scale, block, tile).float()
        assert (base - f32).abs().max() <= REL * f32.abs().max(), (kind, tile)


@needs_fp8
@pytest.mark.parametrize("kind", ["block", "channel"])
@pytest.mark.parametrize("shape", SHAPES)
def test_row_kernel_fused_input_ops(shape: str, kind: str) -> None:
    """One row with the input op the decoder fuses (add + RMSNorm into qkv and gate_up,
    SiLU-and-mul into down) through the row kernel, against the unfused kernel's row times
    the dequantized weight in float32; the new residual equals the add-norm kernel's."""
    from executor import kernels
    from executor.quant.tiles import ADD_RMS_NORM, SILU_MUL

    gen = torch.Generator(device=DEV).manual_seed(3)
    for proj, (k, shards) in _projection_shards(shape).items():
        if proj == "o" or (kind == "block" and any(r % 128 for r in shards)):
            continue
        layer, dense = _layer(kind, k, shards)
        block = layer.scheme.block if kind == "block" else None
        op = SILU_MUL if proj == "down" else ADD_RMS_NORM
        x = torch.randn(1, 2 * k if op == SILU_MUL else k, device=DEV, generator=gen)
        x = x.to(torch.bfloat16)
        res = torch.randn(1, k, device=DEV, generator=gen).to(torch.bfloat16)
        nw = (1 + 0.1 * torch.randn(k, device=DEV, generator=gen)).to(torch.bfloat16)
        for tile in ROW_TILES:
            if op == SILU_MUL:
                got, got_res = launch.w8a16_fused(x, layer.weight, _gemm_scale(layer, kind),
                                                  block, op, None, None, 0.0, tile)
                row, want_res = kernels.silu_and_mul(x), None
            else:
                got, got_res = launch.w8a16_fused(x, layer.weight, _gemm_scale(layer, kind),
                                                  block, op, res, nw, 1e-5, tile)
                row, want_res = kernels.add_rms_norm(x, res, nw, 1e-5)
            ref = row.float() @ dense.T
            err = (got.float() - ref).abs().max().item()
            assert err <= REL * ref.abs().max().item(), f"{shape} {proj} {kind} {tile}: {err}"
            assert want_res is None or (got_res is not None and torch.equal(got_res, want_res))


#: GLU launch tiles the exactness check runs, each against the plain launch whose block has
#: twice its columns (the same weight rows per block, the same reduction): the row
#: kernel's default shapes (short and long rows) and register prefetch; w8a16 tiles.
GLU_TILES = (Fp8RowTile(4, 8, 2, 3), Fp8RowTile(1, 16, 1, 4), Fp8RowTile(1, 8, 4, 0),
             Fp8Tile(2, 2048, 8, 3), Fp8Tile(4, 1024, 4, 3))


@needs_fp8
@pytest.mark.parametrize("kind", ["block", "channel"])
@pytest.mark.parametrize("shape", SHAPES)
def test_glu_epilogue_equals_unfused(shape: str, kind: str) -> None:
    """The gate_up projection with the residual-add + RMSNorm in and ``silu(gate) * up``
    out (``launch.w8a16_glu``) against ``silu_and_mul`` of the plain launch at the tile of
    the same reduction, bit for bit (the new residual too), at 1 row and, on the w8a16
    kernel, 4; the layer's hook (``norm_glu_linear``, whatever the tile file picks) within
    ``REL`` of float32, and its CUDA graph replay equal to eager."""
    import dataclasses

    from executor import kernels
    from executor.quant.tiles import ADD_RMS_NORM

    k, shards = _projection_shards(shape)["gate_up"]
    layer, dense = _layer(kind, k, shards)
    block = layer.scheme.block if kind == "block" else None
    scale = _gemm_scale(layer, kind)
    gen = torch.Generator(device=DEV).manual_seed(k)
    for m in (1, 4):
        x, res = (torch.randn(m, k, device=DEV, generator=gen).to(torch.bfloat16)
                  for _ in range(2))
        nw = (1 + 0.1 * torch.randn(k, device=DEV, generator=gen)).to(torch.bfloat16)
        for tile in GLU_TILES:
            if m > 1 and isinstance(tile, Fp8RowTile):
                continue
            got, got_res = launch.w8a16_glu(x, layer.weight, scale, block, ADD_RMS_NORM,
                                            res, nw, 1e-5, tile)
            gate_up, want_res = launch.w8a16_fused(
                x, layer.weight, scale, block, ADD_RMS_NORM, res, nw, 1e-5,
                dataclasses.replace(tile, block_n=2 * tile.block_n))
            want = kernels.silu_and_mul(gate_up)
            assert torch.equal(got, want), \
                f"{shape} {kind} M={m} {tile}: {(got.float() - want.float()).abs().max()}"
            assert got_res is not None and want_res is not None
            assert torch.equal(got_res, want_res)
        # the layer's own launch (tuned or default tile) against float32
        fused = layer.norm_glu_linear(x, res, nw, 1e-5)
        assert fused is not None, (shape, kind, m)
        normed, _ = kernels.add_rms_norm(x, res, nw, 1e-5)
        gu = (normed.float() @ dense.T).to(torch.bfloat16).float()
        inter = gu.shape[1] // 2
        ref = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        err = (fused[0].float() - ref).abs().max().item()
        assert err <= 2 * REL * ref.abs().max().item(), f"{shape} {kind} M={m}: {err:.4g}"
    # one row captured in a CUDA graph, replayed on new inputs
    x, res = (torch.randn(1, k, device=DEV, generator=gen).to(torch.bfloat16) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(k, device=DEV, generator=gen)).to(torch.bfloat16)
    eager = layer.norm_glu_linear(x, res, nw, 1e-5)
    assert eager is not None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer.norm_glu_linear(x, res, nw, 1e-5)  # (warm: compiled, grid sized)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer.norm_glu_linear(x, res, nw, 1e-5)
    assert captured is not None
    x2, res2 = (torch.randn(1, k, device=DEV, generator=gen).to(torch.bfloat16)
                for _ in range(2))
    want2 = layer.norm_glu_linear(x2, res2, nw, 1e-5)
    assert want2 is not None
    x.copy_(x2)
    res.copy_(res2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], want2[0]) and torch.equal(captured[1], want2[1])


@needs_fp8
def test_fp8_glu_off_decodes_alike(tmp_path: Path) -> None:
    """A block FP8 model decoding one sequence (one row a step, decode graphs) with the
    gated epilogue (the default) and without it (``fp8_glu="off"``): the same greedy
    tokens and log-probabilities (the untuned GLU tile reduces as the plain one), and
    Health's kernel features say which ran."""
    path = _fp8_model(tmp_path)
    params = SamplingParams(logprobs=True, top_logprobs=2)
    runs = {}
    for glu in ("auto", "off"):
        ex = make_prefill_executor(path, fp8_glu=glu)
        try:
            assert ("fp8_glu" in ex.model_info.kernel_features) == (glu == "auto")
            ex.capture(["decode"])
            out = ex.prefill([PrefillItem("s", list(range(3, 40)), sampling=params)]).outputs
            steps = [(int(out[0].token_id), out[0].top_logprobs)]
            for _ in range(16):
                o = ex.decode([DecodeItem("s", steps[-1][0], params)]).outputs[0]
                steps.append((int(o.token_id), o.top_logprobs))
            runs[glu] = steps
        finally:
            ex.close()
    assert runs["auto"] == runs["off"]


@needs_fp8
@pytest.mark.parametrize("kind", ["block", "channel"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_dot_equals_dequantized_float32(shape: str, kind: str) -> None:
    """The FP8 x FP8 kernel at 8 and 64 rows, its default tile and tiles the sweep may
    pick (split-K, both MMA orientations); a split-K launch repeats bit for bit."""
    from executor.quant.dot_kernel import fp8_dot
    from executor.quant.tiles import DotTile

    tiles = [None, DotTile(64, 128, 1), DotTile(128, 128, 4, 8), DotTile(64, 256, 2),
             DotTile(64, 128, 8, 4, 3, False)]  # (the last: 64-row programs only)
    for proj, (k, shards) in _projection_shards(shape).items():
        if kind == "block" and len(shards) > 1 and any(r % 128 for r in shards):
            continue  # (as above)
        layer, dense = _layer(kind, k, shards)
        block = (128, 128) if kind == "block" else None
        scale = layer.scales if block else layer.gemm_scale
        for m in (8, 64):
            x = torch.randn(m, k, device=DEV, generator=torch.Generator(device=DEV)
                            .manual_seed(m)).to(torch.bfloat16)
            q, s = launch.act_quant(x, None)
            ref = (q.float() * s) @ dense.T
            bound = REL * ref.abs().max().item()
            for tile in tiles:
                if tile is not None and ((block and tile.block_k > 128)
                                         or (m < 32 and not tile.swap_ab)):
                    continue  # (block scales: chunks inside a block; as the sweep tries)
                got = fp8_dot(q, s, layer.weight, scale, block, torch.bfloat16, tile)
                err = (got.float() - ref).abs().max().item()
                assert err <= bound, f"{shape} {proj} {kind} M={m} {tile}: {err:.4g}"
                if tile is not None and tile.split_k > 1:
                    again = fp8_dot(q, s, layer.weight, scale, block, torch.bfloat16, tile)
                    assert torch.equal(got, again)


@needs_fp8
@pytest.mark.parametrize("route", ["dot", "scaled_mm"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_quantization_equals_unfused(shape: str, route: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """At 8 and 64 rows, whichever of the quantizing paths the sweep picked: the norm
    (with and without the residual add) and SiLU-and-mul write the e4m3 rows the
    activation quantization would write from their bf16 output, so the layer's fused
    hooks equal the unfused kernels then the layer, bit for bit."""
    from executor import kernels

    if route == "scaled_mm" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("row-wise cuBLAS FP8 scales need Hopper")
    monkeypatch.setattr(gemm, "skinny_kernel", lambda *_: route)
    for proj, (k, shards) in _projection_shards(shape).items():
        if proj not in ("qkv", "down"):
            continue
        layer, _ = _layer("channel", k, shards)
        gen = torch.Generator(device=DEV).manual_seed(k)
        for m in (8, 64):
            assert layer.route_of is not None
            if proj == "down":
                gate_up = torch.randn(m, 2 * k, device=DEV, generator=gen).to(torch.bfloat16)
                assert layer.route_of(gate_up[:, :k]) == route
                got = layer.silu_mul_linear(gate_up)
                assert got is not None and torch.equal(got, layer(kernels.silu_and_mul(gate_up)))
                continue
            x, res = (torch.randn(m, k, device=DEV, generator=gen).to(torch.bfloat16)
                      for _ in range(2))
            nw = (1 + 0.1 * torch.randn(k, device=DEV, generator=gen)).to(torch.bfloat16)
            for residual in (None, res):
                fused = layer.norm_linear(x, residual, nw, 1e-5)
                assert fused is not None
                if residual is None:
                    normed, want_res = kernels.rms_norm(x, nw, 1e-5), x
                else:
                    normed, want_res = kernels.add_rms_norm(x, residual, nw, 1e-5)
                assert torch.equal(fused[0], layer(normed)), (shape, m, residual is None)
                assert torch.equal(fused[1], want_res)


@needs_fp8
def test_pdl_launches_equal_plain_ones() -> None:
    """Under PDL the FP8 x FP8 kernel prefetches weights and the quantizing norm, SiLU-and-
    mul and activation quantization start early: chained as in a decode layer (split-K
    workspace reused launch after launch), every output equals the plain launches' bit
    for bit."""
    from executor.kernels import activation, norm
    from executor.kernels.switches import KernelSwitches, pdl_unsupported_reason
    from executor.quant.dot_kernel import fp8_dot
    from executor.quant.tiles import DotTile

    if pdl_unsupported_reason("cuda"):
        pytest.skip("PDL unsupported here")
    k, n, inter = 4096, 6144, 14336
    g = torch.Generator(device=DEV).manual_seed(9)
    x, res = (torch.randn(64, k, generator=g, device=DEV).to(torch.bfloat16) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(k, generator=g, device=DEV)).to(torch.bfloat16)
    w1, s1 = quantize_rows(torch.randn(n, k, generator=g, device=DEV) / 64)
    w2, s2 = quantize_rows(torch.randn(k, inter, generator=g, device=DEV) / 64)
    s1, s2 = s1.reshape(-1).contiguous(), s2.reshape(-1).contiguous()

    def chain() -> tuple[torch.Tensor, ...]:
        q, s, r = norm.rms_norm_quant(x, res, nw, 1e-5)
        y = fp8_dot(q, s, w1, s1, None, torch.bfloat16, DotTile(64, 128, 4))
        gate_up = y.repeat(1, 5)[:, : 2 * inter]  # (64, 2 * inter), row stride 5n
        q2, t2 = activation.silu_and_mul_quant(gate_up)
        z = fp8_dot(q2, t2, w2, s2, None, torch.bfloat16, DotTile(64, 128, 8))
        q3, t3 = launch.act_quant(z, None)
        out = fp8_dot(q3, t3, w1[:, :k].contiguous(), s1, None, torch.bfloat16)
        assert r is not None
        return q.float(), s, r, y, q2.float(), z, out

    with KernelSwitches(pdl=False):
        plain = chain()
    for _ in range(3):
        with KernelSwitches(pdl=True):
            early = chain()
        torch.cuda.synchronize()
        for a, b in zip(plain, early, strict=True):
            assert torch.equal(a, b)


@needs_fp8
@pytest.mark.parametrize("static", [False, True])
def test_act_quant_kernel_is_exact(static: bool) -> None:
    x = (torch.randn(300, 4096, device=DEV) * 3).to(torch.bfloat16)
    scale = torch.tensor([0.02], device=DEV) if static else None
    q, s = launch.act_quant(x, scale)
    rq, rs = quantize_activations(x, scale)
    assert torch.equal(s, rs)
    assert torch.equal(q.float(), rq.float())


def _fp8_model(root: Path) -> Path:
    """The GPU tests' small Llama's shape, block-wise FP8 (``gpu_model``'s layout)."""
    return write_fp8_model(root / "fp8-llama", "block", vocab_size=1024, hidden_size=512,
                           intermediate_size=1024, num_hidden_layers=3,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                           max_position_embeddings=4096)


@needs_fp8
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_graphs_equal_eager_with_fp8(quantization: str | None, tmp_path: Path,
                                     model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block FP8 checkpoint, and a bf16 one with ``--quantization fp8``: full decode and
    breakable prefill graphs against eager, every clear greedy choice the same.

    NOTE: five sequences decode eagerly at 5 rows but replay the 8-row graph; from 8 rows
    a per-channel layer may quantize its activations (the FP8 x FP8 kernel), which moves
    logits by more than this comparison's margin. Both keep w8a16 here, the paths of the
    8-64-row buckets are compared at equal buckets below (``test_batched_decode_...``)."""
    monkeypatch.setattr(gemm, "skinny_kernel", lambda *_: "w8a16")
    path = _fp8_model(tmp_path) if quantization is None else model_path
    model = ModelConfig(source=str(path), dtype="bfloat16", quantization=quantization)  # type: ignore[arg-type]
    ex = make_prefill_executor(path, model=model)  # type: ignore[arg-type]
    eager = make_prefill_executor(path, prefill="disabled", decode="disabled",
                                  model=model)  # type: ignore[arg-type]
    try:
        info = ex.status().model
        assert info.weight_format == "fp8_e4m3"
        assert info.quantization == ("fp8_block_128x128" if quantization is None
                                     else "fp8_at_load")
        assert isinstance(ex.model.layers[0].mlp.down_proj, Fp8Linear)  # type: ignore[attr-defined]
        ex.capture(["decode", "prefill"])
        greedy_agrees(ex, eager)
    finally:
        ex.close()
        eager.close()


@needs_fp8
def test_batched_decode_graphs_equal_eager_with_fp8(model_path: Path) -> None:
    """``--quantization fp8`` decode at 40 and 12 sequences (graph buckets of 64 and 16
    rows: the paths from 8 rows and their fused quantization) against eager, every clear
    greedy choice the same."""
    from executor.config import CacheConfig, GraphConfig
    from tests.helpers.gpu import clear_choices_agree, rand_tokens

    model = ModelConfig(source=str(model_path), dtype="bfloat16", quantization="fp8")
    big = {"cache": CacheConfig(kv_tokens=64 * 1024, max_sequences=64, max_context=2048),
           "max_decode_batch": 64, "model": model}
    ex = make_prefill_executor(model_path, prefill="disabled", **big,  # type: ignore[arg-type]
                               graphs=GraphConfig(decode_mode="full",
                                                  decode_buckets=(8, 16, 64)))  # type: ignore[arg-type]
    eager = make_prefill_executor(model_path, prefill="disabled", decode="disabled",
                                  **big)  # type: ignore[arg-type]
    params = SamplingParams(logprobs=True, top_logprobs=2)
    try:
        ex.capture(["decode"])
        first = [PrefillItem(f"s{i}", rand_tokens(5 + i % 7, i), sampling=params)
                 for i in range(40)]
        toks = {o.seq_id: int(o.token_id) for o in eager.prefill(first).outputs}
        ex.prefill(first)
        for step in range(8):
            if step == 4:  # down to 12 sequences
                gone = [s for s in toks if int(s[1:]) >= 12]
                for e in (ex, eager):
                    e.release(gone)
                toks = {s: t for s, t in toks.items() if s not in gone}
            items = [DecodeItem(s, t, params) for s, t in toks.items()]
            res = eager.decode(items)
            clear_choices_agree(ex.decode(items), res)
            toks = {o.seq_id: int(o.token_id) for o in res.outputs}  # type: ignore[arg-type]
    finally:
        ex.close()
        eager.close()


@needs_fp8
def test_quantization_fp8_agrees_with_bf16(model_path: Path) -> None:
    """Greedy tokens of the bf16 checkpoint, 8 prompts x 64 steps; the FP8 run fed the
    same tokens (teacher-forced: one early difference would otherwise decide every later
    token) must pick the same next token at >= 90 % of the positions. The free-running
    agreement (identical prefix length) is printed beside it."""
    greedy = SamplingParams()
    runs: dict[str, dict[str, list[int]]] = {}
    prompts = {f"p{i}": torch.randint(0, 1024, (12 + 5 * i,), generator=torch.Generator()
                                      .manual_seed(i)).tolist() for i in range(8)}
    base = ModelConfig(source=str(model_path), dtype="bfloat16")
    configs = {"bf16": base, "fp8": dataclasses.replace(base, quantization="fp8")}
    exs = {k: make_prefill_executor(model_path, model=c) for k, c in configs.items()}  # type: ignore[arg-type]
    try:
        for name, ex in exs.items():
            out = {o.seq_id: [int(o.token_id)] for o in ex.prefill(
                [PrefillItem(s, p, sampling=greedy) for s, p in prompts.items()]).outputs}
            for _ in range(63):
                step = ex.decode([DecodeItem(s, t[-1], greedy) for s, t in out.items()])
                for o in step.outputs:
                    out[o.seq_id].append(int(o.token_id))
            ex.release(list(out))
            runs[name] = out
        # teacher-forced: the FP8 model's choice after each bf16 prefix
        fp8 = exs["fp8"]
        agree = total = 0
        for s, p in prompts.items():
            ref = runs["bf16"][s]
            res = fp8.prefill([PrefillItem(s, p + ref[:-1], sampling=greedy,
                                           every_position=True)])
            # positions[i]: the pick after token i; from the prompt's last on, one per step
            picks = [int(t.token_id) for t in res.outputs[0].positions][len(p) - 1 :]
            agree += sum(a == b for a, b in zip(picks, ref, strict=True))
            total += len(ref)
            fp8.release([s])
        free = sum(next((i for i, (a, b) in enumerate(zip(runs["fp8"][s], runs["bf16"][s],
                                                            strict=True)) if a != b), 64)
                   for s in prompts) / (64 * len(prompts))
        print(f"\n--quantization fp8 vs bf16: {agree / total:.1%} of {total} greedy tokens "
              f"agree (teacher-forced); free-running identical prefix {free:.1%}")
        assert agree / total >= 0.9
    finally:
        for ex in exs.values():
            ex.close()
