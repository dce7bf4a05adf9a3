"""The fused-MoE kernels (``executor.kernels.moe``) on CPU under Triton's interpreter.

``align`` against its contract (every routed pair once, runs padded per expert, the block
table, fixed sizes); ``fused_experts`` against the eager reference for top-1/2/8 routing,
uneven expert loads, experts that receive no token and several rows blocks per expert, in
fp16 and fp32 (the interpreter's bf16 dot is unreliable: bf16 runs on the GPU tests);
the routing kernel in bf16 too; ``route`` against transformers' own routers; a tiny MoE
model on the fused path against its eager path. Skipped on CUDA machines, where
``test_moe_gpu.py`` runs the compiled kernels at realistic shapes.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: the gpu tests cover the compiled kernels",
                allow_module_level=True)
if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="triton is not installed")
if type(triton.language.sum).__name__ != "InterpretedFunction":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (set it in the "
                "environment or run this file in its own process)", allow_module_level=True)

from executor.config import CacheConfig, ExecutorConfig, ModelConfig  # noqa: E402
from executor.executor import Executor  # noqa: E402
from executor.kernels.moe.align import align, max_padded_rows  # noqa: E402
from executor.kernels.moe.fused import MoeTiles, fused_experts, pick_tiles  # noqa: E402
from executor.kernels.moe.reference import experts_reference, route  # noqa: E402
from tests.helpers.moe_models import moe_config, write_moe_model  # noqa: E402

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 1e-2)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m"),
                         [(5, 4, 1, 16), (9, 8, 2, 16), (3, 16, 8, 16), (40, 3, 2, 16),
                          (1, 128, 8, 16), (33, 6, 2, 32)])
def test_align_groups_every_pair_by_expert(tokens: int, experts: int, top_k: int,
                                           block_m: int) -> None:
    g = _gen(tokens * experts)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]
                      ).to(torch.int32)  # distinct experts per token, as topk gives
    sorted_ids, block_experts, num_padded = align(ids, experts, block_m)
    n = tokens * top_k
    max_rows = max_padded_rows(n, experts, block_m)
    assert sorted_ids.shape == (max_rows,) and block_experts.shape == (max_rows // block_m,)
    flat = ids.flatten()
    counts = torch.bincount(flat.long(), minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert int(num_padded) == int(padded.sum()) <= max_rows
    row = 0
    for e in range(experts):
        run = sorted_ids[row : row + int(padded[e])]
        pairs = run[run < n]
        # the expert's pairs in ascending order, then padding
        assert pairs.tolist() == (flat == e).nonzero().flatten().tolist()
        assert (run[len(pairs):] == n).all()
        blocks = block_experts[row // block_m : (row + int(padded[e])) // block_m]
        assert (blocks == e).all()
        row += int(padded[e])
    assert (sorted_ids[row:] == n).all() and (block_experts[row // block_m :] == -1).all()


def _weights(experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
           ids: torch.Tensor, tiles: MoeTiles | None = None) -> None:
    want = experts_reference(x, w13, w2, weights, ids)
    got = fused_experts(x, w13, w2, weights, ids, tiles)
    assert got.dtype == x.dtype and got.shape == x.shape
    atol, rtol = TOL[x.dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inter"),
                         [(5, 4, 1, 32, 32), (9, 8, 2, 48, 32), (3, 16, 8, 32, 48),
                          (1, 8, 2, 64, 32)])
def test_fused_matches_reference_routed(dtype: torch.dtype, tokens: int, experts: int,
                                        top_k: int, hidden: int, inter: int) -> None:
    """Routing by a random router (top-1, top-2, top-8; widths not multiples of the
    tiles), renormalized and not."""
    g = _gen(tokens + top_k)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13, w2 = _weights(experts, hidden, inter, dtype, seed=experts)
    for renormalize in (True, False):
        weights, ids = route(torch.randn(tokens, experts, generator=g).to(dtype), top_k,
                             renormalize, weights_in_activation_dtype=renormalize)
        _check(x, w13, w2, weights, ids)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fused_uneven_loads_and_idle_experts(dtype: torch.dtype) -> None:
    """Expert 0 takes every token (three 16-row blocks), expert 5 a few, the rest none."""
    tokens, experts, hidden, inter = 37, 8, 32, 32
    g = _gen(5)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13, w2 = _weights(experts, hidden, inter, dtype, seed=1)
    ids = torch.zeros(tokens, 2, dtype=torch.int32)
    ids[:, 1] = 3
    ids[::7, 1] = 5
    weights = torch.rand(tokens, 2, generator=g)
    _check(x, w13, w2, weights, ids, MoeTiles(16, 32, 32))
    # and taller row blocks than any expert's load
    _check(x, w13, w2, weights, ids, MoeTiles(64, 64, 16))


def test_fused_empty_batch_and_tiles() -> None:
    w13, w2 = _weights(4, 32, 32, torch.float32, seed=2)
    x = torch.empty(0, 32)
    out = fused_experts(x, w13, w2, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int32))
    assert out.shape == (0, 32)
    assert pick_tiles(8, 128, torch.bfloat16).block_m == 16  # decode: a few rows per expert
    assert pick_tiles(2048 * 8, 128, torch.bfloat16).block_m == 64  # prefill
    # decode on 132 multiprocessors, 8 row blocks: column blocks narrowed until the
    # programs cover them (768 / 32 * 8 = 192 programs; 2048 / 64 * 8 = 256 already do)
    from executor.kernels.moe.fused import _narrow_enough

    assert (_narrow_enough(8, 768, 64, 132), _narrow_enough(8, 2048, 64, 132)) == (32, 64)
    assert _narrow_enough(1, 64, 64, 132) == 16  # never below 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("tokens", "experts", "top_k"),
                         [(5, 8, 2), (17, 128, 8), (3, 6, 1), (1, 60, 4), (40, 16, 4)])
def test_route_kernel_matches_torch_route(dtype: torch.dtype, tokens: int, experts: int,
                                          top_k: int) -> None:
    """The one-launch routing against ``route``'s torch ops: the same experts in the same
    order (up to ties), weights within float32 rounding (exp and the sums; one ulp of the
    activation dtype where they are rounded to it), every option. (No dot product: bf16
    runs too.)"""
    from executor.kernels.moe.route import route_topk

    logits = torch.randn(tokens, experts, generator=_gen(experts)).to(dtype)
    for renormalize, rounded in ((True, True), (False, False), (True, False)):
        weights, ids = route_topk(logits, top_k, renormalize, rounded)
        want_w, want_ids = route(logits, top_k, renormalize, rounded)
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        # equal logits (frequent in bf16) tie: the kernel takes the lowest index first,
        # torch.topk's order among equals is its own. Slot by slot the same probability.
        probs = torch.softmax(logits.float(), dim=-1)
        assert torch.equal(probs.gather(1, ids.long()), probs.gather(1, want_ids.long()))
        if dtype == torch.float32:
            assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_w, atol=1e-6 if not rounded else 4e-3,
                                   rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_route_kernel_orders_by_logit_then_lowest_index(dtype: torch.dtype) -> None:
    """The picks compare the logits' bits as integers: the largest logit first, the lowest
    index among equal ones (-0 equals +0), -inf last (probability 0), a logit far below
    the rest (probability 0 as well) still ranked above it; the weights are the float32
    softmax's probabilities of the picked columns."""
    from executor.kernels.moe.route import route_topk

    inf = float("inf")
    logits = torch.tensor([[0.5, -0.0, 0.0, -inf, 2.0, 0.5, -300.0, -0.0, -3.0, 1.0]],
                          dtype=dtype)
    weights, ids = route_topk(logits, 10, False, False)
    assert ids.tolist() == [[4, 9, 0, 5, 1, 2, 7, 8, 6, 3]]
    probs = torch.softmax(logits.float(), dim=-1)[0, ids[0].long()]
    torch.testing.assert_close(weights[0], probs, rtol=1e-6, atol=0.0)
    assert weights[0, -2:].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_moe_raw", "mixtral"])
