"""The attention-backend interface (``AttentionBackend``, whose docstring states the
contract), the shape it serves and the metadata base class.

A backend stores each layer's new K/V into the KV pool and attends over every sequence's
cached prefix plus its new tokens (causally among the new ones).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar

import torch

from executor.api import Phase
from executor.attention.dtypes import KERNEL_DTYPE_NAMES
from executor.forward_batch import ForwardBatch
from executor.kv.pool import KVPool, ReqToTokenTable


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    #: Per layer, the sliding window (a query at position p sees keys at positions
    #: > p - window, Hugging Face's definition), 0 for full attention; empty: none.
    windows: tuple[int, ...] = ()
    #: Attention logit soft-cap (scores become ``cap * tanh(score / cap)``), 0 for none.
    softcap: float = 0.0

    def window(self, layer_id: int) -> int:
        """Layer ``layer_id``'s window, 0 for full attention."""
        return self.windows[layer_id] if self.windows else 0

    @property
    def features(self) -> tuple[str, ...]:
        """What a backend must implement beyond plain causal attention, by name."""
        return ("sliding_window",) * any(self.windows) + ("attn_softcap",) * (self.softcap > 0)


class AttentionMetadata:
    """Per-batch metadata; each backend defines its own dataclass deriving from this."""


#: Passed as ``meta`` where attention reads its batch from a ``BatchScope`` instead (graph
#: pieces): one constant object, so a compiled forward never specializes on metadata.
SCOPED = AttentionMetadata()


