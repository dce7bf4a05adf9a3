"""Programmatic dependent launch on a GPU (marker ``gpu``; needs compute capability 9.0).

With PDL each of our Triton kernels may start while its predecessor finishes, and waits
(``griddepcontrol.wait``) before it reads step data or writes anything. Only the timing of
loads changes, so everything must equal the plain launches *bit for bit*: a kernel that
read or wrote before its wait would show up here as a differing value, in some replays.

- each PDL-aware kernel, eagerly, on fresh random inputs (the odd SmolLM2 widths too);
- whole steps: an executor launching with PDL against one without, prefill from breakable
  graphs and 24 decode steps from full or breakable graphs, every top log-probability and
  token equal.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from executor.api import DecodeItem, PrefillItem, SamplingParams
from executor.executor import Executor
from executor.kernels.switches import KernelSwitches, pdl_unsupported_reason
from tests.helpers.gpu import gpu_model, make_prefill_executor, rand_tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(torch.cuda.is_available() and pdl_unsupported_reason("cuda") != "",
                       reason="PDL unsupported here"),
]

SCORED = SamplingParams(logprobs=True, top_logprobs=4)


def both(fn: Callable[[], object]) -> tuple[object, object]:
    with KernelSwitches(pdl=False):
        plain = fn()
    with KernelSwitches(pdl=True):
        fused = fn()
    torch.cuda.synchronize()
    return plain, fused


def assert_same(plain: object, fused: object) -> None:
    if isinstance(plain, tuple):
        assert isinstance(fused, tuple) and len(plain) == len(fused)
        for p, f in zip(plain, fused, strict=True):
            assert_same(p, f)
    elif isinstance(plain, torch.Tensor):
        assert isinstance(fused, torch.Tensor)
        assert torch.equal(plain, fused), (plain - fused).abs().max()
    else:
        assert plain == fused


@pytest.mark.parametrize("k, n", [(576, 1728), (2048, 3072), (2048, 16384), (8192, 2048)])
def test_kernels_equal_their_plain_launches(k: int, n: int) -> None:
    from executor.kernels import activation, argmax, norm, skinny

    g = torch.Generator(device="cuda").manual_seed(k + n)
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(1, k, generator=g, device=dev, dtype=dt)
    res = torch.randn(1, k, generator=g, device=dev, dtype=dt)
    gate_up = torch.randn(1, 2 * k, generator=g, device=dev, dtype=dt)
    w = torch.randn(n, k, generator=g, device=dev, dtype=dt) / k ** 0.5
    nw = 1 + 0.1 * torch.randn(k, generator=g, device=dev, dtype=dt)
    rows = torch.randn(5, k, generator=g, device=dev, dtype=dt)
    for fn in (lambda: skinny.skinny_gemm(x, w),
               lambda: skinny.skinny_gemm(gate_up, w, silu_mul=True),
               lambda: skinny.skinny_norm_gemm(x, None, nw, 1e-5, w),
               lambda: skinny.skinny_norm_gemm(x, res, nw, 1e-5, w),
               lambda: norm.add_rms_norm(rows, rows.flip(0), nw, 1e-5),
               lambda: activation.silu_and_mul(torch.cat([rows, rows], 1)),
               lambda: argmax.argmax_rows(rows)):
        assert_same(*both(fn))


def test_attention_and_rope_equal_their_plain_launches() -> None:
    from executor.attention.triton_kernels.decode import decode_attention
    from executor.attention.triton_kernels.store import store_kv
    from executor.kernels.rope import rope_qk

    g = torch.Generator(device="cuda").manual_seed(3)
    dev, dt = "cuda", torch.bfloat16
    b, heads, kv_heads, d, splits, locs = 3, 9, 3, 64, 8, 4096
    pool_k = torch.randn(locs, kv_heads, d, generator=g, device=dev, dtype=dt)
    pool_v = torch.randn(locs, kv_heads, d, generator=g, device=dev, dtype=dt)
    table = torch.randperm(locs - 1, generator=g, device=dev)[: 4 * 1000].view(4, 1000)
    table = (table + 1).to(torch.int32)
    q = torch.randn(b, heads, d, generator=g, device=dev, dtype=dt)
    k_new = torch.randn(b, kv_heads, d, generator=g, device=dev, dtype=dt)
    v_new = torch.randn(b, kv_heads, d, generator=g, device=dev, dtype=dt)
    req = torch.tensor([2, 0, 3], device=dev)
    seq_lens = torch.tensor([1, 517, 999], device=dev)
    loc = table[req, seq_lens - 1].to(torch.int64)
    positions = seq_lens - 1
    cos = torch.randn(2048, d, generator=g, device=dev)
    sin = torch.randn(2048, d, generator=g, device=dev)

    def attend() -> tuple[torch.Tensor, ...]:
        kp, vp = pool_k.clone(), pool_v.clone()
        out = torch.empty_like(q)
        mid_o = torch.empty(b, heads, splits, d, device=dev)
        mid_lse = torch.empty(b, heads, splits, device=dev)
        decode_attention(q, k_new, v_new, kp, vp, table, req, seq_lens, loc, out, mid_o,
                         mid_lse, d ** -0.5, rope=(cos, sin))
        store_kv(kp, vp, loc.flip(0), k_new, v_new)
        return (out, kp, vp, *rope_qk(q, k_new, positions, cos, sin))

    assert_same(*both(attend))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gpu_model(tmp_path_factory.mktemp("pdl"))


def _step(ex: Executor, ids: list[str], tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
    with ex.switches:  # eager pieces launch as this executor would alone
        step = ex.decode([DecodeItem(s, t, SCORED) for s, t in zip(ids, tokens, strict=True)])
    tops = torch.tensor([[lp for _, lp in o.top_logprobs] for o in step.outputs])
    return tops, [int(o.token_id) for o in step.outputs]  # type: ignore[arg-type]


@pytest.mark.parametrize(("decode", "rope"), [("full", "auto"), ("breakable", "auto"),
                                              ("full", "off")])
def test_steps_with_pdl_equal_plain_launches_bit_for_bit(model_path: Path, decode: str,
                                                         rope: str) -> None:
    """``rope="off"`` keeps RoPE out of the decode attention: its own kernel, which lets
    the attention launch before its wait (``pdl_launch_then_wait``), runs in every step."""
    plain = make_prefill_executor(model_path, prefill="breakable", decode=decode, pdl="off",
                                  fuse_decode_rope=rope)
    fused = make_prefill_executor(model_path, prefill="breakable", decode=decode, pdl="on",
                                  fuse_decode_rope=rope)
    assert fused.switches.pdl and not plain.switches.pdl
    assert "pdl" in fused.model_info.kernel_features
    for ex in (plain, fused):
        with ex.switches:
            ex.capture(["decode", "prefill"])
    ids = [f"s{i}" for i in range(5)]
    prompts = [rand_tokens(7 + 40 * i, seed=i) for i in range(5)]
    firsts = []
    for ex in (plain, fused):
        with ex.switches:
            out = ex.prefill([PrefillItem(s, p, sampling=SCORED)
                              for s, p in zip(ids, prompts, strict=True)])
        firsts.append([(o.token_id, o.top_logprobs) for o in out.outputs])
    assert firsts[0] == firsts[1]
    tokens = [int(t) for t, _ in firsts[0]]  # type: ignore[arg-type]
    for _ in range(24):
        want, want_tokens = _step(plain, ids, tokens)
        got, got_tokens = _step(fused, ids, tokens)
        assert torch.equal(got, want) and got_tokens == want_tokens
        tokens = want_tokens
    assert torch.equal(fused.pool.k_buffer, plain.pool.k_buffer)