def test_route_matches_transformers_router(kind: str) -> None:
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from executor.model.spec import spec_from_hf_config

    cfg = moe_config(kind)
    router = (MixtralTopKRouter if kind == "mixtral" else Qwen3MoeTopKRouter)(cfg)
    moe = spec_from_hf_config(cfg).moe
    assert moe is not None
    g = _gen(3)
    for dtype in (torch.float32, torch.bfloat16):
        router = router.to(dtype)
        with torch.no_grad():
            router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        x = torch.randn(11, cfg.hidden_size, generator=g).to(dtype)
        logits, want_w, want_ids = router(x)
        weights, ids = route(logits, moe.top_k, moe.renormalize,
                             moe.weights_in_activation_dtype)
        assert torch.equal(ids.long(), want_ids)
        assert weights.dtype == torch.float32
        assert torch.equal(weights, want_w.float())


def test_moe_model_fused_matches_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                       ) -> None:
    """A tiny Qwen3-MoE (one dense layer) in fp16: the fused kernels (``kernels="triton"``)
    against the eager path, prefill and decode; each path is the one that ran."""
    from executor.kernels.moe import fused, reference
    from executor.model import moe

    calls = {"fused": 0, "eager": 0}

    def counted(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(fused, "fused_moe", counted("fused", fused.fused_moe))
    monkeypatch.setattr(moe, "experts_reference",
                        counted("eager", reference.experts_reference))
    path = write_moe_model(tmp_path, "qwen3_moe")
    ex = Executor(ExecutorConfig(model=ModelConfig(source=str(path), dtype="float16"),
                                 device="cpu",
                                 cache=CacheConfig(kv_tokens=128, max_sequences=2,
                                                   max_context=64)))
    out = {}
    for choice in ("torch", "triton"):
        ex.model.kernels = choice  # type: ignore[attr-defined]
        prompts = {f"{choice}a": [3, 17, 99, 4, 250, 8, 41], f"{choice}b": [5, 6, 7]}
        got = []
        for phase, chunks in (("prefill", prompts), ("decode", {s: [11] for s in prompts})):
            alloc = ex.kv.allocate([(s, len(t)) for s, t in chunks.items()])
            batch = ex.build_batch(phase, [t for ts in chunks.values() for t in ts], alloc, [])
            batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens))
            got.append(ex.forward_logits(batch).float())
        ex.release(list(prompts))
        out[choice] = got
        # two forwards, two sparse layers each (layer 1 is dense)
        assert calls == {"fused": 4 if choice == "triton" else 0, "eager": 4}
    for got_fused, got_eager in zip(out["triton"], out["torch"], strict=True):
        torch.testing.assert_close(got_fused, got_eager, atol=2e-2, rtol=2e-2)


