"""The packed step: one int64 buffer per batch, its field order, its padding, its views.

Every step's integer metadata crosses to the device as one transfer; only this module
knows where each field sits in it (everyone else asks for fields by name).

    per token     (s entries each): input_ids | positions | table_index | out_cache_loc
    per sequence (sb entries each): slots | seq_lens | prefix_lens | extend_lens |
                                    extend_start
    then                          : logits_indices (one per sequence that samples)

A plain batch has ``s = T`` tokens and ``sb = B`` sequences. A graph bucket's batch
(``GraphLayout``) pads the token fields to the bucket, and a decode batch its sequence
fields too, so ``out_cache_loc | slots | seq_lens`` (``DECODE_ROW_FIELDS``) read as one
``(3, bucket)`` block. Padding is inert: a padded token is token 0 at position 0 writing
the reserved KV location; a padded decode row is slot 0 with length 1 (no table read).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import repeat

import numpy as np
import torch

from executor.api import Phase
from executor.kv.allocator import RESERVED_LOCATION

TOKEN_FIELDS = ("input_ids", "positions", "table_index", "out_cache_loc")
SEQUENCE_FIELDS = ("slots", "seq_lens", "prefix_lens", "extend_lens",
                   "extend_start")
FIELDS = (*TOKEN_FIELDS, *SEQUENCE_FIELDS, "logits_indices")

#: The rows of decode attention metadata, in the order the packed batch lays them out.
DECODE_ROW_FIELDS = ("out_cache_loc", "slots", "seq_lens")
_first = FIELDS.index(DECODE_ROW_FIELDS[0])
assert FIELDS[_first : _first + 3] == DECODE_ROW_FIELDS, "decode rows must be adjacent"

#: An ``input_ids`` entry of a decode batch that stands for its sequence's last sampled
#: token, read on the device (``LastSampled.tokens``) by the graph prologue or the eager
#: forward: the step need not wait for the previous step's tokens to reach the host.
USE_LAST_SAMPLED = -1

#: What padding holds, per field. ``table_index`` pads with the layout's scratch cell.
PAD: Mapping[str, int] = {
    "input_ids": 0, "positions": 0, "out_cache_loc": RESERVED_LOCATION,
    "slots": 0, "seq_lens": 1, "prefix_lens": 0, "extend_lens": 1,
    "extend_start": 0,
}
#: A padded decode row (``DECODE_ROW_FIELDS`` order): attention backends whose static
#: decode rows are refreshed from a packed batch pad their own rows with it.
DECODE_PAD_ROW: tuple[int, int, int] = (PAD["out_cache_loc"], PAD["slots"],
                                        PAD["seq_lens"])


@dataclass(frozen=True)
class PackedSizes:
    """How many real and padding entries each field of one packed batch has."""

    tokens: int  # T
    token_pad: int  # s - T
    seqs: int  # B
    seq_pad: int  # sb - B
    logits: int  # S
    #: A decode batch: its ``DECODE_ROW_FIELDS`` read as one (3, s) block.
    has_decode_rows: bool = False

    @staticmethod
    def of(tokens: int, seqs: int, logits: int, bucket: int | None, decode: bool
           ) -> PackedSizes:
        """Sizes of a batch, plain (``bucket`` None) or padded to ``bucket``; a decode
        batch pads its sequence fields to the bucket too."""
        s = tokens if bucket is None else bucket
        if s < tokens:
            raise ValueError(f"{tokens} tokens do not fit a bucket of {s}")
        if decode and seqs != tokens:
            raise ValueError(f"a decode batch has one token per sequence, not {tokens} "
                             f"tokens over {seqs}")
        seq_pad = s - seqs if decode else 0
        return PackedSizes(tokens, s - tokens, seqs, seq_pad, logits, decode)

    @property
    def total(self) -> int:
        return (len(TOKEN_FIELDS) * (self.tokens + self.token_pad)
                + len(SEQUENCE_FIELDS) * (self.seqs + self.seq_pad) + self.logits)

    def offset(self, field: str) -> int:
        """Where ``field`` starts in the packed buffer."""
        at = 0
        for name in FIELDS:
            if name == field:
                return at
            at += self.span(name)
        raise KeyError(field)

    def span(self, field: str) -> int:
        """Entries ``field`` takes, padding included."""
        if field in TOKEN_FIELDS:
            return self.tokens + self.token_pad
        if field in SEQUENCE_FIELDS:
            return self.seqs + self.seq_pad
        return self.logits

    def padding(self, field: str) -> int:
        """Padding entries after ``field``'s real ones."""
        if field in TOKEN_FIELDS:
            return self.token_pad
        if field in SEQUENCE_FIELDS:
            return self.seq_pad
        return 0

    def chunks(self) -> list[int]:
        """``split_with_sizes`` sizes: each field's real entries, then its padding."""
        out: list[int] = []
        for name in FIELDS:
            if name in TOKEN_FIELDS:
                out += (self.tokens, self.token_pad)
            elif name in SEQUENCE_FIELDS:
                out += (self.seqs, self.seq_pad)
            else:
                out.append(self.logits)
        return out


