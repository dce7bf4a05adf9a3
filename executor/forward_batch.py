"""``ForwardBatch``: everything one forward pass needs, passed explicitly (no globals)."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor.api import Phase
from executor.kv.manager import Allocation
from executor.packing import (
    GraphLayout,
    PackedSizes,
    pack_lists,
    pack_one_each,
    pack_tensors,
    split_packed,
)

# From this many sequences, a one-token-per-sequence batch is packed with numpy into a
# copy of its fixed frame (``packing.pack_one_each``: a few fixed-cost calls); below it,
# Python lists are cheaper.
_NUMPY_MIN_ROWS = 12
# Up to this many new tokens, ``ForwardBatch.build`` packs Python lists (cheapest for a
# decode step); above it, tensor ops (cheaper for long prompts).
_LIST_BUILD_MAX_TOKENS = 256


#: Cached slices per staging buffer before the cache starts over.
_SLICES_KEPT = 256
#: ``ForwardBatch.build``'s hook: (packed host buffer, its sizes), before the device copy.
BeforeTransfer = Callable[[torch.Tensor, PackedSizes], None]
#: Sequence fields whose real entries a batch also keeps on the host (``*_host``).
_HOST_FIELDS = ("slots", "seq_lens", "prefix_lens", "extend_lens")


class PinnedStaging:
    """The pinned host buffers every batch's packed metadata passes through on its way to
    the device: a host memcpy into one and one asynchronous copy out, instead of a pinned
    tensor made per batch: cheaper on the host, and no pinned allocation per batch.

    The buffers are used in turn (a ring of ``depth``), each reused only once the event
    recorded after its last copy has passed: with steps launched ahead of the device
    (``Executor.launch_*``), packing the next batch waits for the copy ``depth`` batches
    back, not for the one just enqueued behind the running step. A batch packed plain gets
    its own device tensor, so batches built before an earlier one ran stay intact; one
    packed for a graph bucket lands in the runner's fixed buffer (``GraphLayout``), which
    the stream reads in order. CUDA only; one owner (the executor), one thread.
    """

    def __init__(self, device: torch.device, capacity: int = 4096, depth: int = 4) -> None:
        self.device = device
        self._host = [torch.empty(capacity, dtype=torch.int64, pin_memory=True)
                      for _ in range(depth)]
        # The same memory as numpy arrays (a host copy into one is a memcpy, no
        # dispatcher call) and its leading-n slices as tensors, made once per size.
        self._arrays = [h.numpy() for h in self._host]
        self._slices: list[dict[int, torch.Tensor]] = [{} for _ in range(depth)]
        self._copied = [torch.cuda.Event() for _ in range(depth)]
        self._used = [False] * depth
        self._next = 0
        # NOTE: the executor runs every step on the device's current stream at start-up
        # (as ``ReplayTimer`` does); looking it up per call costs more than the record.
        self._stream = torch.cuda.current_stream(device)

    def to_device(self, values: torch.Tensor, dest: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """A device copy of the int64 CPU tensor ``values`` (enqueued, not waited for):
        a new tensor, or the leading ``values.numel()`` entries of ``dest``."""
        i, n = self._next, values.numel()
        self._next = (i + 1) % len(self._host)
        if self._used[i]:
            self._copied[i].synchronize()  # that buffer's last copy has read it
        if n > self._host[i].numel():
            self._host[i] = torch.empty(max(n, 2 * self._host[i].numel()), dtype=torch.int64,
                                        pin_memory=True)
            self._arrays[i], self._slices[i] = self._host[i].numpy(), {}
        self._arrays[i][:n] = values.numpy()
        host = self._slices[i].get(n)
        if host is None:
            if len(self._slices[i]) >= _SLICES_KEPT:  # prefill sizes vary without end
                self._slices[i].clear()
            host = self._slices[i][n] = self._host[i][:n]
        dev = torch.empty(n, dtype=torch.int64, device=self.device) if dest is None \
            else dest if dest.numel() == n else dest[:n]
        dev.copy_(host, non_blocking=True)
        self._copied[i].record(self._stream)
        self._used[i] = True
        return dev


# NOTE: not frozen, though nothing mutates one (``dataclasses.replace`` makes variants): a
# frozen dataclass sets each of its twenty fields through ``object.__setattr__``, which
# took most of the time of making one, and a decode step makes one per step.
@dataclass(eq=False)
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
    slots: torch.Tensor  # (B,) int64: request-slot row of each sequence
    seq_lens: torch.Tensor  # (B,) int64: length after this step (prefix + new)
    prefix_lens: torch.Tensor  # (B,) int64
    extend_lens: torch.Tensor  # (B,) int64
    extend_start: torch.Tensor  # (B,) int64: offset of each sequence in the packed tokens
    logits_indices: torch.Tensor  # (S,) int64: packed rows whose logits are needed
    # (T,) int64: where each new token's location goes in the request-slot table, as a
    # flat index ``slot * table_width + position`` (one scatter publishes them)
    table_index: torch.Tensor
    slots_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    prefix_lens_host: tuple[int, ...]
    extend_lens_host: tuple[int, ...]
    # A decode batch's (3, B) rows (``packing.DECODE_ROW_FIELDS``): one view
    # of the packed transfer, so graph metadata refreshes with one copy; None otherwise.
    decode_rows: torch.Tensor | None = None
    # A prefill's (5, B) rows of ``packing.SEQUENCE_FIELDS``: one view of the packed
    # transfer, so a fixed_grid prefill graph refreshes them with one copy; None otherwise.
    sequence_rows: torch.Tensor | None = None
    # The graph bucket the batch was packed for (``GraphLayout``); None when packed plain.
    bucket: int | None = None
    # The packed host buffer and its sizes, as sent to the device (and, under tensor
    # parallelism, to the other ranks: ``from_packed`` rebuilds the batch from them).
    packed: torch.Tensor | None = None
    sizes: PackedSizes | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

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
        every_position: frozenset[int] = frozenset(),
        before_transfer: BeforeTransfer | None = None,
    ) -> ForwardBatch:
        """Pack a batch from the tokens of each sequence (in ``alloc`` order).

        ``logits_rows`` are indices into ``alloc.extensions`` of sequences that need the
        logits of their last new token (of every new token, for those in
        ``every_position``), in that order. ``table_width`` is the request-slot table's row
        length (``table_index``). With ``staging`` (CUDA), the metadata travels through
        its pinned buffer. With ``layout``, the batch is packed for one graph bucket:
        padded to it and landing in the layout's fixed device buffer, so a captured
        prologue can read it from there. All integer metadata travels in one
        host-to-device copy laid out by ``executor.packing``, then is split into views.
        ``before_transfer`` is called with the packed host buffer and its sizes before that
        copy (rank 0 of a tensor-parallel group sends them to the other ranks there).
        """
        cols = alloc.columns  # the extensions' columns (a decode step has no tuples)
        slots, prefix, ext_lens = cols.slots, cols.prefix_lens, cols.new_lens
        b = len(slots)
        acc = sum(ext_lens)
        one_each = ext_lens.count(1) == b  # one new token per sequence: a decode step
        sizes = PackedSizes.of(acc, b, len(logits_rows) if not every_position else
                               _position_rows(logits_rows, ext_lens, every_position),
                               None if layout is None else layout.bucket,
                               decode=phase == "decode" and acc == b)
        scratch = 0 if layout is None else layout.table_scratch

        flat: torch.Tensor
        if one_each and not every_position and b >= _NUMPY_MIN_ROWS:  # a decode step
            framed, seq_lens_a = pack_one_each(token_ids, slots, prefix,
                                               alloc.out_cache_loc.numpy(), logits_rows,
                                               sizes, scratch, table_width)
            return ForwardBatch._transfer(phase, torch.from_numpy(framed), sizes,
                                          (slots, seq_lens_a.tolist(), prefix, ext_lens),
                                          device, staging, layout, before_transfer)
        if one_each:
            seq_lens = [p + 1 for p in prefix]
            starts = list(range(b))
        else:
            seq_lens = [p + n for p, n in zip(prefix, ext_lens, strict=True)]
            starts = []
            at = 0
            for n in ext_lens:
                starts.append(at)
                at += n
        if one_each and not every_position:  # sequence i's token is row i
            last_rows = list(logits_rows)
        elif not every_position:
            last_rows = [starts[i] + ext_lens[i] - 1 for i in logits_rows]
        else:
            last_rows = [r for i in logits_rows for r in (
                range(starts[i], starts[i] + ext_lens[i]) if i in every_position
                else (starts[i] + ext_lens[i] - 1,))]
        per_seq = {"slots": slots, "seq_lens": seq_lens, "prefix_lens": prefix,
                   "extend_lens": ext_lens, "extend_start": starts, "logits_indices": last_rows}

        if acc <= _LIST_BUILD_MAX_TOKENS:  # short prompts: plain lists are cheapest
            if one_each:  # each new token sits at its sequence's prefix length
                positions = prefix
                table_index = [slot * table_width + p
                               for slot, p in zip(slots, prefix, strict=True)]
            else:
                exts = alloc.extensions
                positions = [p for e in exts
                             for p in range(e.prefix_len, e.prefix_len + e.new_len)]
                table_index = [e.slot * table_width + p for e in exts
                               for p in range(e.prefix_len, e.prefix_len + e.new_len)]
            # array("q") of lists, then a view of it: a third of torch.tensor(list)'s time
            packed = pack_lists({"input_ids": token_ids, "positions": positions,
                                 "table_index": table_index,
                                 "out_cache_loc": alloc.out_cache_loc.tolist(), **per_seq},
                                sizes, scratch)
            flat = torch.frombuffer(packed, dtype=torch.int64) if packed else \
                torch.empty(0, dtype=torch.int64)
        else:  # long prompts: no Python loop over tokens (its cost grows with them)
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
            flat = pack_tensors(
                {"input_ids": torch.frombuffer(array("q", token_ids), dtype=torch.int64),
                 "positions": positions_t,
                 "table_index": per_token(seq_t[:b]) * table_width + positions_t,
                 "out_cache_loc": alloc.out_cache_loc.to(torch.int64),
                 **{k: torch.tensor(v, dtype=torch.int64) for k, v in per_seq.items()}},
                sizes, scratch)
        return ForwardBatch._transfer(phase, flat, sizes, (slots, seq_lens, prefix, ext_lens),
                                      device, staging, layout, before_transfer)

    @staticmethod
    def from_packed(phase: Phase, flat: torch.Tensor, sizes: PackedSizes,
                    device: torch.device, staging: PinnedStaging | None = None,
                    layout: GraphLayout | None = None) -> ForwardBatch:
        """The batch whose packed host buffer (``packed``) and ``sizes`` another rank
        sent: the same device transfer as ``build``, the host tuples read from ``flat``."""
        # (the host tuples from numpy slices: cheaper than splitting the host tensor)
        values = flat.numpy()
        n = sizes.seqs
        hosts = tuple(values[at : at + n].tolist() for at in map(sizes.offset, _HOST_FIELDS))
        return ForwardBatch._transfer(phase, flat, sizes, hosts, device, staging, layout)

    @staticmethod
    def _transfer(phase: Phase, flat: torch.Tensor, sizes: PackedSizes,
                  hosts: tuple[list[int], ...], device: torch.device,
                  staging: PinnedStaging | None, layout: GraphLayout | None,
                  before_transfer: BeforeTransfer | None = None) -> ForwardBatch:
        """Copy the packed host buffer ``flat`` to the device and split it into fields;
        ``hosts``: the slots, sequence, prefix and extend lengths on the host."""
        if before_transfer is not None:
            before_transfer(flat, sizes)
        host = flat
        slots, seq_lens, prefix, ext_lens = hosts
        if device.type == "cuda" and staging is None:
            flat = flat.pin_memory()  # pinned: the copy is asynchronous
        dest = None if layout is None else layout.prefix(flat.numel())
        if staging is not None and flat.numel():
            on_device = staging.to_device(flat, dest)
        elif dest is not None:
            on_device = dest
            on_device.copy_(flat, non_blocking=True)
        else:
            on_device = flat.to(device, non_blocking=True)
        # (the fields' views, and ``decode_rows`` or ``sequence_rows``: field names all)
        views = split_packed(on_device, sizes) if layout is None else layout.views(sizes)
        return ForwardBatch(
            phase=phase,
            **views,
            slots_host=tuple(slots),
            seq_lens_host=tuple(seq_lens),
            prefix_lens_host=tuple(prefix),
            extend_lens_host=tuple(ext_lens),
            bucket=None if layout is None else layout.bucket,
            packed=host,
            sizes=sizes,
        )


def _position_rows(logits_rows: list[int], ext_lens: list[int],
                   every_position: frozenset[int]) -> int:
    """Sampled rows of a batch with ``every_position`` items: all new tokens of those."""
    return sum(ext_lens[i] if i in every_position else 1 for i in logits_rows)


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
        slots=dev(zeros),
        seq_lens=dev(lens),
        prefix_lens=dev(zeros),
        extend_lens=dev(lens),
        extend_start=dev(starts),
        logits_indices=dev([s + n - 1 for s, n in zip(starts, lens, strict=True)]),
        table_index=dev(positions),  # slot 0
        slots_host=tuple(zeros),
        seq_lens_host=tuple(lens),
        prefix_lens_host=tuple(zeros),
        extend_lens_host=tuple(lens),
    )