def test_fused_moe_custom_op_schema_fake_impl_and_trace() -> None:
    """``model_executor::fused_moe``: schema and fake impl (``opcheck``), and a Dynamo
    trace records it as one node whose output equals the eager call's."""
    from executor.kernels.moe import fused

    g = _gen(9)
    x = torch.randn(6, 32, generator=g).to(torch.float16)
    logits = torch.randn(6, 8, generator=g).to(torch.float16)
    w13, w2 = _weights(8, 32, 32, torch.float16, seed=3)
    args = (x, logits, w13, w2, 2, True, True)
    torch.library.opcheck(torch.ops.model_executor.fused_moe.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    want = fused.fused_moe(*args)
    graphs: list[Any] = []

    def backend(gm: torch.fx.GraphModule, _: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    got = torch.compile(lambda *a: fused.fused_moe(*a), backend=backend, fullgraph=True)(*args)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets == ["model_executor.fused_moe"]


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 128, 8), (7, 8, 2), (64, 16, 4),
                                                          (65, 16, 4)])
def test_route_align_equals_route_then_align(tokens: int, experts: int, top_k: int) -> None:
    """One launch up to ``ROUTE_ALIGN_MAX_TOKENS`` tokens (two past it): the same weights,
    ids and alignment as ``route_topk`` then ``align``."""
    from executor.kernels.moe.route import route_align, route_topk

    logits = torch.randn(tokens, experts, generator=_gen(tokens)).to(torch.float16)
    weights, ids, (sorted_ids, blocks, padded) = route_align(logits, top_k, True, True, 16)
    want_w, want_ids = route_topk(logits, top_k, True, True)
    assert torch.equal(weights, want_w) and torch.equal(ids, want_ids)
    want_sorted, want_blocks, want_padded = align(want_ids, experts, 16)
    assert torch.equal(padded, want_padded) and torch.equal(blocks, want_blocks)
    assert torch.equal(sorted_ids, want_sorted)
