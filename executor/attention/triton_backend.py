"""Triton paged attention: a CUDA-graph-capturable decode, and a packed extend that runs
eagerly or, on a grid fixed by a token bucket, inside a prefill graph.

Decode is one split-KV kernel that also stores the new K/V, plus a reduction when a
sequence is split (``triton_kernels/decode.py``); its launch depends on the batch size and
a bound on the lengths (the max context, or a context tier), so a capture per batch bucket
serves any lengths, and a small bucket also gets a twin per tier (``GraphRunner``).
Extend is one ``extend_attention`` launch (eager, between ``breakable`` graph pieces), or
``extend_attention_fixed_grid`` in prefill graph mode ``fixed_grid``.

Graph use follows ``AttentionBackend``: ``DecodeGraphBuffers`` / ``ExtendGraphBuffers``
hold the static metadata for the largest bucket. A padded decode row is
``executor.packing.DECODE_PAD_ROW`` (it reads no table entry and writes its K/V to the
reserved location only); a padded extend row (``EXTEND_PAD_ROW``) has no new tokens.
Design notes: docs/kernels.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from executor.api import Phase
from executor.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionShape,
    bucket_buffers,
    check_decode_batch,
    check_kernel_pool,
    inner_contiguous,
)
from executor.attention.triton_kernels import (
    decode_attention,
    extend_attention,
    extend_attention_fixed_grid,
    num_kv_splits,
)
from executor.forward_batch import ForwardBatch
from executor.kv.allocator import RESERVED_LOCATION
from executor.kv.pool import KVPool, ReqToTokenTable
from executor.packing import DECODE_PAD_ROW, DECODE_ROW_FIELDS, SEQUENCE_FIELDS

# SM count assumed when the pool is not on a CUDA device (the Triton CPU interpreter).
_DEFAULT_NUM_SMS = 132
_SEQ_LENS_ROW = DECODE_ROW_FIELDS.index("seq_lens")
#: ``TritonBackend.decode_context_tiers`` (tokens, ascending): one short tier pays off
#: for small batches; a second, longer one did not (docs/kernels.md).
DECODE_CONTEXT_TIERS = (512,)
#: A tier gets its twin graph where it cuts a bucket's split count at least this many
#: times over (smaller cuts gained nothing beyond noise, so those buckets keep one graph).
TIER_SPLIT_RATIO = 3


@dataclass(frozen=True)
class TritonDecodeMetadata(AttentionMetadata):
    """One new token per sequence. Under a graph, every tensor is a view of the static
    ``DecodeGraphBuffers``; eagerly they are the batch's own tensors."""

    slots: torch.Tensor  # (B,) int64
    seq_lens: torch.Tensor  # (B,) int64, including the new token
    out_cache_loc: torch.Tensor  # (B,) int64
    # Split-KV scratch; None when each sequence runs as one split (no reduction).
    partial_out: torch.Tensor | None  # (B, heads, splits, head_dim) fp32
    partial_lse: torch.Tensor | None  # (B, heads, splits) fp32

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])


@dataclass(frozen=True)
class TritonExtendMetadata(AttentionMetadata):
    """Packed variable-length extend; eager only (the grid uses ``max_extend_len``)."""

    slots: torch.Tensor  # (B,) int64
    prefix_lens: torch.Tensor  # (B,) int64
    extend_lens: torch.Tensor  # (B,) int64
    extend_start: torch.Tensor  # (B,) int64
    out_cache_loc: torch.Tensor  # (T,) int64
    max_extend_len: int


@dataclass(frozen=True)
class TritonFixedExtendMetadata(AttentionMetadata):
    """A prefill captured per token bucket (graph mode ``fixed_grid``): views of the static
    ``ExtendGraphBuffers``; the launch depends on the bucket only."""

    seq_rows: torch.Tensor  # (5, S) int64: packing.SEQUENCE_FIELDS
    out_cache_loc: torch.Tensor  # (bucket,) int64


