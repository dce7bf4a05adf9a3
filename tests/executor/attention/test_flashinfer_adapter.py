"""The ``flashinfer`` backend's adapter logic on CPU, over ``tests/helpers/fake_flashinfer.py``.

Checks what is ours: the page table gathered from the request-slot table (stale entries
past each length must not be read), the new K/V stored at ``out_cache_loc``, padded graph
rows (one page, the reserved location), re-planning into fixed buffers whose addresses
never change, and the probe's verdicts. The kernels themselves are FlashInfer's and are
checked on a GPU (``test_attention_kernels_gpu.py``, ``test_flashinfer_gpu.py`` beside
this file).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from executor.attention import create_backend
from executor.attention.base import AttentionShape
from executor.attention.torch_native import TorchNativeBackend
from executor.kv.allocator import RESERVED_LOCATION
from tests.helpers import fake_flashinfer
from tests.helpers.attention_cases import paged_case

DTYPE = torch.bfloat16
LAYER = 1  # of 2
TOL = 2e-2


@pytest.fixture(autouse=True)
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    fake_flashinfer.PLANS.clear()
    yield fake_flashinfer


def _qkv(tokens: int, heads: int, kv_heads: int, dim: int, seed: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as strided views of one fused projection, as the model passes them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(DTYPE)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    return q.view(-1, heads, dim), k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)


@pytest.mark.parametrize(("prefix_lens", "new_lens", "heads", "kv_heads", "dim", "shared"), [
    ([5, 40, 130], [1, 1, 1], 8, 2, 16, 0),  # decode
    ([0], [9], 4, 1, 16, 0),  # one prefill
    ([0, 20, 70], [70, 5, 1], 4, 2, 16, 0),  # prefill, chunked prefill, a decode-like row
    ([65, 0], [3, 1], 8, 8, 32, 0),  # a one-token prefill (phase prefill, no prefix)
    ([60, 60, 33], [1, 1, 1], 8, 2, 16, 40),  # forks: decode over a shared prefix
    ([50, 20, 50], [6, 3, 1], 4, 2, 16, 20),  # forks extended over a shared prefix
])
def test_eager_equals_torch_native(prefix_lens: list[int], new_lens: list[int], heads: int,
                                   kv_heads: int, dim: int, shared: int) -> None:
    pool, table, batch = paged_case(prefix_lens, new_lens, heads, kv_heads, dim, seed=1,
                                    dtype=DTYPE, shared=shared)
    shape = AttentionShape(heads, kv_heads, dim, dim**-0.5)
    q, k, v = _qkv(batch.num_tokens, heads, kv_heads, dim, seed=2)
    expect_k = pool.k_buffer.clone()
    expect_k[LAYER, batch.out_cache_loc] = k

    fi = create_backend("flashinfer", shape, pool, table)
    meta = fi.build_metadata(batch)
    assert fake_flashinfer.PLANS[-1]["batch"] == batch.batch_size  # one plan per forward
    out = fi.forward(q, k, v, LAYER, meta)
    assert torch.equal(pool.k_buffer, expect_k), "new K not stored exactly at out_cache_loc"
    n = batch.num_tokens
    into = torch.full((n + 2, heads, dim), float("nan"), dtype=DTYPE)
    fi.forward_into(q, k, v, into[:n], LAYER, meta)  # FlashInfer's out=: same values
    assert torch.equal(into[:n], out) and into[n:].isnan().all()
    assert len(fake_flashinfer.PLANS) == 1

    ref = TorchNativeBackend(shape, pool, table)
    torch.testing.assert_close(out.float(), ref.forward(q, k, v, LAYER,
                                                        ref.build_metadata(batch)).float(),
                               atol=TOL, rtol=TOL)


def test_decode_graph_hooks_replan_fixed_buffers() -> None:
    shape = AttentionShape(8, 2, 16, 0.25)
    pool, table, batch = paged_case([33, 6], [1, 1], 8, 2, 16, seed=3, dtype=DTYPE)
    fi = create_backend("flashinfer", shape, pool, table)
    fi.init_graph_buffers(max_batch=4, max_tokens=4)
    bufs = fi.graph_buffers  # type: ignore[attr-defined]
    meta = fi.capture_metadata("decode", 4, 4)
    # Captured over padding only: four rows of one page each, the reserved location.
    assert bufs.indptr[:5].tolist() == [0, 1, 2, 3, 4]
    assert bufs.indices[:4].tolist() == [RESERVED_LOCATION] * 4
    assert meta.out_cache_loc.tolist() == [RESERVED_LOCATION] * 4  # type: ignore[attr-defined]
    addresses = [t.data_ptr() for t in (bufs.indptr, bufs.indices, bufs.out_cache_loc)]

    fi.refresh_metadata(meta, batch)
    assert [t.data_ptr() for t in (bufs.indptr, bufs.indices, bufs.out_cache_loc)] == addresses
    assert bufs.indptr[:5].tolist() == [0, 34, 41, 42, 43]  # real rows, then pad rows
    slots = batch.slots_host
    real_pages = torch.cat([table.device_table[slots[0], :34], table.device_table[slots[1], :7]])
    assert torch.equal(bufs.indices[:41], real_pages)  # stale entries past 34 / 7 not read
    assert bufs.indices[41:43].tolist() == [RESERVED_LOCATION] * 2
    assert meta.out_cache_loc[:2].tolist() == batch.out_cache_loc.tolist()  # type: ignore[attr-defined]
    assert meta.out_cache_loc[2:].tolist() == [RESERVED_LOCATION] * 2  # type: ignore[attr-defined]

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(4, 8, 16, generator=gen).to(DTYPE)
    k, v = (torch.randn(4, 2, 16, generator=gen).to(DTYPE) for _ in range(2))
    before = pool.k_buffer[LAYER].clone()
    out = fi.forward(q, k, v, LAYER, meta)  # what a replay computes: it reads the buffers
    changed = (pool.k_buffer[LAYER] != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= {RESERVED_LOCATION, *batch.out_cache_loc.tolist()}
    eager = fi.forward(q[:2], k[:2], v[:2], LAYER, fi.build_metadata(batch))
    torch.testing.assert_close(out[:2].float(), eager.float(), atol=TOL, rtol=TOL)

    # The bucket keeps its wrapper; a second bucket gets its own over the same buffers.
    assert fi.capture_metadata("decode", 4, 4).wrapper is meta.wrapper  # type: ignore[attr-defined]
    assert fi.capture_metadata("decode", 2, 2).wrapper is not meta.wrapper  # type: ignore[attr-defined]


def test_graph_hook_misuse_is_refused() -> None:
    shape = AttentionShape(8, 2, 16, 0.25)
    pool, table, batch = paged_case([3, 4, 5], [1, 1, 1], 8, 2, 16, seed=4, dtype=DTYPE)
    fi = create_backend("flashinfer", shape, pool, table)
    with pytest.raises(RuntimeError, match="init_graph_buffers must run"):
        fi.capture_metadata("decode", 2, 2)
    fi.init_graph_buffers(max_batch=2, max_tokens=2)
    with pytest.raises(NotImplementedError, match="decode only"):
        fi.capture_metadata("prefill", 2, 64)
    with pytest.raises(ValueError, match="exceeds the graph buffers' max batch 2"):
        fi.capture_metadata("decode", 4, 4)
    meta = fi.capture_metadata("decode", 2, 2)
    with pytest.raises(ValueError, match="batch of 3 does not fit a bucket of 2"):
        fi.refresh_metadata(meta, batch)
    assert fi.capturable == frozenset({"decode"})


def test_rejects_fp32_pools() -> None:
    pool, table, _ = paged_case([3], [1], 8, 2, 16, seed=5, dtype=torch.float32)
    with pytest.raises(ValueError, match="fp16 and bf16"):
        create_backend("flashinfer", AttentionShape(8, 2, 16, 0.25), pool, table)


def test_probe_accepts_correct_attention_and_reports_a_wrong_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from executor.attention.flashinfer_backend import probe

    cpu, shape = torch.device("cpu"), AttentionShape(8, 2, 16, 0.25)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)  # no device here
    assert probe(cpu, DTYPE, shape) is None

    monkeypatch.setattr(fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper, "run",
                        lambda self, q, kv: torch.zeros_like(q))
    why = probe(cpu, DTYPE, shape)
    assert why is not None and why.startswith("FlashInfer decode differs from SDPA by")

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper, "plan", broken)
    why = probe(cpu, DTYPE, shape)
    assert why == ("FlashInfer failed a probe attention on cpu: RuntimeError: no kernel "
                   "image is available for execution on the device")


def test_cuda_store_path_stores_exactly() -> None:
    """On CUDA the backend stores new K/V with the Triton store kernel; here it runs under
    Triton's interpreter (as ``scripts/test.sh`` sets it up) on strided q/k/v views."""
    triton = pytest.importorskip("triton", reason="triton is not installed")
    from executor.attention.flashinfer_backend import kv_store

    if type(triton.language.sum).__name__ != "InterpretedFunction":
        pytest.skip("needs TRITON_INTERPRET=1 set before triton is imported")
    pool, table, batch = paged_case([0, 20], [7, 5], 4, 2, 16, seed=6, dtype=torch.float16)
    shape = AttentionShape(4, 2, 16, 0.25)
    fi = create_backend("flashinfer", shape, pool, table)
    fi._store = kv_store(pool, triton=True)  # type: ignore[attr-defined]
    q, k, v = _qkv(batch.num_tokens, 4, 2, 16, seed=7)
    expect_k, expect_v = pool.k_buffer.clone(), pool.v_buffer.clone()
    expect_k[LAYER, batch.out_cache_loc] = k.to(torch.float16)
    expect_v[LAYER, batch.out_cache_loc] = v.to(torch.float16)
    fi.forward(q, k, v, LAYER, fi.build_metadata(batch))
    assert torch.equal(pool.k_buffer, expect_k) and torch.equal(pool.v_buffer, expect_v)
