"""``weight_prefetch`` on a GPU (marker ``gpu``; compute capability 9.0+): the decode
attention kernel's L2 prefetch of the weights after it changes no bit. Same weights, same
prompts, prefetch on and off: identical log-probabilities and tokens at every decode step,
eagerly and replayed from full decode graphs, for the 1B's head layout and SmolLM2's
(9 query / 3 KV heads, hidden 576); and the attention kernel alone with the largest
plan (three regions) gives the same output and pool bits as without one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor.api import DecodeItem, PrefillItem, SamplingParams
from executor.executor import Executor
from tests.gpu.helpers import gpu_model, make_prefill_executor, rand_tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
                       reason="the bulk L2 prefetch needs compute capability 9.0+"),
]

SCORED = SamplingParams(logprobs=True, top_logprobs=4)


def _smollm2_like(root: Path) -> Path:
    import transformers as tf

    from executor.model.random_weights import write_random_model

    cfg = tf.LlamaConfig(vocab_size=1024, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=3, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5,
                         tie_word_embeddings=True)
    cfg.architectures = ["LlamaForCausalLM"]
    return write_random_model(root / "smollm2-like", cfg, seed=11)


@pytest.fixture(scope="module", params=["1b-heads", "smollm2-heads"])
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Path:
    root = tmp_path_factory.mktemp("weight-prefetch")
    return gpu_model(root) if request.param == "1b-heads" else _smollm2_like(root)


def _transcript(ex: Executor, steps: int = 8) -> tuple[list[list[int]], list[torch.Tensor]]:
    ids = [f"s{i}" for i in range(5)]
    prompts = [rand_tokens(9 + 37 * i, seed=i) for i in range(5)]
    out = ex.prefill([PrefillItem(s, p) for s, p in zip(ids, prompts, strict=True)])
    tokens = [[int(o.token_id) for o in out.outputs]]  # type: ignore[arg-type]
    tops = []
    for _ in range(steps):
        step = ex.decode([DecodeItem(s, t, SCORED) for s, t in zip(ids, tokens[-1],
                                                                   strict=True)])
        tokens.append([int(o.token_id) for o in step.outputs])  # type: ignore[arg-type]
        tops.append(torch.tensor([[lp for _, lp in o.top_logprobs] for o in step.outputs]))
    return tokens, tops


@pytest.mark.parametrize("decode", ["full", "disabled"])
def test_prefetch_changes_no_bit(model_path: Path, decode: str) -> None:
    runs = []
    for mode in ("off", "on"):
        ex = make_prefill_executor(model_path, decode=decode, weight_prefetch=mode)
        assert (ex.weight_prefetch_bytes > 0) == (mode == "on")
        assert ("weight_prefetch" in ex.model_info.kernel_features) == (mode == "on")
        if decode != "disabled":
            ex.capture(["decode"])
        runs.append(_transcript(ex))
    (want_tokens, want_tops), (got_tokens, got_tops) = runs
    assert got_tokens == want_tokens
    for got, want in zip(got_tops, want_tops, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(("batch", "heads", "kv_heads"), [(1, 32, 8), (5, 9, 3), (16, 8, 2)])
def test_the_kernel_with_three_regions_equals_it_without(batch: int, heads: int,
                                                         kv_heads: int) -> None:
    from executor.attention.triton_kernels import decode_attention, num_kv_splits
    from executor.kernels import l2

    torch.manual_seed(batch * 100 + heads)
    dev, dim, ctx = torch.device("cuda"), 64, 700
    locations = batch * ctx + 1
    pools = [torch.randn(locations, kv_heads, dim, device=dev, dtype=torch.bfloat16)
             for _ in range(2)]
    table = torch.arange(1, locations, device=dev, dtype=torch.int32)[:batch * ctx]
    table = table.view(batch, ctx).contiguous()
    lens = torch.randint(1, ctx + 1, (batch,), device=dev)
    q = torch.randn(batch, heads, dim, device=dev, dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(batch, kv_heads, dim, device=dev, dtype=torch.bfloat16)
                    for _ in range(2))
    rows = torch.arange(batch, device=dev)
    out_loc = table[rows, lens - 1].long()
    splits = num_kv_splits(batch, kv_heads, ctx,
                           torch.cuda.get_device_properties(dev).multi_processor_count)
    weights = [torch.randn(n, device=dev, dtype=torch.bfloat16) for n in (3 << 20, 8 << 20,
                                                                         5 << 20)]
    results = []
    for regions in ([], l2.plan(weights, 24 << 20)):
        k_pool, v_pool = (p.clone() for p in pools)
        out = torch.empty_like(q)
        mid_o = torch.empty(batch, heads, splits, dim, device=dev)
        mid_lse = torch.empty(batch, heads, splits, device=dev)
        decode_attention(q, k_new, v_new, k_pool, v_pool, table, rows, lens, out_loc, out,
                         mid_o, mid_lse, dim ** -0.5, prefetch=regions)
        torch.cuda.synchronize()
        results.append((out, k_pool, v_pool))
    assert len(l2.plan(weights, 24 << 20)) == 3
    for got, want in zip(results[1], results[0], strict=True):
        assert torch.equal(got, want)
