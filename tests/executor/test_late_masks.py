"""``LateMaskRing`` with the mask worker: rows with a mask apply it, rows without one allow
everything, an entry reused later holds only its new masks, a failed fill leaves its rows
unmasked and is raised; on CUDA (marker ``gpu``) the device reads the masks from pinned
memory after the worker wrote them, while the launching thread went on."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from executor.late_masks import ENTRIES, LateMaskRing
from executor.logit_controls import mask_words
from executor.mask_worker import MaskWorker

VOCAB = 70


def bitmask(ids: list[int], vocab: int = VOCAB) -> np.ndarray:
    bits = np.zeros(mask_words(vocab) * 32, dtype=np.uint8)
    bits[ids] = 1
    return np.packbits(bits, bitorder="little").view("<i4")


def filler(masks: list[list[int] | None]):  # type: ignore[no-untyped-def]
    def fill(out: torch.Tensor) -> np.ndarray:
        rows = out.numpy()
        for r, ids in enumerate(masks):
            rows[r] = -1 if ids is None else bitmask(ids)
        return np.array([ids is not None for ids in masks])
    return fill


def finite(logits: torch.Tensor) -> list[list[int]]:
    return [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]


def test_masks_apply_per_row_and_entries_are_reused_cleanly() -> None:
    worker = MaskWorker(torch.device("cpu"))
    ring = LateMaskRing(8, VOCAB, torch.device("cpu"))
    assert not ring._entries  # (made at the first grammar step, not at start-up)
    steps = [[[7, 8], None, [VOCAB - 1]], [None, [3], [4]], [[9], [10], None]]
    for k in range(2 * ENTRIES):  # every entry used twice
        masks = steps[k % len(steps)]
        logits = torch.randn(3, VOCAB)
        ring.apply(logits, filler(masks), worker)
        assert finite(logits) == [ids if ids is not None else list(range(VOCAB))
                                  for ids in masks]
    worker.close()


def test_a_failed_fill_leaves_rows_unmasked_and_is_raised() -> None:
    worker = MaskWorker(torch.device("cpu"))
    ring = LateMaskRing(4, VOCAB, torch.device("cpu"))

    def broken(out: torch.Tensor) -> np.ndarray:
        out.zero_()  # (half-written: a mask allowing nothing)
        raise ValueError("fill failed")

    logits = torch.randn(2, VOCAB)
    ring.apply(logits, broken, worker)
    assert bool(torch.isfinite(logits).all())
    with pytest.raises(RuntimeError, match="fill failed"):
        worker.raise_failure()
    worker.close()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64])
def test_the_device_reads_masks_the_worker_writes_later(rows: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    vocab = 128256
    worker = MaskWorker(torch.device("cuda"))
    ring = LateMaskRing(rows, vocab, torch.device("cuda"))
    # Every kernel below runs once first: the first launch of a kernel loads its module,
    # which waits for the device to go idle (here: for the job), as any first use would.
    warm = torch.zeros(rows, vocab, device="cuda")
    ring.apply(warm, lambda out: np.ones(rows, dtype=bool), worker)
    warm.argmax(dim=-1)
    torch.cuda.Event().record()
    torch.cuda.synchronize()
    release = threading.Event()

    def fill(out: torch.Tensor) -> np.ndarray:
        release.wait(10)
        words = out.numpy()
        words[:] = 0
        for r in range(rows):
            tok = (r * 997) % vocab
            words[r, tok // 32] = np.int32(np.uint32(1 << (tok % 32)).view(np.int32))
        return np.ones(rows, dtype=bool)

    logits = torch.randn(rows, vocab, device="cuda")
    started = time.perf_counter()
    ring.apply(logits, fill, worker)
    picked = logits.argmax(dim=-1)
    done = torch.cuda.Event()
    done.record()
    queued = time.perf_counter() - started
    time.sleep(0.2)
    held = not done.query()
    release.set()
    done.synchronize()
    assert queued < 2.0 and held
    assert picked.tolist() == [(r * 997) % vocab for r in range(rows)]
    worker.raise_failure()
    worker.close()
