"""Triton attention kernels on CPU through Triton's interpreter, against torch_native.

Checks the kernels' indexing and masking logic at tiny shapes (fp16 only: the
interpreter's bf16 ``tl.dot`` returns garbage as of Triton 3.9). Skipped when Triton is not
installed, and on CUDA machines, where ``test_attention_kernels_gpu.py`` (beside this file)
runs the compiled kernels instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: the gpu tests cover the compiled kernels",
                allow_module_level=True)
# Triton decides at import time whether its own library functions (tl.sum, ...) are
# interpreted, so TRITON_INTERPRET must be set before the first ``import triton``; it stays
# set, as the interpreter reads it again at each launch.
if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="triton is not installed")
if type(triton.language.sum).__name__ != "InterpretedFunction":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (set it in the "
                "environment or run this file in its own process)", allow_module_level=True)

from executor.attention.base import AttentionShape  # noqa: E402
from executor.attention.torch_native import TorchNativeBackend  # noqa: E402
from executor.attention.triton_backend import TritonBackend  # noqa: E402
from executor.kv.pool import KVPool, ReqToTokenTable  # noqa: E402
from tests.helpers.attention_cases import paged_case  # noqa: E402

DTYPE = torch.float16


LAYER = 1  # of 2: catches a kernel that ignores the layer's pool


def _check(prefix_lens: list[int], new_lens: list[int], heads: int, kv_heads: int,
           head_dim: int, seed: int = 0, num_sms: int | None = None, shared: int = 0) -> None:
    pool, table, batch = paged_case(prefix_lens, new_lens, heads, kv_heads, head_dim, seed,
                                    shared=shared)
    shape = AttentionShape(heads, kv_heads, head_dim, head_dim**-0.5)
    gen = torch.Generator().manual_seed(seed + 1)
    # q/k/v as views of one fused QKV projection, like the model passes them.
    qkv = torch.randn(batch.num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q, k, v = qkv.to(DTYPE).split([heads * head_dim, kv_heads * head_dim,
                                   kv_heads * head_dim], dim=1)
    q = q.view(-1, heads, head_dim)
    k, v = k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)

    expect_k, expect_v = pool.k_buffer.clone(), pool.v_buffer.clone()
    expect_k[LAYER, batch.out_cache_loc], expect_v[LAYER, batch.out_cache_loc] = k, v
    tri = TritonBackend(shape, pool, table)
    if num_sms is not None:
        tri.num_sms = num_sms  # steers the split count
    meta = tri.build_metadata(batch)
    out = tri.forward(q, k, v, LAYER, meta)
    assert torch.equal(pool.k_buffer, expect_k) and torch.equal(pool.v_buffer, expect_v)
    # Into rows of a larger static buffer, as graph pieces call it: the same values, and
    # nothing written past the batch's rows.
    n = batch.num_tokens
    into = torch.full((n + 3, heads, head_dim), float("nan"), dtype=DTYPE)
    tri.forward_into(q, k, v, into[:n], LAYER, meta)
    assert torch.equal(into[:n], out) and into[n:].isnan().all()
    # padded_rows_ok: q/k/v/out with padding rows after the batch's (as graph pieces
    # padded to a bucket pass them): real rows as before, padding neither read into
    # real rows, nor written, nor stored.
    assert tri.padded_rows_ok

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((x, 100 * torch.randn((3, *x.shape[1:]), generator=gen).to(DTYPE)))

    padded_out = torch.full((n + 3, heads, head_dim), float("nan"), dtype=DTYPE)
    tri.forward_into(pad(q), pad(k), pad(v), padded_out, LAYER, meta)
    assert torch.equal(padded_out[:n], out) and padded_out[n:].isnan().all()
    assert torch.equal(pool.k_buffer, expect_k) and torch.equal(pool.v_buffer, expect_v)

    ref_backend = TorchNativeBackend(shape, pool, table)
    ref = ref_backend.forward(q, k, v, LAYER, ref_backend.build_metadata(batch))
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(("prefix_lens", "heads", "kv_heads", "head_dim", "num_sms"), [
    ([1], 4, 4, 16, None),  # only the first token is cached
    ([5, 40, 130], 8, 2, 16, None),  # several splits, a partial last split, idle splits
    ([70, 3], 4, 1, 24, None),  # head_dim not a power of two
    ([5, 130], 8, 2, 16, 1),  # one split per sequence: no reduction kernel
    ([5, 40, 130], 9, 3, 16, None),  # SmolLM2's group of three: a masked head block
])
def test_decode_interpreted(prefix_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                            num_sms: int | None) -> None:
    _check(prefix_lens, [1] * len(prefix_lens), heads, kv_heads, head_dim, num_sms=num_sms)


@pytest.mark.parametrize(("prefix_lens", "new_lens", "heads", "kv_heads", "head_dim"), [
    ([0], [9], 2, 1, 16),  # pure prefill
    ([0, 20, 70], [70, 5, 1], 4, 2, 16),  # prefill, chunked prefill, a decode-like row
    ([65], [3], 2, 2, 24),
    ([0, 3], [150, 140], 2, 1, 24),  # more new tokens than one query block
    ([0, 20], [70, 5], 9, 3, 16),  # SmolLM2's 9 query and 3 KV heads
])
def test_extend_interpreted(prefix_lens: list[int], new_lens: list[int], heads: int,
                            kv_heads: int, head_dim: int) -> None:
    _check(prefix_lens, new_lens, heads, kv_heads, head_dim)


@pytest.mark.parametrize(("prefix_lens", "new_lens"), [
    ([60, 60, 33], [1, 1, 1]),  # forks decoding over a shared prefix
    ([50, 20, 50], [6, 3, 1]),  # forks extended over a shared prefix
])
def test_forks_sharing_a_prefix_interpreted(prefix_lens: list[int], new_lens: list[int]
                                            ) -> None:
    """Sequences whose table rows point at the same prefix locations (Fork): read as
    any other location, no copy."""
    _check(prefix_lens, new_lens, 4, 2, 16, shared=40)


def test_decode_graph_hooks_interpreted() -> None:
    """capture_metadata pads; refresh_metadata rewrites the same buffers in place."""
    pool, table, batch = paged_case([33, 6], [1, 1], 4, 2, 16, seed=3)
    shape = AttentionShape(4, 2, 16, 0.25)
    tri = TritonBackend(shape, pool, table)
    tri.init_graph_buffers(max_batch=4, max_tokens=4)
    meta = tri.capture_metadata("decode", 4, 4)
    assert meta.seq_lens.tolist() == [1, 1, 1, 1] and meta.out_cache_loc.tolist() == [0] * 4
    ptr = meta.seq_lens.data_ptr()
    tri.refresh_metadata(meta, batch)
    assert meta.seq_lens.data_ptr() == ptr
    assert meta.seq_lens.tolist() == [34, 7, 1, 1]
    assert meta.out_cache_loc.tolist()[:2] == batch.out_cache_loc.tolist()
    assert meta.out_cache_loc.tolist()[2:] == [0, 0]
    assert meta.slots.tolist()[:2] == batch.slots.tolist()
    # A batch without the packed decode rows (not built by ForwardBatch.build) refreshes
    # the same rows through its separate tensors.
    assert batch.decode_rows is not None
    tri.capture_metadata("decode", 4, 4)
    tri.refresh_metadata(meta, dataclasses.replace(batch, decode_rows=None))
    assert meta.seq_lens.tolist() == [34, 7, 1, 1]
    assert meta.slots.tolist()[:2] == batch.slots.tolist()
    assert meta.out_cache_loc.tolist()[:2] == batch.out_cache_loc.tolist()

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(4, 4, 16, generator=gen).to(DTYPE)
    k, v = (torch.randn(4, 2, 16, generator=gen).to(DTYPE) for _ in range(2))
    before = pool.k_buffer[LAYER].clone()
    out = tri.forward(q, k, v, LAYER, meta)
    # Padded rows wrote location 0 only.
    changed = (pool.k_buffer[LAYER] != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= {0, *batch.out_cache_loc.tolist()}
    eager = tri.forward(q[:2], k[:2], v[:2], LAYER, tri.build_metadata(batch))
    torch.testing.assert_close(out[:2].float(), eager.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(("prefix_lens", "heads", "kv_heads", "head_dim", "num_sms"), [
    ([5, 40, 130], 8, 2, 16, None),  # several splits: each rotates its own q
    ([1, 70], 4, 1, 24, 1),  # one cached token; head_dim not a power of two; one split
    ([5, 130], 9, 3, 16, None),  # SmolLM2's group of three
])
def test_decode_with_fused_rope_interpreted(prefix_lens: list[int], heads: int, kv_heads: int,
                                            head_dim: int, num_sms: int | None) -> None:
    """``fuse_decode_rope``: q and k given unrotated, rotated in the decode kernel at each
    sequence's new position, give the same output and the same stored key as rotating
    them first (``TorchOps.rope``, the torch ops' rounding) and running the plain kernel."""
    from executor.model.layers import RotaryEmbedding, TorchOps
    from executor.model.spec import RopeSpec

    pool, table, batch = paged_case(prefix_lens, [1] * len(prefix_lens), heads, kv_heads,
                                    head_dim, seed=3)
    shape = AttentionShape(heads, kv_heads, head_dim, head_dim**-0.5)
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(batch.num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q, k, v = qkv.to(DTYPE).split([heads * head_dim, kv_heads * head_dim,
                                   kv_heads * head_dim], dim=1)
    q = q.view(-1, heads, head_dim)
    k, v = k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)
    rotary = RotaryEmbedding(RopeSpec(theta=10000.0), head_dim, max(prefix_lens) + 8)
    positions = torch.tensor(prefix_lens)  # the new token of each sequence
    q_rot, k_rot = TorchOps().rope(positions, q, k, rotary.cos, rotary.sin, None, None, 0.0)

    plain = TritonBackend(shape, pool, table)
    fused = TritonBackend(shape, pool, table)
    fused.fuse_decode_rope(rotary.cos, rotary.sin)
    if num_sms is not None:
        plain.num_sms = fused.num_sms = num_sms
    meta = plain.build_metadata(batch)
    assert fused.fuses_rope(meta) and not plain.fuses_rope(meta)
    pool_before = pool.k_buffer.clone()
    want = plain.forward(q_rot, k_rot, v, LAYER, meta)
    stored = pool.k_buffer.clone()
    assert not torch.equal(stored, pool_before)  # the plain kernel stored the rotated key
    pool.k_buffer.copy_(pool_before)
    got = fused.forward(q, k, v, LAYER, fused.build_metadata(batch))
    assert torch.equal(pool.k_buffer, stored)  # the fused kernel stored the same key
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(("prefix_lens", "new_lens", "bucket"), [
    ([0], [9], 16),  # one sequence, a padded bucket
    ([0, 20, 70], [70, 5, 1], 96),  # the 2nd and 3rd start mid-block (70, 75)
    ([0, 3], [150, 140], 320),  # blocks of both sequences; the 2nd starts at 150
    ([4, 0, 9, 0, 30], [1, 1, 2, 63, 3], 80),  # five sequences share the first block
])
def test_fixed_grid_extend_interpreted(prefix_lens: list[int], new_lens: list[int],
                                       bucket: int) -> None:
    """Prefill graph mode ``fixed_grid``: the kernel whose grid the bucket fixes, on
    metadata refreshed into the static buffers, equals the eager kernel on the batch's
    rows (exactly where each sequence starts on a block edge), writes no padding row,
    stores exactly the batch's new K/V; a later, smaller batch in the same buffers too."""
    heads, kv_heads, head_dim = 4, 2, 16
    shape = AttentionShape(heads, kv_heads, head_dim, head_dim**-0.5)
    pool, table, batch = paged_case(prefix_lens, new_lens, heads, kv_heads, head_dim, seed=5)
    tri = TritonBackend(shape, pool, table)
    tri.init_graph_buffers(bucket, bucket, "prefill")
    meta = tri.capture_metadata("prefill", bucket, bucket)
    # The capture dummy: one sequence over the whole bucket, stored at location 0.
    assert meta.seq_rows[:, 0].tolist() == [0, 0, 0, bucket, 0]  # type: ignore[attr-defined]
    assert not meta.seq_rows[3, 1:].any()  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(6)
    n = batch.num_tokens

    def qkv(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.randn(rows, heads, head_dim, generator=gen).to(DTYPE),
                torch.randn(rows, kv_heads, head_dim, generator=gen).to(DTYPE),
                torch.randn(rows, kv_heads, head_dim, generator=gen).to(DTYPE))

    q, k, v = qkv(bucket)  # rows past n: the bucket's padding tokens
    before_k, before_v = pool.k_buffer.clone(), pool.v_buffer.clone()
    eager = tri.forward(q[:n], k[:n], v[:n], LAYER, tri.build_metadata(batch))
    expect_k, expect_v = pool.k_buffer.clone(), pool.v_buffer.clone()
    pool.k_buffer.copy_(before_k)
    pool.v_buffer.copy_(before_v)
    ptr = meta.seq_rows.data_ptr()  # type: ignore[attr-defined]
    tri.refresh_metadata(meta, batch)
    assert meta.seq_rows.data_ptr() == ptr  # type: ignore[attr-defined]
    out = torch.full((bucket, heads, head_dim), float("nan"), dtype=DTYPE)
    tri.forward_into(q, k, v, out, LAYER, meta)
    assert torch.equal(pool.k_buffer, expect_k) and torch.equal(pool.v_buffer, expect_v)
    assert out[n:].isnan().all()
    torch.testing.assert_close(out[:n].float(), eager.float(), atol=2e-3, rtol=2e-3)
    # A batch without the packed (5, B) block refreshes field by field, to the same rows.
    assert batch.sequence_rows is not None
    rows = meta.seq_rows.clone()  # type: ignore[attr-defined]
    tri.refresh_metadata(meta, dataclasses.replace(batch, sequence_rows=None))
    assert torch.equal(meta.seq_rows, rows)  # type: ignore[attr-defined]
    starts = [0, *itertools.accumulate(new_lens)][:-1]
    for start, length in zip(starts, new_lens, strict=True):
        if start % 64 == 0:  # the same key blocks in the same order: the same bits
            assert torch.equal(out[start:start + length], eager[start:start + length])

    # A smaller batch next: the rows it does not have become padding again.
    pool2, table2, small = paged_case(prefix_lens[-2:], new_lens[-2:], heads, kv_heads,
                                      head_dim, seed=8)
    tri.pool, tri.table = pool2, table2
    tri.refresh_metadata(meta, small)
    assert not meta.seq_rows[3, small.batch_size:].any()  # type: ignore[attr-defined]
    m = small.num_tokens
    q2, k2, v2 = qkv(bucket)
    want = tri.forward(q2[:m], k2[:m], v2[:m], LAYER, tri.build_metadata(small))
    got = torch.full((bucket, heads, head_dim), float("nan"), dtype=DTYPE)
    tri.forward_into(q2, k2, v2, got, LAYER, meta)
    torch.testing.assert_close(got[:m].float(), want.float(), atol=2e-3, rtol=2e-3)
    assert got[m:].isnan().all()


def test_fixed_grid_refresh_refuses_a_batch_larger_than_the_bucket() -> None:
    pool, table, batch = paged_case([0], [40], 4, 2, 16, seed=9)
    tri = TritonBackend(AttentionShape(4, 2, 16, 0.25), pool, table)
    tri.init_graph_buffers(64, 64, "prefill")
    meta = tri.capture_metadata("prefill", 32, 32)
    with pytest.raises(ValueError, match="does not fit a bucket of 32 tokens"):
        tri.refresh_metadata(meta, batch)


def _backend(heads: int, kv_heads: int, max_context: int) -> TritonBackend:
    pool = KVPool(1, 8, kv_heads, 64, DTYPE, torch.device("cpu"))
    return TritonBackend(AttentionShape(heads, kv_heads, 64, 0.125), pool,
                         ReqToTokenTable(4, max_context, torch.device("cpu")))


def test_decode_context_tiers_follow_the_split_count() -> None:
    """A tier gets a twin graph where it cuts a bucket's split count at least threefold; a
    decode (graph or eager) launches for the smallest such tier its longest sequence fits."""
    small = _backend(9, 3, 4096)  # SmolLM2-135M's heads; 132 SMs assumed on CPU
    assert small.decode_context_tiers == (512,)
    assert [small.num_splits(1, c) for c in (512, 1024, None)] == [16, 32, 64]
    assert small.tier_helps(1, 512) and not small.tier_helps(1, 1024)  # 32: not a third
    assert [small.decode_tier(1, n) for n in (1, 300, 512, 513, 4000)] == \
        [512, 512, 512, None, None]
    # Several tiers: the smallest that holds the longest sequence and helps.
    small.decode_context_tiers = (256, 512, 1024)  # type: ignore[misc]
    assert small.tier_helps(1, 256)
    assert [small.decode_tier(1, n) for n in (200, 256, 257, 512, 513)] == \
        [256, 256, 512, 512, None]
    # Batch 2: 44 splits at the max context, 16 at 512 tokens (not a third).
    assert small.num_splits(2) == 44 and small.num_splits(2, 512) == 16
    assert not small.tier_helps(2, 512) and small.tier_helps(2, 256)  # 8 splits
    assert small.decode_tier(2, 400) is None and small.decode_tier(2, 200) == 256
    # Batch 8: 11 splits whatever the context: no tier.
    assert not any(small.tier_helps(8, t) for t in small.decode_context_tiers)
    # The 1B's heads: 33 splits at batch 1, 16 at 512 tokens.
    big = _backend(32, 8, 4096)
    assert big.num_splits(1) == 33 and not big.tier_helps(1, 512)
    # A table no longer than a tier: the general launch already fits it.
    short = _backend(9, 3, 512)
    assert not any(short.tier_helps(1, t) for t in short.decode_context_tiers)
    assert short.decode_tier(1, 100) is None


def test_decode_at_a_context_tier_interpreted() -> None:
    """A decode whose sequences fit a tier runs with the tier's split count (eagerly
    here; a twin graph the same), with the same result as the max context's count and
    the torch-native reference."""
    pool, table, batch = paged_case([40, 5], [1, 1], 8, 2, 16, seed=11)
    wide = ReqToTokenTable(table.max_sequences, 1000, torch.device("cpu"))
    wide.device_table[:, : table.max_context] = table.device_table
    shape = AttentionShape(8, 2, 16, 0.25)
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(2, 8, 16, generator=gen).to(DTYPE)
    k, v = (torch.randn(2, 2, 16, generator=gen).to(DTYPE) for _ in range(2))

    tri = TritonBackend(shape, pool, wide)
    tri.decode_context_tiers = (64,)  # type: ignore[misc]
    meta = tri.build_metadata(batch)
    assert tri.decode_tier(2, 41) == 64
    assert meta.partial_out.shape[2] == 2  # type: ignore[attr-defined]
    tiered = tri.forward(q, k, v, LAYER, meta)

    general = TritonBackend(shape, pool, wide)
    general.decode_context_tiers = ()  # type: ignore[misc]
    meta = general.build_metadata(batch)
    assert meta.partial_out.shape[2] == 32  # type: ignore[attr-defined]
    out = general.forward(q, k, v, LAYER, meta)
    torch.testing.assert_close(tiered.float(), out.float(), atol=2e-3, rtol=2e-3)

    ref_backend = TorchNativeBackend(shape, pool, table)
    ref = ref_backend.forward(q, k, v, LAYER, ref_backend.build_metadata(batch))
    torch.testing.assert_close(tiered.float(), ref.float(), atol=2e-3, rtol=2e-3)
