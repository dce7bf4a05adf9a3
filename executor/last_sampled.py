"""``LastSampled``: the one owner of each sequence's last sampled token.

A decode item without a token (``USE_LAST_SAMPLED``) continues from the token its
sequence sampled last. That token lives on the device, in ``tokens`` (int64, a row per
request slot), so a pipelined scheduler never waits for it; the host keeps only which
sequences have one (``has``). Invariants:

* Only this class writes ``tokens``, except ``Sampler.sample``, which writes a decode
  step's samples inside the step's launch into the (table, slots) ``sampler_target``
  hands it; the step then calls ``remember(..., stored=True)``.
* Under tensor parallelism every rank's ``tokens`` holds the same values: rank 0 sends
  each write (``remember``, a fork's ``inherit``) and the others apply it (``receive``,
  ``copy``).
* ``has(seq_id)`` is True only while ``tokens[slot]`` holds that sequence's last sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from executor.api import PrefillItem

if TYPE_CHECKING:
    from executor.distributed.channel import StepChannel


class LastSampled:
    def __init__(self, max_sequences: int, device: torch.device,
                 channel: StepChannel | None = None) -> None:
        #: (max_sequences,) int64: each request slot's last sampled token. Graph
        #: prologues read it (``USE_LAST_SAMPLED`` rows); only this class writes it.
        self.tokens = torch.zeros(max_sequences, dtype=torch.int64, device=device)
        self._channel = channel
        self._seqs: set[str] = set()  # sequences whose last step sampled
        #: Whether a sequence has a last sampled token (the set's own method: decode
        #: validation asks it per item).
        self.has: Callable[[str], bool] = self._seqs.__contains__

    # -- device side ----------------------------------------------------------------
    def sampler_target(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where ``Sampler.sample`` writes a step's samples (its ``remember``): this table
        at ``slots`` (int64, a slot per row). The caller then calls
        ``remember(slots, tokens, stored=True)``."""
        return self.tokens, slots

    def remember(self, slots: torch.Tensor, tokens: torch.Tensor,
                 stored: bool = False) -> None:
        """``tokens`` (device, int64, one per slot) become the last sampled tokens of the
        sequences in ``slots``; ``stored``: the sampler wrote them already, only the other
        ranks are told."""
        if not stored:
            self.tokens.index_copy_(0, slots, tokens)
        if self._channel is not None:  # the other ranks' decode prologues read it too
            self._channel.send_sampled(slots, tokens)

    def resolve(self, input_ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``input_ids`` with each ``USE_LAST_SAMPLED`` (negative) id replaced by its
        slot's last sampled token (an eager decode; a graph's prologue does the same)."""
        return torch.where(input_ids >= 0, input_ids, self.tokens[slots])

    def copy(self, parent_slot: int, child_slot: int) -> None:
        """The child slot takes the parent slot's token (on the device; a fork)."""
        self.tokens[child_slot] = self.tokens[parent_slot]

    def receive(self, sampled: torch.Tensor) -> None:
        """A rank other than 0: apply rank 0's ``remember`` ((2, rows): slots, tokens)."""
        self.tokens.index_copy_(0, sampled[0], sampled[1])

    # -- host side ------------------------------------------------------------------
    def had(self, seq_ids: Iterable[str]) -> dict[str, bool]:
        """Per sequence, whether it has a last sampled token now (for ``restore``)."""
        return {seq_id: seq_id in self._seqs for seq_id in seq_ids}

    def after_prefill(self, items: Iterable[PrefillItem]) -> None:
        """A prefill ran: a sampling item's sequence has a last sample, any other not."""
        for it in items:
            (self._seqs.add if it.sample else self._seqs.discard)(it.seq_id)

    def after_decode(self, seq_ids: Iterable[str]) -> None:
        """A decode ran: every one of its sequences sampled."""
        self._seqs.update(seq_ids)

    def inherit(self, parent_id: str, parent_slot: int, child_id: str,
                child_slot: int) -> bool:
        """A fork that shares all of its parent: the child inherits the parent's last
        sampled token, if it has one. Returns whether it did."""
        if parent_id not in self._seqs:
            return False
        self.copy(parent_slot, child_slot)
        self._seqs.add(child_id)
        return True

    def forget(self, seq_id: str) -> None:
        """The sequence was released or shortened: its last sample no longer continues it."""
        self._seqs.discard(seq_id)

    def restore(self, had_last: Mapping[str, bool], sampled: set[str],
                alive: Callable[[str], bool]) -> None:
        """An aborted step: a sequence it did not sample for keeps the last sample it had
        before (its token on the device is untouched) if it still exists; a sequence it
        sampled for has none (the step overwrote its token)."""
        for seq_id, had in had_last.items():
            if had and seq_id not in sampled and alive(seq_id):
                self._seqs.add(seq_id)
            else:
                self._seqs.discard(seq_id)
