"""``BreakingAttention`` outside capture, on CPU: what the eager op between two graph
segments computes, over the torch-native backend.

A breakable replay runs the forward padded to its bucket while attention reads the real
batch bound to the ``BatchScope``; these tests run that op eagerly (the path warm-up runs
before capture), so the op's slicing, static buffers and output are checked without CUDA.
"""

from __future__ import annotations

import torch

from executor.attention.base import SCOPED, AttentionShape
from executor.attention.torch_native import TorchNativeBackend
from executor.forward_batch import ForwardBatch
from executor.graphs.breakable import BatchScope, BreakableGraphBackend, BreakingAttention
from tests.helpers.attention_cases import paged_case

HEADS, KV_HEADS, DIM, LAYER = 4, 2, 16, 1
DTYPE = torch.float32


def _setup(prefix_lens: list[int], new_lens: list[int], max_tokens: int
           ) -> tuple[BreakingAttention, TorchNativeBackend, BatchScope, ForwardBatch]:
    pool, table, batch = paged_case(prefix_lens, new_lens, HEADS, KV_HEADS, DIM, seed=3,
                                    dtype=DTYPE)
    shape = AttentionShape(HEADS, KV_HEADS, DIM, DIM**-0.5)
    inner = TorchNativeBackend(shape, pool, table)
    scope = BatchScope()
    graphs = BreakableGraphBackend(torch.device("cpu"))
    breaking = graphs.wrap_attention(inner, scope, max_tokens)
    assert isinstance(breaking, BreakingAttention)
    return breaking, inner, scope, batch


def _qkv(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=gen, dtype=DTYPE)
    q, k, v = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=1)
    return q.view(-1, HEADS, DIM), k.view(-1, KV_HEADS, DIM), v.view(-1, KV_HEADS, DIM)


def test_padded_forward_attends_real_tokens_only() -> None:
    """Rows past the bound batch's tokens (bucket padding) neither store K/V nor change
    the real rows, which equal the inner backend's eager output."""
    breaking, inner, scope, batch = _setup([0, 7], [5, 3], max_tokens=16)
    n, bucket = batch.num_tokens, 12
    q, k, v = _qkv(bucket, seed=4)
    pool = inner.pool
    before = pool.k_buffer.clone()
    ref_pool_k = before.clone()
    ref_pool_k[LAYER, batch.out_cache_loc] = k[:n]
    with scope.bind(inner.build_metadata(batch), n):
        out = breaking.forward(q, k, v, LAYER, meta=SCOPED)
    assert out.shape == (bucket, HEADS, DIM)
    assert torch.equal(pool.k_buffer, ref_pool_k), "padding stored K, or a real row did not"
    # The reference sees the same pool the op left (its own store rewrites the same rows).
    ref = inner.forward(q[:n], k[:n], v[:n], LAYER, inner.build_metadata(batch))
    torch.testing.assert_close(out[:n], ref)


def test_each_call_attends_the_token_count_bound_for_it() -> None:
    """The same op bound to fewer tokens attends only those (a stale row count would
    attend or store the wrong rows); the metadata argument plays no part."""
    breaking, inner, scope, batch = _setup([2], [6], max_tokens=16)
    q, k, v = _qkv(8, seed=5)
    with scope.bind(inner.build_metadata(batch), batch.num_tokens):
        out_a = breaking.forward(q, k, v, LAYER, meta=object())  # type: ignore[arg-type]
    with scope.bind(inner.build_metadata(batch), batch.num_tokens):
        out_b = breaking.forward(q, k, v, LAYER, meta=SCOPED)
    assert torch.equal(out_a[:6], out_b[:6])
    short, short_inner, short_scope, short_batch = _setup([2], [3], max_tokens=16)
    with short_scope.bind(short.build_metadata(short_batch), 3):
        out_c = short.forward(q, k, v, LAYER, meta=SCOPED)  # 8 rows in, 3 real
    ref = short_inner.forward(q[:3], k[:3], v[:3], LAYER,
                              short_inner.build_metadata(short_batch))
    torch.testing.assert_close(out_c[:3], ref)