class AttentionBackend(ABC):
    """Eager use, once per forward pass::

        meta = backend.build_metadata(batch)            # host work, may allocate
        out = backend.forward(q, k, v, layer_id, meta)  # per layer, inside the model
        backend.forward_into(q, k, v, out, layer_id, meta)  # the same, into a given buffer

    Graph use adds four hooks (the contract of every capturable backend)::

        backend.init_graph_buffers(max_batch, max_tokens, phase)  # once per phase: buffers
        meta = backend.capture_metadata(phase, batch_size, num_tokens)  # before capture
        backend.refresh_metadata(meta, batch)                 # before each replay, in place
        rows = backend.static_decode_rows(meta)               # optional: refresh as one copy

    ``capture_metadata`` returns metadata whose tensors are views of the static buffers,
    filled for a dummy batch (every padded row attends to the reserved location 0 only); the
    graph records reads of those addresses. ``refresh_metadata`` rewrites the same buffers
    from a real batch *outside* the graph, so a replay sees the real lengths. A backend that
    cannot be captured leaves the hooks raising ``NotImplementedError``; ``capturable`` says
    which phases it supports.
    """

    name: ClassVar[str]
    #: Phases whose forward can be captured in a single CUDA graph with this backend.
    capturable: ClassVar[frozenset[Phase]] = frozenset()
    #: True when ``forward_into`` reads and writes only the batch's rows, located by its
    #: metadata: callers may pass q/k/v/out with padding rows after them (graph pieces
    #: padded to a bucket), which it leaves untouched, instead of cutting each tensor to
    #: the batch's tokens on every layer.
    padded_rows_ok: ClassVar[bool] = False

    def __init__(self, shape: AttentionShape, pool: KVPool, table: ReqToTokenTable) -> None:
        self.shape = shape
        self.pool = pool
        self.table = table

    @abstractmethod
    def build_metadata(self, batch: ForwardBatch) -> AttentionMetadata:
        """Build metadata for one eager forward of ``batch``."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # (T, num_heads, head_dim)
        k: torch.Tensor,  # (T, num_kv_heads, head_dim)
        v: torch.Tensor,  # (T, num_kv_heads, head_dim)
        layer_id: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Store ``k``/``v`` at the batch's ``out_cache_loc`` in layer ``layer_id``'s pool,
        then return attention output ``(T, num_heads, head_dim)`` in ``q``'s dtype.

        ``meta`` comes from ``build_metadata`` or ``capture_metadata``; it is ``SCOPED``
        only for wrappers that read the batch from a ``BatchScope`` (graph pieces)."""

    def forward_into(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, layer_id: int, meta: AttentionMetadata) -> None:
        """``forward`` writing its output into ``out`` ``(T, num_heads, head_dim)``, ``q``'s
        dtype, contiguous. Graph pieces, whose attention output lives in one static buffer,
        call this once per layer; kernel backends write there directly (no copy), the
        default copies."""
        out.copy_(self.forward(q, k, v, layer_id, meta))

    # -- graph hooks -------------------------------------------------------------------
    def init_graph_buffers(self, max_batch: int, max_tokens: int,
                           phase: Phase = "decode") -> None:
        """Allocate ``phase``'s static metadata buffers, big enough for the largest bucket
        (``max_batch`` sequences, ``max_tokens`` tokens)."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot be captured")

    def capture_metadata(self, phase: Phase, batch_size: int, num_tokens: int,
                         context_tier: int | None = None) -> AttentionMetadata:
        """Metadata over the static buffers, filled for a dummy batch of this bucket size.
        ``context_tier`` (decode, one of ``decode_context_tiers``): the graph will serve
        only batches whose sequences all have at most that many tokens, and the launch may
        be sized for them."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot be captured")

    #: Longest-sequence limits (tokens, ascending) under which a decode may launch
    #: differently than at the table's max context: a decode graph captured at a fixed
    #: launch shape then has a twin per tier that ``tier_helps`` accepts, replayed while
    #: every sequence of the batch fits the tier (``GraphRunner``). Every process of a
    #: tensor-parallel group sees the same candidates (a class constant).
    decode_context_tiers: ClassVar[tuple[int, ...]] = ()

    def tier_helps(self, batch_size: int, tier: int) -> bool:
        """Whether a decode of ``batch_size`` rows whose sequences all fit ``tier`` tokens
        launches enough leaner than one at the table's max context that a twin graph is
        worth capturing."""
        del batch_size, tier
        return False

    def decode_tier(self, batch_size: int, longest: int) -> int | None:
        """The smallest tier that a decode of ``batch_size`` rows whose longest sequence
        has ``longest`` tokens launches for (``tier_helps``), or None (the general
        launch). Eager decodes follow it too, so they launch as the graph they stand in
        for does."""
        for tier in self.decode_context_tiers:
            if longest <= tier and self.tier_helps(batch_size, tier):
                return tier
        return None

    def refresh_metadata(self, meta: AttentionMetadata, batch: ForwardBatch) -> None:
        """Rewrite ``meta``'s static buffers in place from ``batch`` (rows past
        ``batch.batch_size`` become padding); called outside the graph before replay."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot be captured")

    # -- fused RoPE ----------------------------------------------------------------------
    #: True when the backend can apply RoPE itself inside its decode kernel
    #: (``fuse_decode_rope``): the model then skips its own RoPE launch for those forwards.
    can_fuse_decode_rope: ClassVar[bool] = False

    def fuse_decode_rope(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """From now on, decode forwards take q and k unrotated and rotate them with these
        float32 ``(positions, head_dim)`` tables (``RotaryEmbedding``) at each sequence's
        new position. Only for models without a per-head q/k norm before RoPE."""
        del cos, sin
        raise NotImplementedError(f"attention backend {self.name!r} cannot fuse RoPE")

    def fuses_rope(self, meta: AttentionMetadata) -> bool:
        """Whether ``forward`` with ``meta`` applies RoPE itself (the caller must not)."""
        del meta
        return False

    def static_decode_rows(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """The static ``(3, bucket)`` rows (``packing.DECODE_ROW_FIELDS``) of decode capture
        metadata ``meta``, when refreshing it from a bucket-padded batch is exactly one
        copy of that batch's rows into them (so the runner may capture the copy);
        None when ``refresh_metadata`` must run on the host before each replay."""
        del meta
        return None


# -- shared by the kernel backends (triton, flashinfer) -----------------------------------
#: KV dtypes the Triton and FlashInfer kernels support (named once, in the registry).
KERNEL_DTYPES = tuple(getattr(torch, name) for name in KERNEL_DTYPE_NAMES)


def check_kernel_pool(name: str, shape: AttentionShape, pool: KVPool) -> None:
    """Raise ``ValueError`` unless a kernel backend can serve ``shape`` over ``pool``."""
    if pool.dtype not in KERNEL_DTYPES:
        raise ValueError(f"{name} attention supports fp16 and bf16 KV, not {pool.dtype}")
    if (pool.num_kv_heads, pool.head_dim) != (shape.num_kv_heads, shape.head_dim):
        raise ValueError(f"KV pool is ({pool.num_kv_heads} heads, dim {pool.head_dim}), "
                         f"attention wants ({shape.num_kv_heads}, {shape.head_dim})")
    if shape.num_heads % shape.num_kv_heads:
        raise ValueError(f"{shape.num_heads} query heads are not a multiple of "
                         f"{shape.num_kv_heads} KV heads")


def check_decode_batch(name: str, batch: ForwardBatch) -> None:
    """Raise ``ValueError`` unless ``batch`` is a decode batch (one token per row)."""
    if batch.phase != "decode" or any(n != 1 for n in batch.extend_lens_host):
        raise ValueError(f"{name} decode metadata needs a decode batch (one token per row)")


def inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` with each head's vector contiguous: kernels take any token/head strides (q/k/v
    are views of one fused QKV output) but not a strided head_dim."""
    return x if x.stride(-1) == 1 else x.contiguous()


class _BucketBuffers(Protocol):
    @property
    def max_batch(self) -> int: ...


BuffersT = TypeVar("BuffersT", bound=_BucketBuffers)


def bucket_buffers(buffers: BuffersT | None, batch_size: int) -> BuffersT:
    """A backend's static decode buffers, checked to hold a bucket of ``batch_size`` rows."""
    if buffers is None:
        raise RuntimeError("init_graph_buffers must run before capture_metadata")
    if batch_size > buffers.max_batch:
        raise ValueError(f"bucket {batch_size} exceeds the graph buffers' max batch "
                         f"{buffers.max_batch}")
    return buffers
