"""What graphs cost: device memory at capture, GPU time at replay."""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


@contextmanager
def frozen_gc() -> Iterator[None]:
    """Python GC frozen during capture (no collection pauses mid-capture), collected after."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.collect()


class CaptureMemory:
    """How much device memory a runner's graphs hold, read while they are captured.

    Graph memory is two things:

    * static buffers every bucket shares (attention's static metadata, the shared output):
      counted as the bytes *allocated* for them (``allocated_by``); free memory would miss
      a buffer the caching allocator carves out of a segment it already holds;
    * per bucket, the drop in free memory across the capture alone (``held_by``): a
      graph pool's segments are its own, so they show there. Cached blocks are given back
      on both sides of the reading, so what the eager ops between breakable segments
      leave cached (reused, and given back) is not counted.

    The caller warms each bucket up before its reading: kernels loaded at first use,
    library workspaces and warm-up activations are then not counted (a first capture in a
    process would otherwise report a few hundred MiB that are not the graphs'). Within a
    ``session``, garbage is collected first and the collector is frozen, so no dropped
    object is freed in the middle of a reading.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @contextmanager
    def session(self) -> Iterator[None]:
        with frozen_gc():
            torch.cuda.empty_cache()
            try:
                yield
            finally:
                # Warm-up activations stay cached for the capture stream alone: give them
                # back (the graphs' pools are not touched).
                torch.cuda.empty_cache()

    def allocated_by(self, fn: Callable[[], None]) -> int:
        """Bytes allocated (and kept) by ``fn``."""
        before = torch.cuda.memory_allocated(self.device)
        fn()
        return torch.cuda.memory_allocated(self.device) - before

    def held_by(self, fn: Callable[[], object]) -> int:
        """The drop in free device memory across ``fn``, cached blocks given back."""
        before = self._free()
        fn()
        return max(0, before - self._free())

    def _free(self) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]


class ReplayTimer:
    """CUDA events around replays, read later without adding a host sync to the step. The
    event pairs of drained replays are kept and recorded again (a replay then creates and
    destroys no event), at most ``spare`` of them."""

    def __init__(self, device: torch.device, maxlen: int = 4096, spare: int = 64) -> None:
        self.pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque(maxlen=maxlen)
        self._spare: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._keep = spare
        # Replays run on the device's default stream; resolving the current stream on every
        # record costs more host time than the record itself.
        self._stream = torch.cuda.current_stream(device)

    def start(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Record a replay's start; ``stop`` with what it returns records its end."""
        pair = self._spare.pop() if self._spare else (torch.cuda.Event(enable_timing=True),
                                                     torch.cuda.Event(enable_timing=True))
        pair[0].record(self._stream)
        return pair

    def stop(self, pair: tuple[torch.cuda.Event, torch.cuda.Event]) -> None:
        pair[1].record(self._stream)
        self.pending.append(pair)

    def drain(self) -> list[float]:
        """Seconds of every finished replay since the last drain (unfinished ones stay)."""
        out = []
        while self.pending and self.pending[0][1].query():
            pair = self.pending.popleft()
            out.append(pair[0].elapsed_time(pair[1]) / 1e3)
            if len(self._spare) < self._keep:  # both recorded and passed: free to reuse
                self._spare.append(pair)
        return out
