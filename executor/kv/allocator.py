"""Exact, host-side allocators for KV token locations and request slots.

Both are free-stacks: O(n) to allocate or free n items, no fragmentation (page size 1),
and ``free + used == total`` by construction. They never allocate partially: ``alloc``
either returns everything asked for or raises before changing anything.
"""

from __future__ import annotations

import torch

from executor.errors import OutOfResources

# Location 0 of every KV buffer is reserved: padded rows of a CUDA-graph batch write their
# K/V there, so it is never handed to a sequence.
RESERVED_LOCATION = 0


class TokenAllocator:
    """Hands out token locations ``1..size`` (0 is reserved; see ``RESERVED_LOCATION``)."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"KV pool needs at least one token location, got {size}")
        self.size = size
        # The top of the stack is at the end; allocating from the end hands out low
        # locations first, which keeps a lightly used pool compact.
        self._free = torch.arange(size, 0, -1, dtype=torch.int64)
        self._num_free = size

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.size - self._num_free

    def alloc(self, n: int) -> torch.Tensor:
        """Return ``n`` distinct free locations (a CPU int64 tensor) or raise OutOfResources."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} locations")
        if n > self._num_free:
            raise OutOfResources("kv_tokens", needed=n, free=self._num_free)
        start = self._num_free - n
        out = self._free[start : self._num_free].flip(0).clone()
        self._num_free = start
        return out

    def free(self, locations: torch.Tensor) -> None:
        """Return locations to the pool. The caller guarantees they were allocated."""
        n = int(locations.numel())
        if n == 0:
            return
        if self._num_free + n > self.size:
            raise RuntimeError("KV accounting broken: freeing more locations than are in use")
        self._free[self._num_free : self._num_free + n] = locations.flip(0).to(torch.int64)
        self._num_free += n


class SlotAllocator:
    """Hands out rows ``0..size-1`` of the request-slot table."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"need at least one sequence slot, got {size}")
        self.size = size
        self._free: list[int] = list(range(size - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfResources("sequence_slots", needed=n, free=len(self._free))
        out = [self._free.pop() for _ in range(n)]
        return out

    def free(self, slot: int) -> None:
        if len(self._free) >= self.size:
            raise RuntimeError("slot accounting broken: freeing more slots than are in use")
        self._free.append(slot)
