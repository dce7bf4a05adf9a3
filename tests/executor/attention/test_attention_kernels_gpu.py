"""Triton and FlashInfer attention backends vs the torch_native reference on the GPU.

Every test runs once per kernel backend (the ``backend`` fixture; FlashInfer's runs are
skipped with a reason where it is not installed). Every case runs the kernel backend and
the reference on the same KV pool with fresh random K/V (never zeros): the kernel backend
first, checking that it stored exactly the new K/V, then torch_native (which stores the
same values again). Sequences sit in scattered request slots at scattered locations, and
every table entry past a sequence's length points at some other valid location, so a read
past the end changes the result instead of reading zeros.

Kernels compile per (dtype, head_dim) and a few flags, not per shape, so the shape
sweeps stay cheap; the Triton half runs in well under a minute on an H100.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import pytest
import torch

from executor.api import Phase
from executor.attention import create_backend
from executor.attention.base import AttentionShape
from executor.attention.torch_native import TorchNativeBackend
from executor.forward_batch import ForwardBatch
from executor.kv.manager import Allocation, Extension
from executor.kv.pool import KVPool, ReqToTokenTable

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")


DEVICE = torch.device("cuda")
LAYER = 1  # of 2: catches a kernel that ignores the layer's pool
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
LLAMA_1B = (32, 8, 64)  # heads, kv_heads, head_dim
# (heads, kv_heads): GQA ratios 1, 4 and 8, and SmolLM2-135M's 9 and 3 (a group of three:
# not a power of two, so the kernels' head blocks are masked).
GQA_SHAPES = [(8, 8), (32, 8), (32, 4), (9, 3)]


@pytest.fixture(params=["triton", "flashinfer"])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    if name == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed (see docs/flashinfer.md)")
    return name


@dataclass
class Setup:
    """A two-layer pool of random K/V and a table whose every slot row is fully mapped."""

    shape: AttentionShape
    pool: KVPool
    table: ReqToTokenTable
    slots: list[int]  # slots in a scattered order; sequence i lives in slots[i]

    @staticmethod
    def make(num_seqs: int, max_context: int, heads: int, kv_heads: int, head_dim: int,
             dtype: torch.dtype, seed: int = 0) -> Setup:
        torch.manual_seed(seed)
        num_slots = num_seqs + 3
        num_locations = num_slots * max_context
        pool = KVPool(2, num_locations, kv_heads, head_dim, dtype, DEVICE)
        pool.k_buffer.normal_()
        pool.v_buffer.normal_()
        table = ReqToTokenTable(num_slots, max_context, DEVICE)
        # Distinct, scattered locations 1..num_locations over every (slot, position).
        perm = torch.randperm(num_locations, device=DEVICE).to(torch.int32) + 1
        table.device_table.copy_(perm.view(num_slots, max_context))
        slots = torch.randperm(num_slots)[:num_seqs].tolist()
        shape = AttentionShape(heads, kv_heads, head_dim, head_dim**-0.5)
        return Setup(shape, pool, table, slots)

    def batch(self, phase: Phase, prefix_lens: list[int], new_lens: list[int]) -> ForwardBatch:
        """Sequence i extends ``prefix_lens[i]`` cached tokens by ``new_lens[i]`` tokens."""
        exts, locs = [], []
        for i, (p, n) in enumerate(zip(prefix_lens, new_lens, strict=True)):
            slot = self.slots[i]
            exts.append(Extension(f"s{i}", slot, p, n, p == 0))
            locs.append(self.table.device_table[slot, p : p + n])
        out_loc = torch.cat(locs).to(torch.int64)
        alloc = Allocation(tuple(exts), out_loc.cpu())
        return ForwardBatch.build(phase, [0] * int(out_loc.numel()), alloc, [], DEVICE,
                                  self.table.max_context)

    def qkv(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Random q, k, v as views of one fused QKV projection, as the model passes them."""
        h, kvh, d = self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim
        qkv = torch.randn(num_tokens, (h + 2 * kvh) * d, device=DEVICE, dtype=self.pool.dtype)
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=1)
        return q.view(-1, h, d), k.view(-1, kvh, d), v.view(-1, kvh, d)


