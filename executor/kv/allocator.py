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
        # Free locations are ``_free[_head:]``: allocating takes the next ``n`` from the
        # head (one slice and a copy; ascending at first, which keeps a lightly used pool
        # compact), freeing puts locations back just before it.
        self._free = torch.arange(1, size + 1, dtype=torch.int64)
        self._head = 0

    @property
    def num_free(self) -> int:
        return self.size - self._head

    def free_locations(self) -> torch.Tensor:
        """The free locations (a view: for checks, not to keep)."""
        return self._free[self._head :]

    def alloc(self, n: int) -> torch.Tensor:
        """Return ``n`` distinct free locations (a CPU int64 tensor) or raise OutOfResources."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} locations")
        if n > self.num_free:
            raise OutOfResources("kv_tokens", needed=n, free=self.num_free)
        out = self._free[self._head : self._head + n].clone()
        self._head += n
        return out

    def free(self, locations: torch.Tensor) -> None:
        """Return locations to the pool. The caller guarantees they were allocated."""
        n = int(locations.numel())
        if n == 0:
            return
        if n > self._head:
            raise RuntimeError("KV accounting broken: freeing more locations than are in use")
        self._head -= n
        self._free[self._head : self._head + n] = locations


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