@lru_cache(maxsize=16)
def _pads(table_scratch: int) -> Mapping[str, int]:
    """What padding holds per field (one mapping per scratch cell, made once: read only)."""
    return {"table_index": table_scratch, **PAD}


def pack_lists(fields: Mapping[str, Sequence[int]], sizes: PackedSizes,
               table_scratch: int) -> array:
    """The packed host buffer from per-field Python lists (cheapest for small batches)."""
    pads = _pads(table_scratch)
    out = array("q")
    # (``FIELDS`` order: the token fields, the sequence fields, then logits_indices)
    for names, n in ((TOKEN_FIELDS, sizes.token_pad), (SEQUENCE_FIELDS, sizes.seq_pad)):
        for name in names:
            out.extend(fields[name])
            if n:
                out.extend(repeat(pads[name], n))
    out.extend(fields["logits_indices"])
    return out


@lru_cache(maxsize=256)
def _one_each_frame(sizes: PackedSizes, table_scratch: int
                    ) -> tuple[np.ndarray, dict[str, slice]]:
    """The packed buffer of a batch of one new token per sequence, less what changes from
    step to step (read-only; the real entries of those fields are 0), and each field's
    real entries as a slice: padding, ``extend_lens`` 1 and ``extend_start`` 0..B-1
    (token i is row i)."""
    pads = _pads(table_scratch)
    out = np.zeros(sizes.total, dtype=np.int64)
    real: dict[str, slice] = {}
    chunks = iter(sizes.chunks())  # each field's real entries, then (not logits) padding
    at = 0
    for name in FIELDS:
        n = next(chunks)
        real[name] = slice(at, at + n)
        if name == "extend_lens":
            out[at : at + n] = 1
        elif name == "extend_start":
            out[at : at + n] = np.arange(n, dtype=np.int64)
        at += n
        if name != "logits_indices" and (pad := next(chunks)):
            out[at : at + pad] = pads[name]
            at += pad
    out.flags.writeable = False
    return out, real


def pack_one_each(token_ids: Sequence[int], slots: Sequence[int], prefix: Sequence[int],
                  locations: np.ndarray, logits_rows: Sequence[int], sizes: PackedSizes,
                  table_scratch: int, table_width: int) -> tuple[np.ndarray, np.ndarray]:
    """The packed host buffer of a batch of one new token per sequence (a decode step):
    sequence i's token is row i, at position ``prefix[i]``. A copy of the batch's fixed
    frame (``_one_each_frame``, made once per sizes) with the per-step fields written by
    a few numpy calls, whatever the batch size. Returns it and its ``seq_lens`` (a view)."""
    frame, real = _one_each_frame(sizes, table_scratch)
    out = frame.copy()
    out[real["input_ids"]] = token_ids
    slots_a = out[real["slots"]]
    slots_a[:] = slots
    prefix_a = out[real["prefix_lens"]]
    prefix_a[:] = prefix
    out[real["positions"]] = prefix_a
    seq_lens = out[real["seq_lens"]]
    np.add(prefix_a, 1, out=seq_lens)
    table_index = out[real["table_index"]]
    np.multiply(slots_a, table_width, out=table_index)
    table_index += prefix_a
    out[real["out_cache_loc"]] = locations
    out[real["logits_indices"]] = logits_rows
    return out, seq_lens


def pack_tensors(fields: Mapping[str, torch.Tensor], sizes: PackedSizes,
                 table_scratch: int) -> torch.Tensor:
    """The packed host buffer from per-field int64 CPU tensors (large batches)."""
    pads = _pads(table_scratch)
    parts: list[torch.Tensor] = []
    for name in FIELDS:
        parts.append(fields[name])
        if n := sizes.padding(name):
            parts.append(torch.full((n,), pads[name], dtype=torch.int64))
    return torch.cat(parts)


