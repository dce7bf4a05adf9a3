"""Sleep: device memory given back, and taken again on wake-up.

Each tag names storages: ``weights`` (every parameter's storage, shared ones once) and
``kv_cache`` (the K and V pools). Sleeping a storage resizes it to zero bytes
(``untyped_storage().resize_(0)``) and, on CUDA, empties the caching allocator, so the
memory goes back to the device; the tensors, their views and every module keep pointing
at the same storage objects. Waking resizes them back (new device addresses: captured
graphs must be recaptured, which ``WeightControl`` does) and copies a weights backup from
pinned host memory. Weights may instead be discarded: their storage comes back
uninitialised and must be refilled (an update) before a step runs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from executor.api import SleepTag as Tag


def _storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """Each distinct storage behind ``tensors`` once (tied weights share one)."""
    out: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            out.setdefault(storage.data_ptr(), storage)
    return list(out.values())


def _bytes_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor (shares its memory)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class SleepingMemory:
    """Which tags sleep, the storages behind each, and the weights' host backup."""

    def __init__(self, weights: Iterable[torch.Tensor], kv: Iterable[torch.Tensor],
                 device: torch.device) -> None:
        self.device = device
        self._storages: dict[Tag, list[torch.UntypedStorage]] = {
            "weights": _storages(weights), "kv_cache": _storages(kv)}
        self._sizes = {tag: [s.nbytes() for s in ss] for tag, ss in self._storages.items()}
        self.asleep: set[Tag] = set()
        self.discarded = False  # weights came back uninitialised: an update must refill
        self._backup: list[torch.Tensor] | None = None

    def nbytes(self, tag: Tag) -> int:
        return sum(self._sizes[tag])

    def sleep(self, tag: Tag, discard: bool = False) -> int:
        """Release ``tag``'s memory (weights: backed up to host first unless
        ``discard``); bytes given back, 0 when it already slept."""
        if tag in self.asleep:
            if tag == "weights" and discard and self._backup is not None:
                self._backup, self.discarded = None, True  # a backup no longer wanted
            return 0
        if tag == "weights" and not discard:
            self._backup = [self._copy_out(s) for s in self._storages[tag]]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no kernel still reads them
        for storage in self._storages[tag]:
            storage.resize_(0)
        if tag == "weights":
            self.discarded = discard
        self.asleep.add(tag)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return self.nbytes(tag)

    def wake(self, tag: Tag) -> None:
        """Take ``tag``'s memory back (new addresses); weights get their backup back, or
        stay ``discarded`` (uninitialised) until an update refills them."""
        if tag not in self.asleep:
            return
        for storage, size in zip(self._storages[tag], self._sizes[tag], strict=True):
            storage.resize_(size)
        if tag == "weights" and self._backup is not None:
            for storage, backup in zip(self._storages[tag], self._backup, strict=True):
                _bytes_view(storage, self.device).copy_(backup, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the pinned backup may go now
            self._backup = None
        if tag == "kv_cache":  # nothing lives in it: zeros, as at start-up
            for storage in self._storages[tag]:
                _bytes_view(storage, self.device).zero_()
        self.asleep.discard(tag)

    def refilled(self) -> None:
        """An update wrote every weight: the discarded state is over."""
        self.discarded = False

    def _copy_out(self, storage: torch.UntypedStorage) -> torch.Tensor:
        src = _bytes_view(storage, self.device)
        pinned = self.device.type == "cuda"
        backup = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=pinned)
        backup.copy_(src)
        return backup
