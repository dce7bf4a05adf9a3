"""Device buffers of the KV cache: per-layer K/V pools and the request-slot table."""

from __future__ import annotations

import numpy as np
import torch

# Up to this many new tokens, ``write_host`` scatters them with one index list built in
# Python; above it, one slice copy per sequence is cheaper than the list.
_SCATTER_MAX_TOKENS = 256


class KVPool:
    """Per-layer K and V buffers indexed by token location.

    Shapes: ``k[layer]`` and ``v[layer]`` are ``(num_locations + 1, kv_heads, head_dim)``;
    row 0 is the reserved dummy location (see ``allocator.RESERVED_LOCATION``). One
    allocation backs all layers, and the per-layer tensors are views of it.
    """

    def __init__(
        self,
        num_layers: int,
        num_locations: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.num_locations = num_locations
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_layers, num_locations + 1, num_kv_heads, head_dim)
        # (layers, locations + 1, kv_heads, head_dim)
        self.k_buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.v_buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.k: list[torch.Tensor] = list(self.k_buffer.unbind(0))
        self.v: list[torch.Tensor] = list(self.v_buffer.unbind(0))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return self.k_buffer.nbytes + self.v_buffer.nbytes

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new K/V rows: ``loc`` (tokens,), ``k``/``v`` (tokens, kv_heads, head_dim)."""
        self.k[layer][loc] = k.to(self.dtype)
        self.v[layer][loc] = v.to(self.dtype)


class ReqToTokenTable:
    """``table[slot, i]`` is the KV location of token ``i`` of the sequence in ``slot``.

    The device copy is what attention kernels read; a host mirror lets release and
    rollback find a sequence's locations without a device-to-host copy. Allocation writes
    the host mirror; the batch that uses new locations publishes them to the device copy
    (``write_device``) in the same host-to-device transfer as the rest of its metadata.
    """

    def __init__(self, max_sequences: int, max_context: int, device: torch.device) -> None:
        self.max_sequences = max_sequences
        self.max_context = max_context
        # (max_sequences, max_context) int32, a view of a flat buffer with one more cell:
        # ``scratch_index``, where padded rows of a graph batch write (never read).
        cells = max_sequences * max_context
        self._device_flat = torch.zeros(cells + 1, dtype=torch.int32, device=device)
        self.device_table = self._device_flat[:cells].view(max_sequences, max_context)
        self.scratch_index = cells
        self.host_table = torch.zeros((max_sequences, max_context), dtype=torch.int32)
        self._host_flat = self.host_table.view(-1)
        # The same memory as a numpy array: a decode step's scatter of a few dozen cells
        # through numpy costs a fraction of a torch index_put (no dispatcher call).
        self._host_array = self._host_flat.numpy()

    def write_host(self, spans: list[tuple[int, int, int]], locs: torch.Tensor) -> None:
        """For each ``(slot, start, n)`` in order, set ``host_table[slot, start:start + n]``
        to the next ``n`` of ``locs`` (allocation time). Up to ``_SCATTER_MAX_TOKENS``
        new tokens, one numpy slice or scatter on the table's memory (a decode batch: one
        host op, not one per sequence); above it, a slice copy per sequence."""
        width = self.max_context
        if len(locs) <= _SCATTER_MAX_TOKENS:
            values = locs.numpy()  # int64, cast to the table's int32 on assignment
            if len(spans) == 1:
                slot, start, n = spans[0]
                at = slot * width + start
                self._host_array[at : at + n] = values
            elif len(spans) == len(values):  # one token each: a decode step
                self._host_array[[slot * width + start for slot, start, _ in spans]] = values
            else:
                self._host_array[[slot * width + start + j for slot, start, n in spans
                                  for j in range(n)]] = values
            return
        locs32 = locs.to(torch.int32)
        if len(spans) == 1:
            slot, start, n = spans[0]
            self.host_table[slot, start : start + n] = locs32
            return
        offset = 0
        for slot, start, n in spans:
            self.host_table[slot, start : start + n] = locs32[offset : offset + n]
            offset += n

    def write_rows(self, slots: list[int], starts: list[int], n: int, locs: torch.Tensor
                   ) -> None:
        """``write_host`` of ``n`` tokens for every sequence: ``host_table[slots[i],
        starts[i]:starts[i] + n]`` gets ``locs[i * n:(i + 1) * n]`` (allocation time). One
        numpy scatter whose flat indices are computed over the batch, not per token."""
        if len(slots) == 1:  # one sequence: one slice, no index arrays
            at1 = slots[0] * self.max_context + starts[0]
            self._host_array[at1 : at1 + n] = locs.numpy()
            return
        at = np.array(slots, dtype=np.int64) * self.max_context + np.array(starts,
                                                                           dtype=np.int64)
        if n != 1:  # (sequences, n): each sequence's tokens are adjacent in ``locs``
            at = (at[:, None] + np.arange(n, dtype=np.int64)).ravel()
        self._host_array[at] = locs.numpy()  # int64, cast to the table's int32

    @property
    def device_flat(self) -> torch.Tensor:
        """The device table as one flat int32 vector, ``scratch_index`` its last cell: where
        ``table_index`` values point (for a kernel that writes the table itself)."""
        return self._device_flat

    def write_device(self, table_index: torch.Tensor, out_cache_loc: torch.Tensor) -> None:
        """Publish a packed batch's new locations to the device table from tensors already
        on the device (no host sync): token ``j``'s location lands at flat index
        ``table_index[j]`` (``slot * max_context + position``, see ``ForwardBatch``). One
        scatter: indexing by two index tensors cost about twice the host time.
        ``table_index`` may hold ``scratch_index`` (padding rows)."""
        self._device_flat.index_copy_(0, table_index, out_cache_loc.to(torch.int32))

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Row ``dst`` starts with the first ``n`` locations of row ``src`` (a fork), in the
        host mirror and, in stream order after every batch launched so far, on the device."""
        if n == 0:
            return
        self.host_table[dst, :n] = self.host_table[src, :n]
        self.device_table[dst, :n].copy_(self.device_table[src, :n], non_blocking=True)

    def locations(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Host copy of the locations of tokens ``start..end-1`` of ``slot``."""
        return self.host_table[slot, start:end].to(torch.int64)
