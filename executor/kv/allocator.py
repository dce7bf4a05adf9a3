"""Exact, host-side allocators for KV token locations and request slots.

Both are free-stacks: O(n) to allocate or free n items, no fragmentation (page size 1),
and ``free + used == total`` by construction. They never allocate partially: ``alloc``
either returns everything asked for or raises before changing anything.

Token locations can be shared (``Fork``): a location held by k sequences has ``k - 1``
extra references, and ``free`` drops one reference, returning the location to the pool
only with its last one. Unshared locations (the common case) carry no reference count at
all, so allocation never touches the counts and a free with nothing shared anywhere is
the plain stack push.
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
        # The same memory as a numpy array: ``alloc`` slices and copies it without two
        # dispatcher calls (a decode step allocates every step).
        self._free_array = self._free.numpy()
        self._head = 0
        # References beyond the first, by location (0 for free and singly held ones).
        self._extra = torch.zeros(size + 1, dtype=torch.int32)
        self._extra_total = 0  # sum of ``_extra``: 0 means nothing is shared
        #: Locations held by more than one sequence.
        self.num_shared = 0

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
        out = torch.from_numpy(self._free_array[self._head : self._head + n].copy())
        self._head += n
        return out

    def share(self, locations: torch.Tensor) -> None:
        """Add one holder to each of ``locations`` (distinct, allocated): a forked sequence
        now holds them too."""
        n = int(locations.numel())
        if n == 0:
            return
        extra = self._extra[locations]
        self.num_shared += int((extra == 0).sum())
        self._extra[locations] = extra + 1
        self._extra_total += n

    def references(self, locations: torch.Tensor) -> torch.Tensor:
        """How many sequences hold each of ``locations`` (allocated ones; for checks)."""
        return self._extra[locations] + 1

    def free(self, locations: torch.Tensor) -> int:
        """Drop one holder of each of ``locations`` (distinct; the caller guarantees they
        were allocated) and return to the pool those it was the last holder of; returns
        how many went back."""
        n = int(locations.numel())
        if n == 0:
            return 0
        if self._extra_total:
            extra = self._extra[locations]
            shared = extra > 0
            if bool(shared.any()):
                held = locations[shared]
                left = extra[shared] - 1
                self._extra[held] = left
                self._extra_total -= int(held.numel())
                self.num_shared -= int((left == 0).sum())
                locations = locations[~shared]
                n = int(locations.numel())
                if n == 0:
                    return 0
        if n > self._head:
            raise RuntimeError("KV accounting broken: freeing more locations than are in use")
        self._head -= n
        self._free[self._head : self._head + n] = locations
        return n


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
