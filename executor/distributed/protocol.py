"""The fixed-size header rank 0 sends ahead of every operation the other ranks join.

One int64 tensor of ``HEADER_LEN`` entries, no pickling. A step's header is followed by
its packed batch (``executor.packing``: ``sizes.total`` int64 entries), which is all
the other ranks need to run the same forward: the token ids, positions, the KV locations
rank 0 allocated and where they go in the request-slot table. Allocation, release and
truncation live on rank 0 only; a fork is the one table change outside a step.

    STEP     phase, how the forward runs (``Mode``), bucket, the packed sizes, and how
             many sequences rank 0 samples for (their (slot, token) pairs follow on the
             device group, so every rank's ``LastSampled`` table stays the same)
    FORK     copy a prefix of one request-slot table row to another (and the parent's last
             sampled token, when the child inherits it)
    CAPTURE  which phases, force
    WEIGHTS  a weight operation (update, transfer group, sleep, wake-up): its arguments
             follow as one object on the control group (``executor/weights/control.py``)
    SHUTDOWN leave the loop
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from executor.api import Phase
from executor.packing import PackedSizes

HEADER_LEN = 12
_PHASES: tuple[Phase, ...] = ("prefill", "decode")


class Op(enum.IntEnum):
    STEP = 1
    CAPTURE = 2
    SHUTDOWN = 3
    FORK = 4
    WEIGHTS = 5


class Mode(enum.IntEnum):
    """How a step's forward runs; rank 0 decides, every rank does the same."""

    GRAPH = 0  # replay the bucket's graphs
    COMPILED = 1  # compiled pieces without graphs (tc_piecewise)
    LOGITS = 2  # eager forward, then logits of the sampled rows
    KV_ONLY = 3  # eager forward that only fills the KV cache


@dataclass(frozen=True)
class StepHeader:
    phase: Phase
    mode: Mode
    bucket: int | None
    sizes: PackedSizes
    #: Sequences rank 0 samples for in this step (0: none): their tokens follow on the
    #: device group.
    sampled: int

    def encode(self) -> list[int]:
        s = self.sizes
        values = [Op.STEP, _PHASES.index(self.phase), self.mode,
                  -1 if self.bucket is None else self.bucket, s.tokens, s.token_pad,
                  s.seqs, s.seq_pad, s.logits, int(s.has_decode_rows), int(self.sampled),
                  s.total]
        return [int(v) for v in values]


@dataclass(frozen=True)
class CaptureHeader:
    phases: tuple[Phase, ...]
    force: bool

    def encode(self) -> list[int]:
        mask = sum(1 << _PHASES.index(p) for p in self.phases)
        order = [_PHASES.index(p) for p in self.phases] + [-1] * (2 - len(self.phases))
        return _padded([Op.CAPTURE, mask, int(self.force), *order])


@dataclass(frozen=True)
class ForkHeader:
    """Row ``child`` of the request-slot table starts with the first ``length`` entries of
    row ``parent``; with ``inherit``, the child takes the parent's last sampled token."""

    parent: int
    child: int
    length: int
    inherit: bool

    def encode(self) -> list[int]:
        return _padded([Op.FORK, self.parent, self.child, self.length, int(self.inherit)])


@dataclass(frozen=True)
class WeightsHeader:
    """A weight operation every rank joins; its arguments follow on the control group."""

    def encode(self) -> list[int]:
        return _padded([Op.WEIGHTS])


@dataclass(frozen=True)
class ShutdownHeader:
    def encode(self) -> list[int]:
        return _padded([Op.SHUTDOWN])


Header = StepHeader | CaptureHeader | ForkHeader | WeightsHeader | ShutdownHeader


def _padded(values: Sequence[int]) -> list[int]:
    return [int(v) for v in values] + [0] * (HEADER_LEN - len(values))


def decode(values: Sequence[int]) -> Header:
    """The header ``encode`` wrote; a ValueError for anything else."""
    if len(values) != HEADER_LEN:
        raise ValueError(f"a header has {HEADER_LEN} entries, got {len(values)}")
    op = values[0]
    if op == Op.STEP:
        _, phase, mode, bucket, tokens, token_pad, seqs, seq_pad, logits, rows, sampled, \
            total = values
        sizes = PackedSizes(tokens, token_pad, seqs, seq_pad, logits, bool(rows))
        if sizes.total != total:
            raise ValueError(f"step header sizes add up to {sizes.total}, not {total}")
        return StepHeader(_PHASES[phase], Mode(mode), None if bucket < 0 else bucket, sizes,
                          sampled)
    if op == Op.CAPTURE:
        phases = tuple(_PHASES[i] for i in values[3:5] if i >= 0)
        return CaptureHeader(phases, bool(values[2]))
    if op == Op.FORK:
        return ForkHeader(values[1], values[2], values[3], bool(values[4]))
    if op == Op.SHUTDOWN:
        return ShutdownHeader()
    if op == Op.WEIGHTS:
        return WeightsHeader()
    raise ValueError(f"unknown operation {op} in a header")
