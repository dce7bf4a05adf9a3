"""The graph prologue: how a step's batch gets into a bucket's graphs in one launch.

The executor packs a batch bound for a captured bucket straight into the runner's fixed
``transfer`` buffer (``GraphLayout``: padded to the bucket, every field at a fixed place).
Per bucket, a small captured graph then copies it where the graphs read it:

* token ids and positions into the static ``GraphInputs`` (a ``USE_LAST_SAMPLED`` decode
  token becomes its sequence's last sampled token, read from ``LastSampled.tokens``);
* the new tokens' KV locations into the request-slot table (padding writes its scratch
  cell), through ``ReqToTokenTable.write_device``;
* for a decode graph whose attention is captured, the decode rows into the attention
  backend's static metadata, when that refresh is exactly one copy
  (``AttentionBackend.static_decode_rows``).

One graph launch instead of several host-issued ops per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.api import Phase
from executor.forward_batch import ForwardBatch
from executor.graphs.backends import CaptureStream
from executor.kv.pool import ReqToTokenTable
from executor.model.layers import triton_available
from executor.packing import GraphLayout


@dataclass
class GraphInputs:
    """Static token inputs the graphs read, sized for the largest bucket. Two tensors,
    not views of one: a compiled forward (``tc_piecewise``) must not see its inputs
    alias each other."""

    input_ids: torch.Tensor  # (max_tokens,) int64
    positions: torch.Tensor  # (max_tokens,) int64

    @staticmethod
    def allocate(max_tokens: int, device: torch.device) -> GraphInputs:
        return GraphInputs(torch.zeros(max_tokens, dtype=torch.int64, device=device),
                           torch.zeros(max_tokens, dtype=torch.int64, device=device))


class Prologue:
    """One runner's prologue graphs, their transfer buffer, layouts, stream and pool."""

    def __init__(self, phase: Phase, buckets: tuple[int, ...], inputs: GraphInputs,
                 table: ReqToTokenTable, device: torch.device,
                 last_tokens: torch.Tensor | None = None) -> None:
        self.inputs, self.table = inputs, table
        # (max_sequences,) int64: each slot's last sampled token (decode only).
        self.last_tokens = last_tokens if phase == "decode" else None
        self.transfer = torch.zeros(GraphLayout.max_packed_size(max(buckets)),
                                    dtype=torch.int64, device=device)
        self.layouts = {b: GraphLayout(b, table.scratch_index, self.transfer, phase)
                        for b in buckets}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # One Triton launch for the whole prologue (``executor.kernels.graph_prologue``) where
        # Triton runs; else the torch ops below, six to eight launches.
        self.fused = device.type == "cuda" and triton_available()
        # Buckets whose prologue also refreshes the attention backend's static rows.
        self._refreshes_rows: set[int] = set()
        # Its own stream and pool, apart from the forward's graphs; a recapture after
        # ``release`` gets a fresh pool (one reused after release failed in the pinned
        # host allocator).
        self._streams = CaptureStream(device)

    def capture(self, bucket: int, attention_rows: torch.Tensor | None) -> None:
        """Capture ``bucket``'s prologue; ``attention_rows`` are the static (3, bucket)
        decode rows it also refreshes, or None.

        It first runs once uncaptured (kernels load at first use) on a batch of padding
        only, which writes only the scratch cell and padding values."""
        layout = self.layouts[bucket]
        ids, positions = layout.field("input_ids"), layout.field("positions")
        table_index, locations = layout.field("table_index"), layout.field("out_cache_loc")
        rows = None if attention_rows is None else layout.decode_rows
        last = self.last_tokens
        slots = layout.field("slots") if last is not None else None

        if self.fused:
            from executor.kernels.graph_prologue import graph_prologue

        def body() -> None:
            if self.fused:
                graph_prologue(ids, positions, table_index, locations,
                               self.inputs.input_ids[:bucket], self.inputs.positions[:bucket],
                               self.table.device_flat, last, slots, rows, attention_rows)
                return
            if last is not None and slots is not None:
                torch.where(ids >= 0, ids, last[slots], out=self.inputs.input_ids[:bucket])
            else:
                self.inputs.input_ids[:bucket].copy_(ids)
            self.inputs.positions[:bucket].copy_(positions)
            self.table.write_device(table_index, locations)
            if attention_rows is not None and rows is not None:
                attention_rows.copy_(rows)

        layout.fill_padding()  # device-side fills: no host-to-device copy here
        graph = torch.cuda.CUDAGraph()
        with self._streams.active():
            body()
            graph.capture_begin(pool=self._streams.pool)
            try:
                body()
            finally:
                graph.capture_end()
        self._graphs[bucket] = graph
        if attention_rows is not None:
            self._refreshes_rows.add(bucket)

    def last_token_store(self, bucket: int
                         ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, int]]:
        """``argmax_rows``'s ``store`` and ``padding`` for ``bucket``'s rows (a decode
        prologue's): the last sampled tokens at the rows' slots, and the table cell padding
        writes as the mark of a padded row (whose slot is a placeholder, maybe a live
        sequence's)."""
        assert self.last_tokens is not None, "only a decode prologue has the table"
        layout = self.layouts[bucket]
        return (self.last_tokens, layout.field("slots")), \
            (layout.field("table_index"), self.table.scratch_index)

    def replay(self, batch: ForwardBatch, bucket: int) -> bool:
        """Take ``batch`` (packed for ``bucket`` with ``layouts[bucket]``) into the graphs;
        returns whether the attention rows were refreshed with it."""
        if (batch.bucket != bucket or bucket not in self._graphs
                or batch.input_ids.data_ptr() != self.transfer.data_ptr()):
            raise ValueError(f"batch packed for bucket {batch.bucket} of another runner or "
                             f"an uncaptured bucket, replayed at bucket {bucket}")
        self._graphs[bucket].replay()
        return bucket in self._refreshes_rows

    def release(self) -> None:
        self._graphs.clear()
        self._refreshes_rows.clear()
        self._streams.reset()
