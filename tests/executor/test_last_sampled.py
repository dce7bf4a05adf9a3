"""``LastSampled``: the one owner of each sequence's last sampled token (device table plus
host set), checked on CPU."""

from __future__ import annotations

import torch

from executor.api import PrefillItem
from executor.last_sampled import LastSampled


class FakeChannel:
    """Records what rank 0 sends the other ranks."""

    def __init__(self) -> None:
        self.sent: list[tuple[list[int], list[int]]] = []

    def send_sampled(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        self.sent.append((slots.tolist(), tokens.tolist()))


def slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_remember_writes_the_table_and_tells_the_other_ranks() -> None:
    channel = FakeChannel()
    last = LastSampled(4, torch.device("cpu"), channel)  # type: ignore[arg-type]
    last.remember(slots(1, 3), slots(7, 9))
    assert last.tokens.tolist() == [0, 7, 0, 9]
    # a step whose sampler wrote the table already: only the other ranks are told
    table, where = last.sampler_target(slots(0))
    table.index_copy_(0, where, slots(5))
    last.remember(slots(0), slots(5), stored=True)
    assert last.tokens.tolist() == [5, 7, 0, 9]
    assert channel.sent == [([1, 3], [7, 9]), ([0], [5])]


def test_resolve_reads_negative_ids_from_the_table() -> None:
    last = LastSampled(3, torch.device("cpu"))
    last.remember(slots(0, 2), slots(11, 12))
    assert last.resolve(slots(-1, 4, -1), slots(2, 1, 0)).tolist() == [12, 4, 11]


def test_prefill_and_decode_set_which_sequences_have_one() -> None:
    last = LastSampled(3, torch.device("cpu"))
    last.after_prefill([PrefillItem("a", [1]), PrefillItem("b", [2], sample=False)])
    assert last.has("a") and not last.has("b")
    last.after_prefill([PrefillItem("a", [3], sample=False)])  # a chunk without a sample
    assert not last.has("a")
    last.after_decode(["a", "b"])
    assert last.has("a") and last.has("b")
    last.forget("a")
    assert not last.has("a") and last.has("b")
    assert last.had(["a", "b"]) == {"a": False, "b": True}


def test_a_fork_inherits_only_a_last_sample_the_parent_has() -> None:
    last = LastSampled(4, torch.device("cpu"))
    last.remember(slots(0), slots(42))
    assert not last.inherit("p", 0, "c", 1)  # the parent has none on the host side
    assert last.tokens.tolist() == [42, 0, 0, 0] and not last.has("c")
    last.after_decode(["p"])
    assert last.inherit("p", 0, "c", 1)
    assert last.tokens.tolist() == [42, 42, 0, 0] and last.has("c")
    last.copy(1, 3)  # a follower's side of a fork: the device only
    assert last.tokens.tolist() == [42, 42, 0, 42]


def test_receive_applies_rank_zeros_samples() -> None:
    last = LastSampled(3, torch.device("cpu"))
    last.receive(torch.tensor([[2, 0], [8, 6]]))
    assert last.tokens.tolist() == [6, 0, 8]


def test_an_abort_restores_only_untouched_live_sequences() -> None:
    last = LastSampled(3, torch.device("cpu"))
    last.after_decode(["a", "b", "c", "d"])
    had = last.had(["a", "b", "c", "d", "e"])
    last.after_decode(["e"])
    # the aborted step sampled for a and e; d was released since; b, c untouched
    last.restore(had, {"a", "e"}, alive=lambda s: s != "d")
    assert [s for s in "abcde" if last.has(s)] == ["b", "c"]
