"""``LateMaskRing``: grammar masks that the device reads from pinned host memory.

A step's grammar masks are made by the mask worker (``mask_worker.py``) after the step's
sampling is queued: the launching thread picks a ring entry (pinned (rows, words) int32
rows, xgrammar's bitmask layout), queues the fill job and the device's wait for it, then
the kernel that masks the logits reading the entry straight from host memory (mapped:
nothing but that kernel crosses the link, and no copy is queued behind the wait). Entries
are used in turn, and refilling one cannot race the kernel that read it: jobs run in
launch order and each waits for the tokens of every grammar step launched before it (or
for the device step before it), which that kernel preceded. On CPU the masks are applied
with torch ops once the launching thread has waited for the job.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from executor.logit_controls import mask_words, unpack_bitmask
from executor.mask_worker import MaskWorker

#: Ring entries: a multi-step decode queues several steps' masks ahead.
ENTRIES = 4


class LateMaskRing:
    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.vocab, self.device, self.rows = vocab, device, rows
        # The pinned entries (rows x words each) are made at the first grammar step: a
        # server that never sees a grammar does not hold them.
        self._entries: list[torch.Tensor] = []
        self._turn = 0
        # The apply kernel's other tables (CUDA): row r is its own "slot", no bias.
        if device.type == "cuda":
            self._rows = torch.arange(rows, dtype=torch.int64, device=device)
            self._active = torch.ones(rows, dtype=torch.int32, device=device)
            self._bias_ids = torch.zeros(rows, 1, dtype=torch.int64, device=device)
            self._bias_vals = torch.zeros(rows, 1, dtype=torch.float32, device=device)

    def apply(self, logits: torch.Tensor, fill: Callable[[torch.Tensor], np.ndarray],
              worker: MaskWorker) -> None:
        """Mask ``logits`` (rows, vocab) in place by the rows ``fill(out)`` writes into
        ``out`` (all ones for a row without a mask): ``fill`` runs as a ``worker`` job,
        and what reads its rows waits for it (the device, or on CPU this thread)."""
        n = logits.shape[0]
        if not self._entries:
            self._entries = [torch.full((self.rows, mask_words(self.vocab)), -1,
                                        dtype=torch.int32, pin_memory=self.device.type == "cuda")
                             for _ in range(ENTRIES)]
        k = self._turn
        self._turn = (k + 1) % ENTRIES
        out = self._entries[k][:n]

        def job() -> None:
            try:
                fill(out)
            except BaseException:
                out.fill_(-1)  # (unmasked rows; the failure is raised at completion)
                raise

        worker.gate(worker.submit(job))
        if not logits.is_cuda:
            keep = unpack_bitmask(out, self.vocab)
            logits.masked_fill_(~keep, float("-inf"))
            return
        from executor.kernels.logit_controls import apply_controls

        apply_controls(logits, self._rows[:n], self._active[:n], out, self._bias_ids[:n],
                       self._bias_vals[:n])