def _check(setup: Setup, batch: ForwardBatch, backend: str = "triton") -> None:
    q, k, v = setup.qkv(batch.num_tokens)
    pool = setup.pool
    expect_k, expect_v = pool.k[LAYER].clone(), pool.v[LAYER].clone()
    expect_k[batch.out_cache_loc], expect_v[batch.out_cache_loc] = k, v

    tri = create_backend(backend, setup.shape, pool, setup.table)
    assert tri.name == backend
    out = tri.forward(q, k, v, LAYER, tri.build_metadata(batch))
    assert torch.equal(pool.k[LAYER], expect_k) and torch.equal(pool.v[LAYER], expect_v), (
        "the new K/V were not stored exactly at out_cache_loc")

    ref_backend = TorchNativeBackend(setup.shape, pool, setup.table)
    ref = ref_backend.forward(q, k, v, LAYER, ref_backend.build_metadata(batch))
    tol = TOLERANCE[pool.dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def _random_lens(n: int, low: int, high: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (n,), generator=gen).tolist()


# -- decode ----------------------------------------------------------------------------------
def _check_decode(backend: str, context_lens: list[int], heads: int, kv_heads: int,
                  head_dim: int, dtype: torch.dtype, seed: int = 0) -> None:
    """``context_lens`` include the new token (1 = the new token alone)."""
    setup = Setup.make(len(context_lens), max(context_lens), heads, kv_heads, head_dim, dtype,
                       seed)
    _check(setup, setup.batch("decode", [n - 1 for n in context_lens], [1] * len(context_lens)),
           backend)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA_SHAPES)
def test_decode_configs(backend: str, dtype: torch.dtype, head_dim: int, heads: int,
                       kv_heads: int) -> None:
    _check_decode(backend, [1, 7, 64, 500, 2048], heads, kv_heads, head_dim, dtype)


@pytest.mark.parametrize("context_lens", [
    [1], [7], [64], [500], [2048], [8192],  # batch 1: the most splits
    [8192, 1, 513],
    _random_lens(16, 1, 8192, seed=1),  # a few splits per sequence
    _random_lens(64, 1, 2048, seed=2),  # one split per sequence: no reduction
    _random_lens(256, 1, 1024, seed=3),
], ids=lambda lens: f"bs{len(lens)}-max{max(lens)}")
def test_decode_lengths(backend: str, context_lens: list[int]) -> None:
    _check_decode(backend, context_lens, *LLAMA_1B, torch.bfloat16)


# -- extend / prefill ------------------------------------------------------------------------
def _check_extend(backend: str, prefix_lens: list[int], new_lens: list[int], heads: int,
                  kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0) -> None:
    max_context = max(p + n for p, n in zip(prefix_lens, new_lens, strict=True))
    setup = Setup.make(len(prefix_lens), max_context, heads, kv_heads, head_dim, dtype, seed)
    _check(setup, setup.batch("prefill", prefix_lens, new_lens), backend)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA_SHAPES)
def test_extend_configs(backend: str, dtype: torch.dtype, head_dim: int, heads: int,
                       kv_heads: int) -> None:
    # Pure prefills, chunked prefills (with a cached prefix) and a decode-like row.
    _check_extend(backend, [0, 0, 64, 500, 37], [1, 130, 7, 200, 64], heads, kv_heads,
                  head_dim, dtype)


@pytest.mark.parametrize(("prefix_lens", "new_lens"), [
    ([0], [1]), ([0], [7]), ([0], [500]), ([0], [2048]),  # pure prefill
    ([2048], [512]),  # a second chunk
    ([6000], [2192]),  # a last chunk up to 8192
    ([0, 1, 8000, 300], [8192, 1, 192, 64]),
    (_random_lens(64, 0, 1000, seed=4), _random_lens(64, 1, 300, seed=5)),
], ids=lambda lens: f"bs{len(lens)}-max{max(lens)}")
def test_extend_lengths(backend: str, prefix_lens: list[int], new_lens: list[int]) -> None:
    _check_extend(backend, prefix_lens, new_lens, *LLAMA_1B, torch.bfloat16)


