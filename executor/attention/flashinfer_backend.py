"""FlashInfer paged attention over our KV pools, with the same graph contract as Triton.

Our pools are FlashInfer's paged layout with page size 1 (``unsqueeze(1)`` of a layer's
pool is the ``NHD`` cache, no copy; a sequence's page list is its request-slot table row;
every page is full). Prefill / extend stores the new K/V, then
``BatchPrefillWithPagedKVCacheWrapper`` attends causally, eagerly. Decode runs
``BatchDecodeWithPagedKVCacheWrapper``; under a CUDA graph each batch bucket has its own
wrapper over fixed buffers, re-planned from the real batch outside the graph before each
replay (``refresh_metadata``). Page indices are gathered on the device with sizes known
on the host, so no step waits on the device; a padded decode row attends to the reserved
location 0 only and writes its K/V there. Design notes: docs/kernels.md.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from executor.api import Phase
from executor.attention.base import (
    KERNEL_DTYPES,
    AttentionBackend,
    AttentionMetadata,
    AttentionShape,
    bucket_buffers,
    check_decode_batch,
    check_kernel_pool,
    inner_contiguous,
)
from executor.attention.registry import Probe
from executor.forward_batch import ForwardBatch
from executor.kv.allocator import RESERVED_LOCATION
from executor.kv.pool import KVPool, ReqToTokenTable

# FlashInfer's float workspace (split-KV partial results); one serves every wrapper, since
# the forwards that use them run one after another on one stream.
WORKSPACE_BYTES = 128 * 1024 * 1024
# Decode uses tensor-core kernels from this many query heads per KV head up (FlashInfer's
# advice for grouped-query attention; Llama-3 has groups of 4 to 8).
_TENSOR_CORE_GROUP = 4
_LAYOUT = "NHD"
_PAGE_SIZE = 1
# FlashInfer's FA2 kernels for prefill and decode, named rather than "auto": auto may pick
# FA3 for prefill (sm90; much longer JIT, needs CUTLASS and curand headers) or cuDNN for
# eager decode, and a captured graph must keep the kernels it was captured with. FA3 for
# long prefills is left untried.
KERNELS = "fa2"


@dataclass(frozen=True)
class FlashInferMetadata(AttentionMetadata):
    """A planned wrapper plus where this batch's new K/V go. Eager metadata holds the
    backend's shared wrappers, so it is valid until the next ``build_metadata``."""

    wrapper: Any  # flashinfer.BatchPrefillWithPagedKVCacheWrapper or ...Decode...
    out_cache_loc: torch.Tensor  # (T,) int64
    batch_size: int


@dataclass
class DecodeGraphBuffers:
    """Fixed page-table buffers shared by every decode bucket's CUDA-graph wrapper (the
    bucket of ``bs`` rows uses the leading ``bs`` entries); replays run one at a time."""

    indptr: torch.Tensor  # (max_batch + 1,) int32
    indices: torch.Tensor  # (capacity,) int32: every real row's pages + one per pad row
    last_page_len: torch.Tensor  # (max_batch,) int32, all ones
    out_cache_loc: torch.Tensor  # (max_batch,) int64
    wrappers: dict[int, Any] = field(default_factory=dict)

    @property
    def max_batch(self) -> int:
        return int(self.last_page_len.shape[0])