@dataclass
class ExtendGraphBuffers:
    """Static extend metadata for prefill graphs: ``S`` sequence rows in the packed
    batch's field order (``packing.SEQUENCE_FIELDS``; a batch's rows first, padding after:
    ``extend_lens`` 0) and the largest bucket's token locations."""

    seq_rows: torch.Tensor  # (5, S) int64
    pad_rows: torch.Tensor  # (5, S) int64: EXTEND_PAD_ROW in every column
    out_cache_loc: torch.Tensor  # (max_tokens,) int64
    _views: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = field(
        default_factory=dict, repr=False)

    @property
    def max_batch(self) -> int:
        """Tokens of the largest bucket (``bucket_buffers`` checks a bucket against it)."""
        return int(self.out_cache_loc.shape[0])

    def views(self, seqs: int) -> tuple[torch.Tensor, torch.Tensor | None,
                                        torch.Tensor | None]:
        """The rows of a batch of ``seqs`` sequences, the padding rows after them and
        their source (None when the batch fills every row)."""
        got = self._views.get(seqs)
        if got is None:
            full = seqs == self.seq_rows.shape[1]
            got = self._views[seqs] = (self.seq_rows[:, :seqs],
                                       None if full else self.seq_rows[:, seqs:],
                                       None if full else self.pad_rows[:, seqs:])
        return got


#: A padded sequence row of ``ExtendGraphBuffers``: slot 0, no prefix, no new tokens.
EXTEND_PAD_ROW = (0, 0, 0, 0, 0)
_EXTEND_LENS_ROW = SEQUENCE_FIELDS.index("extend_lens")


@dataclass
class DecodeGraphBuffers:
    """Static decode metadata for the largest bucket; a bucket of ``bs`` rows uses the
    leading ``bs`` columns. Addresses never change after allocation (graphs record them)."""

    rows: torch.Tensor  # (3, max_batch) int64: DECODE_ROW_FIELDS
    pad_rows: torch.Tensor  # (3, max_batch) int64: DECODE_PAD_ROW in every column
    partial_out: torch.Tensor  # (max over buckets of bs * splits * heads * head_dim,) fp32
    partial_lse: torch.Tensor  # (max over buckets of bs * splits * heads,) fp32

    @property
    def max_batch(self) -> int:
        return int(self.rows.shape[1])


