"""``fuse_decode_reduce`` on a GPU (marker ``gpu``): the split kernel merging its splits
itself (the last split program of each sequence and KV head) against the two-launch path,
launch after launch (a race would show as a wrong or NaN row now and then) and replayed
from a CUDA graph with changing lengths, with its counters back at zero; and whole
executors with the switch on and off, from full decode graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor.api import DecodeItem, PrefillItem, SamplingParams
from executor.executor import Executor
from tests.gpu.helpers import (
    LOGIT_ATOL,
    LOGIT_RTOL,
    MARGIN,
    gpu_model,
    make_prefill_executor,
    rand_tokens,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA")]

SCORED = SamplingParams(logprobs=True, top_logprobs=4)


@pytest.mark.parametrize(("heads", "kv_heads", "d", "splits"), [
    (32, 8, 64, 33),  # Llama-3.2-1B's heads at batch 1's split count
    (9, 3, 64, 8),
    (8, 1, 128, 64),  # MQA, the most splits
])
def test_fused_merge_equals_the_reduce_kernel(heads: int, kv_heads: int, d: int,
                                              splits: int) -> None:
    from executor.attention.triton_kernels.decode import decode_attention

    g = torch.Generator(device="cuda").manual_seed(5)
    dev, dt = "cuda", torch.bfloat16
    b, locs = 4, 8192
    pool_k = torch.randn(locs, kv_heads, d, generator=g, device=dev, dtype=dt)
    pool_v = torch.randn(locs, kv_heads, d, generator=g, device=dev, dtype=dt)
    table = torch.randperm(locs - 1, generator=g, device=dev)[: 4 * 2000].view(4, 2000)
    table = (table + 1).to(torch.int32)
    q = torch.randn(b, heads, d, generator=g, device=dev, dtype=dt)
    k_new = torch.randn(b, kv_heads, d, generator=g, device=dev, dtype=dt)
    v_new = torch.randn(b, kv_heads, d, generator=g, device=dev, dtype=dt)
    req = torch.tensor([2, 0, 3, 1], device=dev)
    seq_lens = torch.tensor([1, 70, 1999, 517], device=dev)  # idle splits in most rows
    loc = table[req, seq_lens - 1].to(torch.int64)
    counters = torch.zeros(b, kv_heads, dtype=torch.int32, device=dev)
    mid_o = torch.empty(b, heads, splits, d, device=dev)
    mid_lse = torch.empty(b, heads, splits, device=dev)

    def attend(out: torch.Tensor, fused: bool) -> None:
        decode_attention(q, k_new, v_new, pool_k, pool_v, table, req, seq_lens, loc, out,
                         mid_o, mid_lse, d ** -0.5, counters=counters if fused else None)

    want = torch.empty_like(q)
    attend(want, fused=False)
    got = torch.empty_like(q)
    for _ in range(200):  # many launches: a missed arrival or a stale read shows somewhere
        got.fill_(float("nan"))
        attend(got, fused=True)
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    assert not counters.any()

    # Captured once, replayed with other lengths: the counters start at zero each time.
    graph_out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attend(graph_out, fused=True)  # warm-up (compiles)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attend(graph_out, fused=True)
    for lens in ([1, 2, 3, 4], [1999, 1999, 1, 1000], [33, 64, 65, 1500]):
        seq_lens.copy_(torch.tensor(lens, device=dev))
        loc.copy_(table[req, seq_lens - 1].to(torch.int64))
        graph_out.fill_(float("nan"))
        graph.replay()
        attend(want, fused=False)
        torch.testing.assert_close(graph_out, want, atol=1e-2, rtol=1e-2)
        assert not counters.any()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gpu_model(tmp_path_factory.mktemp("fused-reduce"))


def _step(ex: Executor, ids: list[str], tokens: list[int]
          ) -> tuple[torch.Tensor, list[int], list[float]]:
    step = ex.decode([DecodeItem(s, t, SCORED) for s, t in zip(ids, tokens, strict=True)])
    tops = torch.tensor([[lp for _, lp in o.top_logprobs] for o in step.outputs])
    return (tops, [int(o.token_id) for o in step.outputs],  # type: ignore[arg-type]
            (tops[:, 0] - tops[:, 1]).tolist())


@pytest.mark.parametrize("decode", ["full", "disabled"])
def test_fused_reduce_matches_the_reduce_kernel(model_path: Path, decode: str) -> None:
    plain = make_prefill_executor(model_path, decode=decode, fuse_decode_reduce="off")
    fused = make_prefill_executor(model_path, decode=decode, fuse_decode_reduce="on")
    assert fused.fuses_decode_reduce and not plain.fuses_decode_reduce
    assert "fused_decode_reduce" in fused.model_info.kernel_features
    for ex in (plain, fused):
        if decode != "disabled":
            ex.capture(["decode"])
    ids = [f"s{i}" for i in range(5)]
    prompts = [rand_tokens(7 + 40 * i, seed=i) for i in range(5)]  # many idle splits
    firsts = []
    for ex in (plain, fused):
        out = ex.prefill([PrefillItem(s, p) for s, p in zip(ids, prompts, strict=True)])
        firsts.append([int(o.token_id) for o in out.outputs])  # type: ignore[arg-type]
    tokens = firsts[0]
    for _ in range(8):
        want, want_tokens, margins = _step(plain, ids, tokens)
        got, got_tokens, _ = _step(fused, ids, tokens)
        torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=LOGIT_RTOL)
        assert all(gt == wt for gt, wt, m in zip(got_tokens, want_tokens, margins, strict=True)
                   if m > MARGIN)
        tokens = want_tokens
    bufs = fused.attn.graph_buffers  # type: ignore[attr-defined]
    if bufs is not None:
        assert not bufs.split_counters.any()
