"""The MoE decode path (``executor.kernels.moe.decode``) on CPU under Triton's interpreter.

Its two launches against the eager reference (top-1/2/8 routing, renormalized or not,
weights rounded or not, tokens sharing experts, widths off the tiles), its routing
against ``route.route_topk``, its fused input norm against the norm kernel then the path,
the dispatch rule, and a tiny MoE model decoding one sequence through it against the
eager path. Skipped on CUDA machines (``tests/executor/model/test_moe_gpu.py`` runs the
compiled kernels at the real shapes).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.interpret import interpreter_triton

triton = interpreter_triton()

from executor.config import CacheConfig, ExecutorConfig, ModelConfig  # noqa: E402
from executor.kernels.moe import decode, fused  # noqa: E402
from executor.kernels.moe.reference import experts_reference, route  # noqa: E402
from executor.kernels.moe.route import route_topk  # noqa: E402
from executor.model.layers import TORCH_OPS  # noqa: E402
from tests.helpers.moe_models import write_moe_model  # noqa: E402
from tests.helpers.one_launch import count_one_launches  # noqa: E402

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 1e-2), torch.bfloat16: (2e-2, 2e-2)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _problem(tokens: int, experts: int, hidden: int, inter: int, dtype: torch.dtype,
             seed: int) -> tuple[torch.Tensor, ...]:
    g = _gen(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, experts, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    return x, logits, w13, w2


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inter"),
                         [(1, 4, 1, 32, 32), (2, 8, 2, 48, 24), (1, 16, 8, 40, 48),
                          (4, 32, 2, 32, 16)])
def test_decode_path_matches_reference(dtype: torch.dtype, tokens: int, experts: int,
                                       top_k: int, hidden: int, inter: int) -> None:
    """Output against the eager experts on the torch routing, and the routing it stores
    equal to the routing kernel's, for both renormalizations and weight roundings."""
    x, logits, w13, w2 = _problem(tokens, experts, hidden, inter, dtype, tokens + top_k)
    atol, rtol = TOL[dtype]
    for renormalize, rounded in ((True, True), (False, False)):
        out, weights, ids = decode.routed(x, logits, w13, w2, top_k, renormalize, rounded)
        want_w, want_i = route_topk(logits, top_k, renormalize, rounded)
        assert torch.equal(ids, want_i) and torch.equal(weights, want_w)
        ref_w, ref_i = route(logits, top_k, renormalize, rounded)
        assert torch.equal(ids, ref_i)
        torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-6)
        want = experts_reference(x, w13, w2, ref_w, ref_i)
        assert out.shape == x.shape and out.dtype == dtype
        torch.testing.assert_close(out, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_path_tokens_sharing_experts_and_odd_tiles(dtype: torch.dtype) -> None:
    """Every token routed to the same two experts (the rest idle), with tiles that leave
    partial column and reduction blocks; the result does not depend on the tiles."""
    x, logits, w13, w2 = _problem(3, 8, 40, 24, dtype, 7)
    logits[:, 5] = 8.0
    logits[:, 2] = 6.0
    out, weights, ids = decode.routed(x, logits, w13, w2, 2, True, False)
    assert ids.tolist() == [[5, 2]] * 3
    torch.testing.assert_close(out, experts_reference(x, w13, w2, weights, ids),
                               atol=TOL[dtype][0], rtol=TOL[dtype][1])
    for tiles in (decode.DecodeTiles(8, 16, 8, 16), decode.DecodeTiles(32, 64, 16, 8)):
        other = decode.routed(x, logits, w13, w2, 2, True, False, tiles=tiles)[0]
        torch.testing.assert_close(other, out, atol=TOL[dtype][0], rtol=TOL[dtype][1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_path_fused_norm_equals_norm_then_path(dtype: torch.dtype) -> None:
    """With a norm weight the kernel normalizes the residual sum as the norm kernel does:
    the same output as the norm kernel followed by the unnormed path."""
    from executor import kernels

    x, logits, w13, w2 = _problem(2, 16, 64, 32, dtype, 11)
    x = x * 3.0
    nw = (1.0 + 0.2 * torch.randn(64, generator=_gen(12))).to(dtype)
    got = decode.routed(x, logits, w13, w2, 4, True, True, nw, 1e-6)[0]
    normed = kernels.rms_norm(x, nw, 1e-6)
    torch.testing.assert_close(normed, TORCH_OPS.rms_norm(x, nw, 1e-6))
    want = decode.routed(normed, logits, w13, w2, 4, True, True)[0]
    assert torch.equal(got, want)
    weights, ids = route(logits, 4, True, True)
    torch.testing.assert_close(got, experts_reference(TORCH_OPS.rms_norm(x, nw, 1e-6), w13, w2,
                                                      weights, ids),
                               atol=TOL[dtype][0], rtol=TOL[dtype][1])


@pytest.mark.parametrize("warps", [1, 2, 4, 8])
def test_decode_routing_bits_equal_the_routing_kernel(warps: int) -> None:
    """gate_up routes on one copy of the logits row a warp: the same ids and weight bits as
    ``route_topk`` for any warp count, with tied logits (the lowest expert first), an
    expert count off a power of two, and a row of NaN logits; the output is the reference's
    on those experts."""
    x, logits, w13, w2 = _problem(4, 12, 32, 16, torch.float16, 5)
    logits = logits.round()  # many equal logits
    logits[0, 3] = logits[0, 7] = logits[0, 10] = 9.0  # a three-way tie on top
    logits[2] = float("nan")
    tiles = dataclasses.replace(decode.pick_tiles(4, 3, 32, 16, torch.float16, 1),
                                num_warps=warps)
    for renormalize, rounded in ((True, True), (False, False)):
        out, weights, ids = decode.routed(x, logits, w13, w2, 3, renormalize, rounded,
                                          tiles=tiles)
        want_w, want_i = route_topk(logits, 3, renormalize, rounded)
        assert torch.equal(ids, want_i)
        assert torch.equal(weights.view(torch.int32), want_w.view(torch.int32))
        assert ids[0].tolist() == [3, 7, 10]
        ok = torch.tensor([True, True, False, True])
        want = experts_reference(x[ok], w13, w2, want_w[ok], want_i[ok].long())
        torch.testing.assert_close(out[ok], want, atol=TOL[torch.float16][0],
                                   rtol=TOL[torch.float16][1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_launch_kernel_equals_two_launches(dtype: torch.dtype,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-token single launch (``decode_persistent``: down in gate_up's grid after
    every program has arrived), here as a grid of one program (the interpreter runs
    programs one after another), gives the two launches' bits with and without the fused
    norm (the two launches: the switch off, ``--moe-one-launch off``); a grid of more
    programs is left to the two launches."""
    from executor.kernels.switches import KernelSwitches

    x, logits, w13, w2 = _problem(1, 6, 24, 16, dtype, 3)
    nw = (1.0 + 0.2 * torch.randn(24, generator=_gen(4))).to(dtype)
    one = decode.DecodeTiles(16, 16, 32, 16)
    taken = count_one_launches(monkeypatch)
    for norm in (None, nw):
        got = decode.routed(x, logits, w13, w2, 1, True, True, norm, 1e-6, one)
        with KernelSwitches(moe_one_launch=False):
            want = decode.routed(x, logits, w13, w2, 1, True, True, norm, 1e-6, one)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    wide = decode.routed(x, logits, w13, w2, 2, True, True, None, 0.0, one)[0]
    assert taken == [True, True, False]  # (the switch off never asks)
    weights, ids = route(logits, 2, True, True)
    torch.testing.assert_close(wide, experts_reference(x, w13, w2, weights, ids),
                               atol=TOL[dtype][0], rtol=TOL[dtype][1])


def test_dispatch_rule_and_tiles() -> None:
    assert decode.takes(1, 8, 128) and decode.takes(4, 8, 128)
    assert not decode.takes(5, 8, 128) and not decode.takes(0, 8, 128)
    assert decode.takes(1, 2, 8) and not decode.takes(2, 2, 8)  # Mixtral: shared experts
    # Qwen3-30B-A3B at one token on 132 multiprocessors: 8 pairs x 48 column blocks of 16
    # (384 programs) for gate_up, 256 programs of 8 columns for down
    tiles = decode.pick_tiles(1, 8, 2048, 768, torch.bfloat16, 132)
    assert (tiles.block_n, tiles.block_n_down) == (16, 8)
    assert tiles.block_k * tiles.block_n * 2 <= 8192
    assert tiles.block_k_down * tiles.block_n_down * 8 <= 8192


def test_route_and_experts_takes_decode_path_at_few_tokens(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """``route_and_experts`` at one token runs the decode path, at more the grouped GEMMs;
    both give the reference's result."""
    calls: list[int] = []
    routed = decode.routed

    def counting(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(x.shape[0])
        return routed(x, *args, **kwargs)

    monkeypatch.setattr(decode, "routed", counting)
    for tokens in (1, 3):
        x, logits, w13, w2 = _problem(tokens, 8, 32, 32, torch.float16, tokens)
        got = fused.route_and_experts(x, logits, w13, w2, 2, False, False)
        weights, ids = route(logits, 2, False, False)
        torch.testing.assert_close(got, experts_reference(x, w13, w2, weights, ids),
                                   atol=2e-3, rtol=1e-2)
    assert calls == [1]


def test_moe_model_decodes_one_sequence_through_the_decode_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen3-MoE in fp16 decoding one sequence: the fused kernels take the decode
    path with the post-attention norm fused (the router GEMM takes it, the experts read
    the residual sum); logits equal the eager path's."""
    from executor.executor import Executor

    normed: list[bool] = []
    routed = decode.routed

    def counting(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        normed.append(args[6] is not None)
        return routed(x, *args, **kwargs)

    monkeypatch.setattr(decode, "routed", counting)
    path = write_moe_model(tmp_path, "qwen3_moe")
    ex = Executor(ExecutorConfig(model=ModelConfig(source=str(path), dtype="float16"),
                                 device="cpu",
                                 cache=CacheConfig(kv_tokens=64, max_sequences=1,
                                                   max_context=32)))
    out = {}
    for choice in ("torch", "triton"):
        ex.model.kernels = choice  # type: ignore[attr-defined]
        got = []
        for phase, tokens in (("prefill", [3, 17, 99, 4, 250]), ("decode", [11])):
            alloc = ex.kv.allocate([(choice, len(tokens))])
            batch = ex.build_batch(phase, tokens, alloc, [])
            batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens))
            got.append(ex.forward_logits(batch).float())
        ex.release([choice])
        out[choice] = got
    assert normed == [True, True]  # the decode step's two sparse layers
    for got_fused, got_eager in zip(out["triton"], out["torch"], strict=True):
        torch.testing.assert_close(got_fused, got_eager, atol=2e-2, rtol=2e-2)


def test_fused_moe_custom_op_takes_the_norm() -> None:
    """``model_executor::fused_moe`` with its optional norm weight and eps (the decode
    path's fused norm): schema and fake impl (``opcheck``), and the eager call's result."""
    x, logits, w13, w2 = _problem(1, 8, 32, 16, torch.float16, 13)
    nw = (1.0 + 0.2 * torch.randn(32, generator=_gen(14))).to(torch.float16)
    args = (x, logits, w13, w2, 2, True, True, nw, 1e-6)
    torch.library.opcheck(torch.ops.model_executor.fused_moe.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    got = torch.ops.model_executor.fused_moe(*args)
    assert torch.equal(got, decode.routed(*args)[0])
