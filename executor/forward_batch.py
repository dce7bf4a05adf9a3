"""``ForwardBatch``: everything one forward pass needs, passed explicitly (no globals)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from executor.api import Phase
from executor.kv.allocator import RESERVED_LOCATION
from executor.kv.manager import Allocation

# Up to this many new tokens, ``ForwardBatch.build`` packs Python lists (cheapest for a
# decode step); above it, tensor ops (2048 tokens: 1.3 ms as lists, 0.3 ms as tensors, on
# a slow 2-vCPU machine).
_LIST_BUILD_MAX_TOKENS = 256


class PinnedStaging:
    """The pinned host buffer every batch's packed metadata passes through on its way to
    the device: a host memcpy into it and one asynchronous copy out, instead of a pinned
    tensor made per batch. Measured on a lent H100 host (2026-11-25, 650 ints):
    ``torch.tensor(list, pin_memory=True)`` 45-50 us; here ``array("q")`` 12-20 us (in
    ``ForwardBatch.build``), the host copy 5-9 us, the event record 6-14 us (these hosts
    vary): a modest saving, and no pinned allocation per batch.

    Reuse is safe because the next batch first waits for the event recorded after the
    previous copy (by then long finished: every step ends with a host sync). A batch
    packed plain gets its own device tensor, so batches built before an earlier one ran
    stay intact; one packed for a graph bucket lands in the runner's fixed buffer
    (``GraphLayout``) instead. CUDA only; one owner (the executor), one thread.
    """

    def __init__(self, device: torch.device, capacity: int = 4096) -> None:
        self.device = device
        self._host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self._copied = torch.cuda.Event()
        self._pending = False
        # NOTE: the executor runs every step on the device's current stream at start-up
        # (as ``ReplayTimer`` does); looking it up per call costs more than the record.
        self._stream = torch.cuda.current_stream(device)

    def to_device(self, values: torch.Tensor, dest: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """A device copy of the int64 CPU tensor ``values`` (enqueued, not waited for):
        a new tensor, or the leading ``values.numel()`` entries of ``dest``."""
        n = values.numel()
        if self._pending:
            self._copied.synchronize()  # the previous copy has read the buffer
        if n > self._host.numel():
            self._host = torch.empty(max(n, 2 * self._host.numel()), dtype=torch.int64,
                                     pin_memory=True)
        host = self._host[:n]
        host.copy_(values)
        dev = torch.empty(n, dtype=torch.int64, device=self.device) if dest is None \
            else dest[:n]
        dev.copy_(host, non_blocking=True)
        self._copied.record(self._stream)
        self._pending = True
        return dev


@dataclass(frozen=True)
class ForwardBatch:
    """A packed batch: ``T`` new tokens over ``B`` sequences, no padding.

    Sequence ``i`` contributes tokens ``extend_start[i] : extend_start[i] + extend_lens[i]``
    of the packed tensors; they sit at positions ``prefix_lens[i] ..`` of that sequence,
    whose cached prefix (``prefix_lens[i]`` tokens) is already in the KV pool. Decode is the
    special case ``extend_lens == 1``.

    Device tensors are what kernels and graphs read; the ``*_host`` tuples are the same
    values on the host, so eager code never needs a device-to-host sync.
    """

    phase: Phase
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    out_cache_loc: torch.Tensor  # (T,) int64: KV location each new token writes
    req_pool_indices: torch.Tensor  # (B,) int64: request-slot row of each sequence
    seq_lens: torch.Tensor  # (B,) int64: length after this step (prefix + new)
    prefix_lens: torch.Tensor  # (B,) int64
    extend_lens: torch.Tensor  # (B,) int64
    extend_start: torch.Tensor  # (B,) int64: offset of each sequence in the packed tokens
    logits_indices: torch.Tensor  # (S,) int64: packed rows whose logits are needed
    # (T,) int64: where each new token's location goes in the request-slot table, as a
    # flat index ``slot * table_width + position`` (one scatter publishes them)
    table_index: torch.Tensor
    req_pool_indices_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    prefix_lens_host: tuple[int, ...]
    extend_lens_host: tuple[int, ...]
    # A decode batch's (3, B) rows (out_cache_loc, req_pool_indices, seq_lens): one view
    # of the packed transfer, so graph metadata refreshes with one copy; None otherwise.
    decode_rows: torch.Tensor | None = None
    # The graph bucket the batch was packed for (``GraphLayout``); None when packed plain.
    bucket: int | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host)

    @property
    def extend_start_host(self) -> tuple[int, ...]:
        starts, acc = [], 0
        for n in self.extend_lens_host:
            starts.append(acc)
            acc += n
        return tuple(starts)

    @staticmethod
    def build(
        phase: Phase,
        token_ids: list[int],
        alloc: Allocation,
        logits_rows: list[int],
        device: torch.device,
        table_width: int,
        staging: PinnedStaging | None = None,
        layout: GraphLayout | None = None,
    ) -> ForwardBatch:
        """Pack a batch from the tokens of each sequence (in ``alloc`` order).

        ``logits_rows`` are indices into ``alloc.extensions`` of sequences that need the
        logits of their last new token. ``table_width`` is the request-slot table's row
        length (``table_index``). With ``staging`` (CUDA), the metadata travels through
        its pinned buffer. With ``layout``, the batch is packed for one graph bucket:
        padded to it and landing in the layout's fixed device buffer (see
        ``GraphLayout``), so a captured prologue can read it from there.

        All integer metadata travels in one host-to-device copy, then is split into
        views. The packed order, with ``s`` per-token and ``sb`` per-sequence entries
        (``s`` = T and ``sb`` = B, unless a layout pads them to its bucket):
        ``ids | positions | table_index | out_cache_loc`` (``s`` each), then ``slots |
        seq_lens | prefix_lens | extend_lens | extend_start`` (``sb`` each), then the
        logits rows. ``out_cache_loc | slots | seq_lens`` are adjacent, so a decode
        batch (T == B, so s == sb) has its graph rows as one view (``decode_rows``).
        """
        exts = alloc.extensions
        prefix = [e.prefix_len for e in exts]
        ext_lens = [e.new_len for e in exts]
        slots = [e.slot for e in exts]
        seq_lens = [e.seq_len for e in exts]
        starts: list[int] = []
        acc = 0
        for n in ext_lens:
            starts.append(acc)
            acc += n
        last_rows = [starts[i] + ext_lens[i] - 1 for i in logits_rows]
        b = len(exts)
        decode = phase == "decode" and acc == b
        s = acc if layout is None else layout.bucket
        if s < acc:
            raise ValueError(f"{acc} tokens do not fit a bucket of {s}")
        tok_pad = s - acc
        sb = s if decode else b  # a decode batch pads its rows too
        seq_pad = sb - b
        scratch = 0 if layout is None else layout.table_scratch
        pad_tok, pad_seq = _PAD_TOKEN, _PAD_SEQUENCE  # see GraphLayout
        pad_ids = [pad_tok["input_ids"]] * tok_pad
        per_seq = (slots + [pad_seq["slot"]] * seq_pad + seq_lens + [pad_seq["seq_len"]] * seq_pad
                   + prefix + [pad_seq["prefix_len"]] * seq_pad + ext_lens
                   + [pad_seq["extend_len"]] * seq_pad + starts + [pad_seq["start"]] * seq_pad
                   + last_rows)

        pin = device.type == "cuda" and staging is None  # pinned: the copy is asynchronous
        if acc <= _LIST_BUILD_MAX_TOKENS:  # decode, short prompts: plain lists are cheapest
            positions = [p for e in exts for p in range(e.prefix_len, e.prefix_len + e.new_len)]
            table_index = [e.slot * table_width + p for e in exts
                           for p in range(e.prefix_len, e.prefix_len + e.new_len)]
            # array("q") of a list, then a view of it: a third of torch.tensor(list)'s time
            packed = array("q", token_ids)
            for part in (pad_ids, positions, [pad_tok["position"]] * tok_pad, table_index,
                         [scratch] * tok_pad, alloc.out_cache_loc.tolist(),
                         [pad_tok["location"]] * tok_pad, per_seq):
                packed.extend(part)
            flat = torch.frombuffer(packed, dtype=torch.int64) if packed else \
                torch.empty(0, dtype=torch.int64)
        else:  # long prompts: no Python loop over tokens (~1 ms per 2048 of them)
            seq_t = torch.tensor(slots + prefix, dtype=torch.int64)
            starts_t = torch.tensor(starts, dtype=torch.int64)

            # Per-token values that are constant within a sequence, as a cumulative sum of
            # their changes at each sequence's first token (serial CPU ops: the CPU
            # repeat_interleave runs a parallel loop per call, which stalled for
            # milliseconds while compiler worker threads were busy).
            def per_token(values: torch.Tensor) -> torch.Tensor:
                steps = torch.zeros(acc, dtype=torch.int64)
                steps[starts_t] = torch.diff(values, prepend=values.new_zeros(1))
                return steps.cumsum(0)

            # Token j of sequence i sits at prefix_i + (j - start_i).
            positions_t = torch.arange(acc, dtype=torch.int64) + per_token(seq_t[b:] - starts_t)
            def pad(value: int) -> torch.Tensor:
                return torch.full((tok_pad,), value, dtype=torch.int64)

            flat = torch.cat((torch.frombuffer(array("q", token_ids), dtype=torch.int64),
                              pad(pad_tok["input_ids"]), positions_t, pad(pad_tok["position"]),
                              per_token(seq_t[:b]) * table_width + positions_t, pad(scratch),
                              alloc.out_cache_loc.to(torch.int64), pad(pad_tok["location"]),
                              torch.tensor(per_seq, dtype=torch.int64)))
        if pin:
            flat = flat.pin_memory()
        dest = None if layout is None else layout.dest
        if staging is not None and flat.numel():
            on_device = staging.to_device(flat, dest)
        elif dest is not None:
            on_device = dest[: flat.numel()]
            on_device.copy_(flat, non_blocking=True)
        else:
            on_device = flat.to(device, non_blocking=True)
        # One split (the method: torch.split's wrapper costs), padding chunks included.
        sizes = [acc, tok_pad] * 4 + [b, seq_pad] * 5 + [len(last_rows)]
        views = on_device.split_with_sizes(sizes)
        ids_d, pos_d, tab_d, locs_d = views[0:8:2]
        slots_d, seq_lens_d, prefix_d, ext_d, starts_d = views[8:18:2]
        return ForwardBatch(
            phase=phase,
            input_ids=ids_d,
            positions=pos_d,
            out_cache_loc=locs_d,
            req_pool_indices=slots_d,
            seq_lens=seq_lens_d,
            prefix_lens=prefix_d,
            extend_lens=ext_d,
            extend_start=starts_d,
            logits_indices=views[18],
            table_index=tab_d,
            req_pool_indices_host=tuple(slots),
            seq_lens_host=tuple(seq_lens),
            prefix_lens_host=tuple(prefix),
            extend_lens_host=tuple(ext_lens),
            decode_rows=on_device[3 * s : 6 * s].view(3, s)[:, :b] if decode else None,
            bucket=None if layout is None else layout.bucket,
        )


@dataclass(frozen=True)
class GraphLayout:
    """How a batch bound for one CUDA-graph bucket is packed and where it lands.

    The packed batch is padded to ``bucket`` tokens (a decode batch also to ``bucket``
    rows) and copied into ``dest``, a device buffer whose address never changes, so the
    graph runner's captured prologue reads its inputs from fixed offsets: ``ids`` at
    ``[0, bucket)``, positions at ``[bucket, 2 * bucket)``, the table index at
    ``[2 * bucket, 3 * bucket)``, the KV locations at ``[3 * bucket, 4 * bucket)`` and,
    for decode, the attention rows at ``[3 * bucket, 6 * bucket)``. Padded tokens write
    the table at ``table_scratch``. Such a batch's tensors are views of ``dest``: valid
    until the next batch is packed for the same runner.
    """

    bucket: int
    table_scratch: int
    dest: torch.Tensor  # (>= max_packed_size(bucket),) int64 on the device

    @staticmethod
    def max_packed_size(bucket: int) -> int:
        """Entries a batch packed for ``bucket`` may take: 4 per-token fields, 5 per
        sequence (at most one sequence per token) and one logits row per sequence."""
        return 10 * bucket

    def fill_padding(self) -> None:
        """Make ``dest`` hold a batch of padding only (device-side fills, no transfer):
        what a prologue may run on before any real batch was packed."""
        b, x = self.bucket, self.dest
        x[:b].fill_(_PAD_TOKEN["input_ids"])
        x[b : 2 * b].fill_(_PAD_TOKEN["position"])
        x[2 * b : 3 * b].fill_(self.table_scratch)
        x[3 * b : 4 * b].fill_(_PAD_TOKEN["location"])
        x[4 * b : 5 * b].fill_(_PAD_SEQUENCE["slot"])  # decode rows: slot, then length
        x[5 * b : 6 * b].fill_(_PAD_SEQUENCE["seq_len"])


# What padding holds (``GraphLayout``): token 0 at position 0 writing the reserved KV
# location; a padded decode row is one such token in slot 0, so it reads no table entry
# (the Triton backend's ``_PAD_ROW``). Padded tokens' table entries go to the scratch cell.
_PAD_TOKEN = {"input_ids": 0, "position": 0, "location": RESERVED_LOCATION}
_PAD_SEQUENCE = {"slot": 0, "seq_len": 1, "prefix_len": 0, "extend_len": 1, "start": 0}


def dummy_batch(phase: Phase, num_tokens: int, max_context: int, device: torch.device
                ) -> ForwardBatch:
    """A batch of ``num_tokens`` tokens for capture: each sequence uses slot 0 from
    position 0 and every token writes the reserved KV location 0, so running it never
    touches a live sequence's cache. Decode: ``num_tokens`` one-token sequences; prefill:
    as few sequences as ``max_context`` allows."""
    if phase == "decode":
        lens = [1] * num_tokens
    else:
        full, rest = divmod(num_tokens, max_context)
        lens = [max_context] * full + ([rest] if rest else [])
    starts = [sum(lens[:i]) for i in range(len(lens))]
    positions = [p for n in lens for p in range(n)]

    def dev(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    zeros = [0] * len(lens)
    return ForwardBatch(
        phase=phase,
        input_ids=dev([0] * num_tokens),
        positions=dev(positions),
        out_cache_loc=dev([0] * num_tokens),
        req_pool_indices=dev(zeros),
        seq_lens=dev(lens),
        prefix_lens=dev(zeros),
        extend_lens=dev(lens),
        extend_start=dev(starts),
        logits_indices=dev([s + n - 1 for s, n in zip(starts, lens, strict=True)]),
        table_index=dev(positions),  # slot 0
        req_pool_indices_host=tuple(zeros),
        seq_lens_host=tuple(lens),
        prefix_lens_host=tuple(zeros),
        extend_lens_host=tuple(lens),
    )