# -- CUDA graph ------------------------------------------------------------------------------
@pytest.mark.parametrize(("bucket", "replays"), [
    # Lengths change between replays, from 1 up to the table's max context.
    (1, [[10], [8192], [1]]),
    (8, [[5, 900, 1, 8192, 77], [300] * 8, [8192, 2, 4096]]),
])
def test_decode_graph_replay_matches_eager(backend: str, bucket: int,
                                           replays: list[list[int]]) -> None:
    heads, kv_heads, head_dim = LLAMA_1B
    setup = Setup.make(8, 8192, heads, kv_heads, head_dim, torch.bfloat16)
    tri = create_backend(backend, setup.shape, setup.pool, setup.table)
    tri.init_graph_buffers(max_batch=8, max_tokens=8)
    meta = tri.capture_metadata("decode", bucket, bucket)

    # Static inputs the graph reads; warm up (compiles) outside the capture.
    q_s, k_s, v_s = (t.clone() for t in setup.qkv(bucket))
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tri.forward(q_s, k_s, v_s, LAYER, meta)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = tri.forward(q_s, k_s, v_s, LAYER, meta)

    for context_lens in replays:
        real = len(context_lens)
        batch = setup.batch("decode", [n - 1 for n in context_lens], [1] * real)
        q, k, v = setup.qkv(real)
        for static, new in ((q_s, q), (k_s, k), (v_s, v)):
            static.normal_()  # garbage in the padded rows
            static[:real].copy_(new)
        tri.refresh_metadata(meta, batch)
        k_before = setup.pool.k[LAYER].clone()
        graph.replay()
        graph_out = out_s[:real].clone()
        # Only the real rows' locations and the reserved location 0 were written.
        changed = (setup.pool.k[LAYER] != k_before).flatten(1).any(1).nonzero().flatten()
        allowed = torch.cat([batch.out_cache_loc, torch.zeros(1, dtype=torch.int64,
                                                               device=DEVICE)])
        assert bool(torch.isin(changed, allowed).all())
        assert torch.equal(setup.pool.k[LAYER][batch.out_cache_loc], k)

        eager = tri.forward(q, k, v, LAYER, tri.build_metadata(batch))
        torch.testing.assert_close(graph_out, eager, atol=2e-2, rtol=2e-2)
        ref_backend = TorchNativeBackend(setup.shape, setup.pool, setup.table)
        ref = ref_backend.forward(q, k, v, LAYER, ref_backend.build_metadata(batch))
        torch.testing.assert_close(graph_out, ref, atol=2e-2, rtol=2e-2)


def test_prefill_capture_only_where_the_backend_has_a_fixed_grid_kernel(backend: str
                                                                       ) -> None:
    """Triton captures prefill (graph mode ``fixed_grid``: static extend buffers and
    capture metadata for a token bucket); FlashInfer captures decode only."""
    setup = Setup.make(1, 16, *LLAMA_1B, torch.bfloat16)
    att = create_backend(backend, setup.shape, setup.pool, setup.table)
    att.init_graph_buffers(4, 4)
    if backend == "flashinfer":
        with pytest.raises(NotImplementedError):
            att.init_graph_buffers(64, 64, "prefill")
        with pytest.raises(NotImplementedError):
            att.capture_metadata("prefill", 4, 64)
        assert att.capturable == frozenset({"decode"})
        return
    assert att.capturable == frozenset({"decode", "prefill"})
    att.init_graph_buffers(64, 64, "prefill")
    meta = att.capture_metadata("prefill", 64, 64)
    assert meta.out_cache_loc.shape == (64,)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="exceeds the graph buffers"):
        att.capture_metadata("prefill", 128, 128)
