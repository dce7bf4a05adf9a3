"""The attention-backend interface.

A backend stores each layer's new K/V into the KV pool and attends over every sequence's
cached prefix plus its new tokens (causally among the new ones).

Eager use, once per forward pass::

    meta = backend.build_metadata(batch)            # host work, may allocate
    out = backend.forward(q, k, v, layer_id, meta)  # per layer, inside the model

Graph use adds three hooks (the contract of every capturable backend)::

    backend.init_graph_buffers(max_batch, max_tokens)     # once: static metadata buffers
    meta = backend.capture_metadata(phase, batch_size, num_tokens)  # before capture
    backend.refresh_metadata(meta, batch)                 # before each replay, in place

``capture_metadata`` returns metadata whose tensors are views of the static buffers, filled
for a dummy batch (every padded row attends to the reserved location 0 only); the graph
records reads of those addresses. ``refresh_metadata`` rewrites the same buffers from a real
batch *outside* the graph, so a replay sees the real lengths. A backend that cannot be
captured leaves the hooks raising ``NotImplementedError``; ``capturable`` says which phases
it supports.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from executor.api import Phase
from executor.forward_batch import ForwardBatch
from executor.kv.pool import KVPool, ReqToTokenTable


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


class AttentionMetadata:
    """Per-batch metadata; each backend defines its own dataclass deriving from this."""


#: Passed as ``meta`` where attention reads its batch from a ``BatchScope`` instead (graph
#: pieces): one constant object, so a compiled forward never specializes on metadata.
SCOPED = AttentionMetadata()


class AttentionBackend(ABC):
    name: ClassVar[str]
    #: Phases whose forward can be captured in a single CUDA graph with this backend.
    capturable: ClassVar[frozenset[Phase]] = frozenset()

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

    # -- graph hooks -------------------------------------------------------------------
    def init_graph_buffers(self, max_batch: int, max_tokens: int) -> None:
        """Allocate static metadata buffers big enough for the largest bucket."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot be captured")

    def capture_metadata(self, phase: Phase, batch_size: int, num_tokens: int) -> AttentionMetadata:
        """Metadata over the static buffers, filled for a dummy batch of this bucket size."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot be captured")

    def refresh_metadata(self, meta: AttentionMetadata, batch: ForwardBatch) -> None:
        """Rewrite ``meta``'s static buffers in place from ``batch`` (rows past
        ``batch.batch_size`` become padding); called outside the graph before replay."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot be captured")