def split_packed(buf: torch.Tensor, sizes: PackedSizes) -> dict[str, torch.Tensor]:
    """Views of each field's real entries in ``buf`` (one split, padding chunks dropped),
    plus ``decode_rows``, the (3, B) view of ``DECODE_ROW_FIELDS``, when the batch has
    them as one block (a decode batch), else ``sequence_rows``, the (5, B) view of
    ``SEQUENCE_FIELDS`` (a prefill's fields have no padding between them)."""
    views = buf[: sizes.total].split_with_sizes(sizes.chunks())
    out: dict[str, torch.Tensor] = {}
    i = 0
    for name in FIELDS:
        out[name] = views[i]
        i += 1 if name == "logits_indices" else 2
    if sizes.has_decode_rows:
        s, start = sizes.span("out_cache_loc"), sizes.offset("out_cache_loc")
        out["decode_rows"] = buf[start : start + 3 * s].view(3, s)[:, : sizes.seqs]
    elif sizes.seqs:  # (not for decode: its steps have no use for it, and it costs views)
        start = sizes.offset(SEQUENCE_FIELDS[0])
        out["sequence_rows"] = buf[start : start + len(SEQUENCE_FIELDS) * sizes.seqs].view(
            len(SEQUENCE_FIELDS), sizes.seqs)
    return out


#: Cached views per layout before the cache starts over.
_VIEWS_KEPT = 256


@dataclass(frozen=True)
class GraphLayout:
    """How a batch bound for one CUDA-graph bucket is packed, and where it lands.

    The batch is padded to ``bucket`` tokens (a decode batch also to ``bucket`` rows) and
    copied into ``dest``, a device buffer whose address never changes, so a captured
    prologue reads its fields at fixed places: the named views below. Padded tokens write
    the table at ``table_scratch``. A batch packed this way is a set of views of ``dest``,
    valid until the next batch is packed for the same runner.
    """

    bucket: int
    table_scratch: int
    dest: torch.Tensor  # (>= max_packed_size(bucket),) int64 on the device
    phase: Phase = "prefill"
    # Views of ``dest`` by packed sizes: a decode batch of one size repeats them every
    # step, and each view costs a dispatcher call to make (``views``, ``prefix``).
    _views: dict[PackedSizes, dict[str, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False)
    _prefixes: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def prefix(self, n: int) -> torch.Tensor:
        """``dest[:n]``, where a batch of ``n`` packed entries lands."""
        view = self._prefixes.get(n)
        if view is None:
            if len(self._prefixes) >= _VIEWS_KEPT:  # prefill sizes vary without end
                self._prefixes.clear()
            view = self._prefixes[n] = self.dest[:n]
        return view

    def views(self, sizes: PackedSizes) -> dict[str, torch.Tensor]:
        """``split_packed`` of ``dest`` for a batch of ``sizes`` (the same tensors each
        time: views of the fixed buffer, whatever batch was packed into it last)."""
        views = self._views.get(sizes)
        if views is None:
            if len(self._views) >= _VIEWS_KEPT:
                self._views.clear()
            views = self._views[sizes] = split_packed(self.dest, sizes)
        return views

    @staticmethod
    def max_packed_size(bucket: int) -> int:
        """Entries a batch packed for ``bucket`` may take: every field at one entry per
        token (at most one sequence, and one sampled row, per token)."""
        return len(FIELDS) * bucket

    @property
    def frame(self) -> PackedSizes:
        """The sizes of a batch of padding only: the fixed frame every batch fills."""
        return PackedSizes.of(0, 0, 0, self.bucket, self.phase == "decode")

    def field(self, name: str) -> torch.Tensor:
        """The whole region of a token field (or, for decode, a sequence field) in
        ``dest``: real entries then padding, ``bucket`` of them."""
        frame = self.frame
        if frame.span(name) != self.bucket:
            raise KeyError(f"{name!r} has no fixed place in a {self.phase} layout")
        start = frame.offset(name)
        return self.dest[start : start + self.bucket]

    @property
    def decode_rows(self) -> torch.Tensor:
        """The (3, bucket) block of ``DECODE_ROW_FIELDS`` (decode layouts only)."""
        if self.phase != "decode":
            raise KeyError("only a decode layout has decode rows")
        start = self.frame.offset(DECODE_ROW_FIELDS[0])
        return self.dest[start : start + 3 * self.bucket].view(3, self.bucket)

    def fill_padding(self) -> None:
        """Make ``dest`` hold a batch of padding only (device-side fills, no transfer):
        what a prologue may run on before any real batch was packed."""
        pads, frame = _pads(self.table_scratch), self.frame
        for name in FIELDS:
            if frame.span(name) == self.bucket:
                self.field(name).fill_(pads[name])