class FlashInferBackend(AttentionBackend):
    name: ClassVar[str] = "flashinfer"
    capturable: ClassVar[frozenset[Phase]] = frozenset({"decode"})

    def __init__(self, shape: AttentionShape, pool: KVPool, table: ReqToTokenTable) -> None:
        super().__init__(shape, pool, table)
        check_kernel_pool(self.name, shape, pool)
        import flashinfer  # the optional extra; selection checked that it imports

        self._fi = flashinfer
        self.device = pool.k_buffer.device
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._tensor_cores = shape.num_heads // shape.num_kv_heads >= _TENSOR_CORE_GROUP
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, _LAYOUT, backend=KERNELS)
        self._decode = self._decode_wrapper()
        self._store = kv_store(pool, triton=self.device.type == "cuda")
        # Page-size-1 views of the pools: (locations + 1, 1, kv_heads, head_dim), no copy.
        self._pages = [(k.unsqueeze(1), v.unsqueeze(1)) for k, v in zip(pool.k, pool.v,
                                                                         strict=True)]
        self.graph_buffers: DecodeGraphBuffers | None = None

    # -- eager ---------------------------------------------------------------------------
    def build_metadata(self, batch: ForwardBatch) -> FlashInferMetadata:
        indptr, indices = self._page_table(batch, pad_rows=0)
        last_page_len = torch.ones(batch.batch_size, dtype=torch.int32)
        if batch.phase == "decode":
            check_decode_batch(self.name, batch)
            self._plan_decode(self._decode, indptr, indices, last_page_len)
            return FlashInferMetadata(self._decode, batch.out_cache_loc, batch.batch_size)
        qo_indptr = _indptr(batch.extend_lens_host)
        self._prefill.plan(
            qo_indptr, indptr, indices, last_page_len,
            self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim, _PAGE_SIZE,
            causal=True, sm_scale=self.shape.scale, q_data_type=self.pool.dtype,
            kv_data_type=self.pool.dtype,
        )
        return FlashInferMetadata(self._prefill, batch.out_cache_loc, batch.batch_size)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        if not isinstance(meta, FlashInferMetadata):
            raise TypeError(f"flashinfer backend got {type(meta).__name__}")
        self._store(layer_id, meta.out_cache_loc, k, v)
        out = meta.wrapper.run(q.contiguous(), self._pages[layer_id])
        return out if out.dtype == q.dtype else out.to(q.dtype)

    def forward_into(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, layer_id: int, meta: AttentionMetadata) -> None:
        """FlashInfer writes ``out`` itself (its ``out=``), so graph pieces copy nothing."""
        if not isinstance(meta, FlashInferMetadata):
            raise TypeError(f"flashinfer backend got {type(meta).__name__}")
        if out.dtype != q.dtype or not out.is_contiguous():
            super().forward_into(q, k, v, out, layer_id, meta)
            return
        self._store(layer_id, meta.out_cache_loc, k, v)
        meta.wrapper.run(q.contiguous(), self._pages[layer_id], out=out)

    # -- graph hooks -----------------------------------------------------------------------
    def init_graph_buffers(self, max_batch: int, max_tokens: int,
                           phase: Phase = "decode") -> None:
        """Fixed decode buffers for buckets of up to ``max_batch`` rows; idempotent while
        big enough (captured graphs keep their addresses). ``max_tokens`` is unused."""
        del max_tokens
        if phase != "decode":
            raise NotImplementedError(f"flashinfer attention captures decode only, not {phase}")
        if self.graph_buffers is not None and self.graph_buffers.max_batch >= max_batch:
            return
        # Pages of distinct sequences are distinct locations, so the real rows of a batch
        # hold at most every location once; each pad row adds the reserved one.
        capacity = min(max_batch * self.table.max_context, self.pool.num_locations + max_batch)
        i32, dev = torch.int32, self.device
        self.graph_buffers = DecodeGraphBuffers(
            indptr=torch.zeros(max_batch + 1, dtype=i32, device=dev),
            indices=torch.zeros(capacity, dtype=i32, device=dev),
            last_page_len=torch.ones(max_batch, dtype=i32, device=dev),
            out_cache_loc=torch.full((max_batch,), RESERVED_LOCATION, dtype=torch.int64,
                                     device=self.device),
        )

    def capture_metadata(self, phase: Phase, batch_size: int, num_tokens: int,
                         context_tier: int | None = None) -> FlashInferMetadata:
        del context_tier  # no tiers (``decode_context_tiers`` is empty)
        if phase != "decode":
            raise NotImplementedError(f"flashinfer attention captures decode only, not {phase}: "
                                      "extend attention runs eagerly between graph pieces")
        if num_tokens != batch_size:
            raise ValueError(f"decode has one token per row: {num_tokens} != {batch_size}")
        bufs = bucket_buffers(self.graph_buffers, batch_size)
        wrapper = bufs.wrappers.get(batch_size)
        if wrapper is None:
            wrapper = self._decode_wrapper(bufs, batch_size)
            bufs.wrappers[batch_size] = wrapper
        # Every row padding: one page, the reserved location.
        self._plan_decode(wrapper, _indptr([1] * batch_size),
                          torch.full((batch_size,), RESERVED_LOCATION, dtype=torch.int32,
                                     device=self.device),
                          torch.ones(batch_size, dtype=torch.int32))
        bufs.out_cache_loc[:batch_size].fill_(RESERVED_LOCATION)
        return FlashInferMetadata(wrapper, bufs.out_cache_loc[:batch_size], batch_size)

    def refresh_metadata(self, meta: AttentionMetadata, batch: ForwardBatch) -> None:
        """Re-plan the bucket's wrapper for ``batch`` (rows past it padding) and copy its
        ``out_cache_loc`` into the fixed buffer; runs outside the graph, no host sync."""
        assert isinstance(meta, FlashInferMetadata), type(meta).__name__
        size = meta.batch_size
        bufs = bucket_buffers(self.graph_buffers, size)
        assert bufs.wrappers.get(size) is meta.wrapper, "not capture metadata"
        check_decode_batch(self.name, batch)
        real = batch.batch_size
        if real > size:
            raise ValueError(f"batch of {real} does not fit a bucket of {size}")
        indptr, indices = self._page_table(batch, pad_rows=size - real)
        self._plan_decode(meta.wrapper, indptr, indices, torch.ones(size, dtype=torch.int32))
        bufs.out_cache_loc[:real].copy_(batch.out_cache_loc)
        bufs.out_cache_loc[real:size].fill_(RESERVED_LOCATION)

    # -- helpers ---------------------------------------------------------------------------
    def _decode_wrapper(self, bufs: DecodeGraphBuffers | None = None,
                        batch_size: int = 0) -> Any:
        if bufs is None:
            return self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, _LAYOUT, use_tensor_cores=self._tensor_cores, backend=KERNELS)
        # Each also holds an 8 MiB device + 8 MiB pinned scratch of FlashInfer's own.
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, _LAYOUT, use_cuda_graph=True, use_tensor_cores=self._tensor_cores,
            backend=KERNELS,
            paged_kv_indptr_buffer=bufs.indptr[: batch_size + 1],
            paged_kv_indices_buffer=bufs.indices,
            paged_kv_last_page_len_buffer=bufs.last_page_len[:batch_size],
        )

    def _plan_decode(self, wrapper: Any, indptr: torch.Tensor, indices: torch.Tensor,
                     last_page_len: torch.Tensor) -> None:
        wrapper.plan(
            indptr, indices, last_page_len,
            self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim, _PAGE_SIZE,
            pos_encoding_mode="NONE", sm_scale=self.shape.scale,
            q_data_type=self.pool.dtype, kv_data_type=self.pool.dtype,
        )

    def _page_table(self, batch: ForwardBatch, pad_rows: int) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
        """Host ``indptr`` over the sequences (then ``pad_rows`` rows of one page) and the
        device page list: ``table[slot, :seq_len]`` per sequence, then the reserved
        location once per pad row. Sizes come from the host, so nothing syncs."""
        lens_host = batch.seq_lens_host
        total = sum(lens_host)
        lens = batch.seq_lens
        rows = torch.repeat_interleave(batch.slots, lens, output_size=total)
        starts = torch.cumsum(lens, 0) - lens
        cols = (torch.arange(total, device=lens.device)
                - torch.repeat_interleave(starts, lens, output_size=total))
        indices = self.table.device_table[rows, cols]
        if pad_rows:
            pad = torch.full((pad_rows,), RESERVED_LOCATION, dtype=indices.dtype,
                             device=indices.device)
            indices = torch.cat((indices, pad))
        return _indptr(list(lens_host) + [1] * pad_rows), indices