class TritonBackend(AttentionBackend):
    name: ClassVar[str] = "triton"
    capturable: ClassVar[frozenset[Phase]] = frozenset({"decode", "prefill"})
    # Extend programs cover the rows metadata names (extend_start + extend_lens), decode
    # programs the first B rows: padding rows after them are never read or written.
    padded_rows_ok: ClassVar[bool] = True

    def __init__(self, shape: AttentionShape, pool: KVPool, table: ReqToTokenTable) -> None:
        super().__init__(shape, pool, table)
        check_kernel_pool(self.name, shape, pool)
        device = pool.k_buffer.device
        self.device = device
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else _DEFAULT_NUM_SMS)
        self.graph_buffers: DecodeGraphBuffers | None = None
        self.extend_buffers: ExtendGraphBuffers | None = None
        self.rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._splits: dict[tuple[int, int, int], int] = {}  # (rows, bound, SMs) -> splits

    can_fuse_decode_rope: ClassVar[bool] = True

    def fuse_decode_rope(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.rope_tables = (cos, sin)

    def fuses_rope(self, meta: AttentionMetadata) -> bool:
        return self.rope_tables is not None and isinstance(meta, TritonDecodeMetadata)

    # Sequences of at most 512 tokens need at most 16 splits of ``SPLIT_ALIGN`` tokens,
    # where the max context's launch may have up to ``MAX_SPLITS``, most of them idle. A
    # lower cap for every length instead would slow long contexts; see
    # ``DECODE_CONTEXT_TIERS``.
    decode_context_tiers: ClassVar[tuple[int, ...]] = DECODE_CONTEXT_TIERS

    def num_splits(self, batch_size: int, context: int | None = None) -> int:
        """Split-KV factor of a decode of ``batch_size`` rows whose sequences have at most
        ``context`` tokens (default: the table's max context). Remembered: every eager
        decode step asks (``decode_tier``), and working it out costs a few us of Python."""
        bound = self.table.max_context if context is None else context
        key = (batch_size, bound, self.num_sms)
        splits = self._splits.get(key)
        if splits is None:
            splits = self._splits[key] = num_kv_splits(batch_size, self.shape.num_kv_heads,
                                                       bound, self.num_sms)
        return splits

    def tier_helps(self, batch_size: int, tier: int) -> bool:
        """At most a third of the splits of the max context's launch
        (``TIER_SPLIT_RATIO``)."""
        return tier < self.table.max_context and \
            TIER_SPLIT_RATIO * self.num_splits(batch_size, tier) <= self.num_splits(batch_size)

    # -- eager ---------------------------------------------------------------------------
    def build_metadata(self, batch: ForwardBatch) -> AttentionMetadata:
        if batch.phase == "decode":
            check_decode_batch(self.name, batch)
            partial_out, partial_lse = self._alloc_scratch(
                batch.batch_size, self.decode_tier(batch.batch_size, max(batch.seq_lens_host)))
            return TritonDecodeMetadata(batch.slots, batch.seq_lens,
                                        batch.out_cache_loc, partial_out, partial_lse)
        return TritonExtendMetadata(
            slots=batch.slots,
            prefix_lens=batch.prefix_lens,
            extend_lens=batch.extend_lens,
            extend_start=batch.extend_start,
            out_cache_loc=batch.out_cache_loc,
            max_extend_len=max(batch.extend_lens_host, default=0),
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (T, heads, head_dim)
        self.forward_into(q, k, v, out, layer_id, meta)
        return out

    def forward_into(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, layer_id: int, meta: AttentionMetadata) -> None:
        """One kernel launch per layer in either phase, each also storing the new K/V."""
        q, k, v = inner_contiguous(q), inner_contiguous(k), inner_contiguous(v)
        k_pool, v_pool = self.pool.k[layer_id], self.pool.v[layer_id]
        table = self.table.device_table
        window, cap = self.shape.window(layer_id), self.shape.softcap
        if isinstance(meta, TritonFixedExtendMetadata):
            t = meta.out_cache_loc.shape[0]
            assert q.shape[0] == t, f"a {t}-token bucket's forward got {q.shape[0]} tokens"
            extend_attention_fixed_grid(q, k, v, out, k_pool, v_pool, table, meta.seq_rows,
                                        meta.out_cache_loc, self.shape.scale, window, cap)
        elif isinstance(meta, TritonDecodeMetadata):
            b = meta.batch_size
            assert q.shape[0] >= b, f"decode takes one token per row: {q.shape[0]} rows < {b}"
            if q.shape[0] > b:  # padding rows (padded_rows_ok): the launch covers B rows
                q, k, v, out = q[:b], k[:b], v[:b], out[:b]
            decode_attention(q, k, v, k_pool, v_pool, table, meta.slots,
                             meta.seq_lens, meta.out_cache_loc, out, meta.partial_out,
                             meta.partial_lse, self.shape.scale, self.rope_tables,
                             window, cap)
        elif isinstance(meta, TritonExtendMetadata):
            extend_attention(q, k, v, out, k_pool, v_pool, table, meta.slots,
                             meta.prefix_lens, meta.extend_lens, meta.extend_start,
                             meta.max_extend_len, self.shape.scale,
                             out_cache_loc=meta.out_cache_loc, window=window, softcap=cap)
        else:
            raise TypeError(f"triton backend got {type(meta).__name__}")

    # -- graph hooks -----------------------------------------------------------------------
    def init_graph_buffers(self, max_batch: int, max_tokens: int,
                           phase: Phase = "decode") -> None:
        """Allocate the static buffers of ``phase``: decode, for buckets of up to
        ``max_batch`` rows (``max_tokens`` unused: one token per row); prefill, for buckets
        of up to ``max_tokens`` tokens and as many sequences as the table has slots.

        Idempotent while the existing buffers are big enough: graphs captured over them
        stay valid (their addresses must not change).
        """
        if phase == "prefill":
            self._init_extend_buffers(max_tokens)
            return
        if self.graph_buffers is not None and self.graph_buffers.max_batch >= max_batch:
            return
        heads, dim = self.shape.num_heads, self.shape.head_dim
        # Scratch for the bucket that needs the most (bs * splits is not monotonic in bs).
        rows_x_splits = max(bs * self.num_splits(bs) for bs in range(1, max_batch + 1))
        pad = torch.tensor(DECODE_PAD_ROW, dtype=torch.int64, device=self.device)
        pad_rows = pad[:, None].expand(3, max_batch).contiguous()
        self.graph_buffers = DecodeGraphBuffers(
            rows=pad_rows.clone(),
            pad_rows=pad_rows,
            partial_out=torch.empty(rows_x_splits * heads * dim, dtype=torch.float32,
                                    device=self.device),
            partial_lse=torch.empty(rows_x_splits * heads, dtype=torch.float32,
                                    device=self.device),
        )

    def _init_extend_buffers(self, max_tokens: int) -> None:
        if self.extend_buffers is not None and self.extend_buffers.max_batch >= max_tokens:
            return
        seqs = self.table.max_sequences
        # Normal tensors even when capture runs under inference mode: a refresh from a
        # batch outside it updates them in place.
        with torch.inference_mode(False):
            pad = torch.tensor(EXTEND_PAD_ROW, dtype=torch.int64, device=self.device)
            pad_rows = pad[:, None].expand(len(EXTEND_PAD_ROW), seqs).contiguous()
            self.extend_buffers = ExtendGraphBuffers(
                seq_rows=pad_rows.clone(), pad_rows=pad_rows,
                out_cache_loc=torch.full((max_tokens,), RESERVED_LOCATION, dtype=torch.int64,
                                         device=self.device))

    def capture_metadata(self, phase: Phase, batch_size: int, num_tokens: int,
                         context_tier: int | None = None) -> AttentionMetadata:
        """Decode: ``batch_size`` padded rows, split for ``context_tier``. Prefill
        (``num_tokens``, the bucket): one sequence of ``num_tokens`` new tokens in slot 0
        without a prefix, storing every token at the reserved location, so warm-up and
        capture run the whole kernel."""
        if phase == "prefill":
            ext = bucket_buffers(self.extend_buffers, num_tokens)
            ext.seq_rows.copy_(ext.pad_rows)
            ext.seq_rows[_EXTEND_LENS_ROW, 0] = num_tokens
            ext.out_cache_loc[:num_tokens].fill_(RESERVED_LOCATION)
            return TritonFixedExtendMetadata(ext.seq_rows, ext.out_cache_loc[:num_tokens])
        bufs = bucket_buffers(self.graph_buffers, batch_size)
        if num_tokens != batch_size:
            raise ValueError(f"decode has one token per row: {num_tokens} != {batch_size}")
        bufs.rows[:, :batch_size].copy_(bufs.pad_rows[:, :batch_size])
        splits = self.num_splits(batch_size, context_tier)
        heads, dim = self.shape.num_heads, self.shape.head_dim
        partial_out = partial_lse = None
        if splits > 1:
            n = batch_size * heads * splits
            partial_out = bufs.partial_out[: n * dim].view(batch_size, heads, splits, dim)
            partial_lse = bufs.partial_lse[:n].view(batch_size, heads, splits)
        rows = dict(zip(DECODE_ROW_FIELDS, bufs.rows[:, :batch_size], strict=True))
        return TritonDecodeMetadata(rows["slots"], rows["seq_lens"],
                                    rows["out_cache_loc"], partial_out, partial_lse)

    def refresh_metadata(self, meta: AttentionMetadata, batch: ForwardBatch) -> None:
        """Copy ``batch`` into the static rows of ``meta`` (padding after it): a few small
        device copies, no host sync, issued on the current stream before the replay."""
        if isinstance(meta, TritonFixedExtendMetadata):
            self._refresh_extend(meta, batch)
            return
        assert isinstance(meta, TritonDecodeMetadata), type(meta).__name__
        size = meta.batch_size
        bufs = bucket_buffers(self.graph_buffers, size)
        assert meta.seq_lens.data_ptr() == bufs.rows[_SEQ_LENS_ROW].data_ptr(), \
            "not capture metadata"
        check_decode_batch(self.name, batch)
        real = batch.batch_size
        if real > size:
            raise ValueError(f"batch of {real} does not fit a bucket of {size}")
        rows = batch.decode_rows
        if rows is None:  # a batch not packed by ForwardBatch.build
            rows = torch.stack([getattr(batch, name) for name in DECODE_ROW_FIELDS])
        bufs.rows[:, :real].copy_(rows)
        if real < size:
            bufs.rows[:, real:size].copy_(bufs.pad_rows[:, real:size])

    def _refresh_extend(self, meta: TritonFixedExtendMetadata, batch: ForwardBatch) -> None:
        """Three device copies: the batch's (5, B) sequence rows, padding after them, and
        the bucket's token locations (the views cached per B: each costs a dispatcher
        call to make, and a prefill's host time is what this graph mode saves)."""
        ext = self.extend_buffers
        assert ext is not None and meta.seq_rows.data_ptr() == ext.seq_rows.data_ptr(), \
            "not capture metadata"
        bucket, tokens, seqs = meta.out_cache_loc.shape[0], batch.num_tokens, batch.batch_size
        if tokens > bucket or seqs > ext.seq_rows.shape[1]:
            raise ValueError(f"a prefill of {tokens} tokens in {seqs} sequences does not fit "
                             f"a bucket of {bucket} tokens and {ext.seq_rows.shape[1]} rows")
        real, pad, pad_src = ext.views(seqs)
        if batch.sequence_rows is not None:  # one block of the packed transfer
            real.copy_(batch.sequence_rows)
        else:
            for i, name in enumerate(SEQUENCE_FIELDS):
                real[i].copy_(getattr(batch, name))
        if pad is not None and pad_src is not None:
            pad.copy_(pad_src)
        # The batch's tokens only: the kernel reads a location for a row of a sequence, so
        # what is left past them from an earlier batch is never read.
        locs = batch.out_cache_loc
        meta.out_cache_loc[: locs.shape[0]].copy_(locs)

    def static_decode_rows(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """Rows ``:size`` of the static decode rows: a batch packed for the bucket
        (``GraphLayout``) carries its padding rows as ``DECODE_PAD_ROW`` already."""
        if not isinstance(meta, TritonDecodeMetadata):
            return None
        bufs = bucket_buffers(self.graph_buffers, meta.batch_size)
        assert meta.seq_lens.data_ptr() == bufs.rows[_SEQ_LENS_ROW].data_ptr(), \
            "not capture metadata"
        return bufs.rows[:, : meta.batch_size]

    # -- helpers ---------------------------------------------------------------------------

    def _alloc_scratch(self, batch_size: int, context: int | None
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        splits = self.num_splits(batch_size, context)
        if splits == 1:
            return None, None
        heads, dim = self.shape.num_heads, self.shape.head_dim
        out = torch.empty((batch_size, heads, splits, dim), dtype=torch.float32,
                          device=self.device)
        lse = torch.empty((batch_size, heads, splits), dtype=torch.float32, device=self.device)
        return out, lse
