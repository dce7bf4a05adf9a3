"""Bucket lists and padding math (pure; tested on CPU).

A bucket is a static shape a graph is captured for: a batch size (decode) or a packed
token count (prefill). A batch runs in the smallest bucket that holds it, padded.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


def default_decode_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to ``max_batch`` (which is always included)."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return tuple(sorted({*small, *range(8, max_batch, 8), max_batch}))


# (start, stop inclusive, step) ranges of the default prefill token buckets.
_PREFILL_RANGES = ((4, 32, 4), (48, 256, 16), (288, 512, 32), (576, 1024, 64), (1280, 4096, 256))


def default_prefill_buckets(max_tokens: int) -> tuple[int, ...]:
    """4..32 step 4, 48..256 step 16, 288..512 step 32, 576..1024 step 64, 1280..4096 step
    256, capped by ``max_tokens`` (included when the cap falls inside the list)."""
    full = [n for lo, hi, step in _PREFILL_RANGES for n in range(lo, hi + 1, step)]
    out = [n for n in full if n <= max_tokens]
    if max_tokens < full[-1] and (not out or out[-1] != max_tokens):
        out.append(max_tokens)
    return tuple(out)


def normalize_buckets(buckets: Iterable[int]) -> tuple[int, ...]:
    """Sorted, de-duplicated, positive."""
    out = tuple(sorted(set(buckets)))
    if not out or out[0] <= 0:
        raise ValueError(f"buckets must be positive integers, got {out}")
    return out


def bucket_for(size: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= ``size``, or None when ``size`` exceeds the largest."""
    i = bisect.bisect_left(buckets, size)
    return buckets[i] if i < len(buckets) else None