KVStore = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


def kv_store(pool: KVPool, triton: bool) -> KVStore:
    """``store(layer, loc, k, v)`` writing new K/V into ``pool``: the Triton store kernel
    (one graph-safe launch for K and V, the Triton backend's tested kernel), or index_put
    where Triton does not run."""
    if not triton:
        return pool.store
    from executor.attention.triton_kernels import store_kv

    def store(layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        store_kv(pool.k[layer], pool.v[layer], loc, inner_contiguous(k), inner_contiguous(v))

    return store


def _indptr(lengths: list[int] | tuple[int, ...]) -> torch.Tensor:
    """Host int32 offsets ``[0, l0, l0 + l1, ...]`` (FlashInfer plans on the host)."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out


# Head sizes FlashInfer compiles attention for.
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_INSTALL = ("install it with `pip install 'model-executor[flashinfer]'`, or on a "
                      "machine without a package index see docs/flashinfer.md")


def flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def flashinfer_unusable(device: torch.device, dtype: torch.dtype, shape: AttentionShape,
                        probe_fn: Probe | None = None) -> str | None:
    """Why FlashInfer cannot serve this model on this device, or None when it can.

    Cheap checks first (device, dtype, head size, import), then ``probe_fn`` (default:
    ``probe``) runs a small attention on the device against the reference (this
    JIT-compiles the kernels the model needs, which the first request would do anyway)."""
    if device.type != "cuda":
        return f"FlashInfer needs a CUDA device, not {device.type}"
    if dtype not in KERNEL_DTYPES:
        return f"FlashInfer attention here supports float16 and bfloat16, not {dtype}"
    if shape.head_dim not in FLASHINFER_HEAD_DIMS:
        return (f"FlashInfer supports head_dim {list(FLASHINFER_HEAD_DIMS)}, "
                f"not {shape.head_dim}")
    if shape.features:
        # Its wrappers take a window and a soft-cap, but per wrapper, not per layer:
        # not wired here; the triton backend serves these models.
        return (f"this backend does not serve {' or '.join(shape.features)} models; "
                "use triton (or auto)")
    if not flashinfer_installed():
        return f"the flashinfer package is not installed; {FLASHINFER_INSTALL}"
    return (probe_fn or probe)(device, dtype, shape)


def probe(device: torch.device, dtype: torch.dtype, shape: AttentionShape) -> str | None:
    """Run one small prefill and decode through FlashInfer on ``device`` against SDPA;
    returns why FlashInfer cannot serve, or None. JIT-compiles the kernels the model
    needs (cached on disk by FlashInfer), which the first request would do anyway."""
    try:
        import flashinfer

        gen = torch.Generator(device="cpu").manual_seed(0)
        n, heads, kv_heads, dim = 9, shape.num_heads, shape.num_kv_heads, shape.head_dim

        def rand(*size: int) -> torch.Tensor:
            return torch.randn(*size, generator=gen).to(device=device, dtype=dtype)

        q, k, v = rand(n, heads, dim), rand(n, kv_heads, dim), rand(n, kv_heads, dim)
        pages = (k.unsqueeze(1), v.unsqueeze(1))
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        indptr = _indptr([n])
        indices = torch.arange(n, dtype=torch.int32, device=device)
        last = torch.ones(1, dtype=torch.int32)
        prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, _LAYOUT,
                                                                 backend=KERNELS)
        prefill.plan(_indptr([n]), indptr, indices, last, heads, kv_heads, dim, _PAGE_SIZE,
                     causal=True, sm_scale=shape.scale, q_data_type=dtype, kv_data_type=dtype)
        decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, _LAYOUT, use_tensor_cores=heads // kv_heads >= _TENSOR_CORE_GROUP,
            backend=KERNELS)
        decode.plan(indptr, indices, last, heads, kv_heads, dim, _PAGE_SIZE,
                    pos_encoding_mode="NONE", sm_scale=shape.scale, q_data_type=dtype,
                    kv_data_type=dtype)
        got = (prefill.run(q, pages), decode.run(q[-1:].contiguous(), pages))
        ref = F.scaled_dot_product_attention(
            q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
            is_causal=True, scale=shape.scale, enable_gqa=True).transpose(0, 1)
        want = (ref, ref[-1:])
        for what, g, w in zip(("prefill", "decode"), got, want, strict=True):
            err = (g.float() - w).abs().max().item()
            if not err < 5e-2:  # bf16 tolerance; NaN fails too
                return f"FlashInfer {what} differs from SDPA by {err:.3g} on {device}"
        torch.cuda.synchronize(device)
    except Exception as exc:  # any failure means "cannot serve here"
        return f"FlashInfer failed a probe attention on {device}: {type(exc).__name__}: {exc}"
    return None
