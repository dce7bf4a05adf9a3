"""Tensor parallelism's kernels on CPU through Triton's interpreter.

The push all-reduce (``push_all_reduce_kernel``) runs as one rank of two: the peer's
push is written by the test (or by a thread, late), so the slot choice, the -0.0 marks, the
clearing and the wait for data still missing are checked without GPUs; the shard embedding
lookup against the torch ops it replaces. ``tests/system/tp_serving/test_tp_server_gpus.py`` runs
the compiled kernels across real GPUs."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: the gpu tests cover the compiled kernel", allow_module_level=True)
if "triton" not in sys.modules:  # (see tests/executor/attention/test_triton_interpret.py)
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="triton is not installed")
if type(triton.language.sum).__name__ != "InterpretedFunction":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

from executor.kernels import all_reduce as k  # noqa: E402
from executor.kernels import embedding  # noqa: E402

WORLD = 2
PROGRAMS, SLOT_BYTES = k.LAMPORT_LANES[0]  # the small inputs' lane
SLOT_ELEMS = SLOT_BYTES // 2


class Rank0:
    """Rank 0 of two: both ranks' buffers (marked empty), its counters, and the region
    of a (slot, source rank) as a view of a rank's buffer."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        size = k.push_buffer_bytes(SLOT_BYTES, WORLD) // 2
        self.buffers = [torch.full((size,), k.LAMPORT_EMPTY, dtype=torch.int16)
                        for _ in range(WORLD)]
        self.bases = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64)
        self.counters = torch.zeros(PROGRAMS, dtype=torch.int32)

    def region(self, owner: int, epoch: int, source: int, numel: int) -> torch.Tensor:
        start = ((epoch & 1) * WORLD + source) * SLOT_ELEMS
        return self.buffers[owner].view(self.dtype)[start: start + numel]

    def all_reduce(self, x: torch.Tensor, gather: bool = False, sent: bool = False
                   ) -> torch.Tensor:
        out = x.new_empty(WORLD * x.numel()) if gather else torch.empty_like(x)
        k.push_all_reduce_kernel[(PROGRAMS,)](
            x, out, self.bases, self.counters, x.numel(), 0, SLOT_ELEMS, WORLD=WORLD,
            BLOCK=k.push_block(x.numel(), PROGRAMS), GATHER=gather, SENT=sent,
            USE_PDL=False)
        return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_push_all_reduce_sums_clears_and_alternates_slots_over_mixed_sizes(
        dtype: torch.dtype) -> None:
    """Calls of 4096, 100, 20000 (more than a block per program) and 4096 elements: each
    sums rank 0's input and the peer's push in float32, pushes rank 0's share into the
    peer's region of the call's slot with -0.0 made +0.0 (-0.0 marks "not arrived"),
    leaves rank 0's buffer all marked empty again, and counts the call in every program."""
    rank0 = Rank0(dtype)
    gen = torch.Generator().manual_seed(0)
    for epoch, numel in enumerate([4096, 100, 20000, 4096], start=1):
        # small integers, so the sums are exact (the interpreter rounds bf16 toward zero)
        x = torch.randint(-8, 9, (numel,), generator=gen).to(dtype)
        x[x == 0] = -0.0
        peer = torch.randint(-8, 9, (numel,), generator=gen).to(dtype)
        rank0.region(0, epoch, 1, numel).copy_(peer)  # the peer pushed first
        out = rank0.all_reduce(x)
        assert torch.equal(out, (x.float() + peer.float()).to(dtype))
        pushed = rank0.region(1, epoch, 0, numel)
        assert torch.equal(pushed, x) and not torch.signbit(pushed[x == 0]).any()
        assert (rank0.buffers[0] == k.LAMPORT_EMPTY).all()
        assert (rank0.counters == epoch).all()
        # the other slot is untouched: the peer would read this call's there
        assert (rank0.region(1, epoch + 1, 0, numel).view(torch.int16) == k.LAMPORT_EMPTY).all()
        rank0.buffers[1].fill_(k.LAMPORT_EMPTY)  # (the peer reads and clears its own)


def test_push_all_reduce_waits_for_a_late_peer() -> None:
    """Until the peer's share has arrived, element by element, the kernel spins: the sum
    includes data that was written well after the launch, half of it later still."""
    rank0 = Rank0(torch.float16)
    x = torch.ones(4096, dtype=torch.float16)
    late = torch.full((4096,), 2.0, dtype=torch.float16)
    region = rank0.region(0, 1, 1, 4096)

    def push() -> None:
        time.sleep(0.3)
        region[:2048].copy_(late[:2048])
        time.sleep(0.3)
        region[2048:].copy_(late[2048:])

    peer = threading.Thread(target=push)
    started = time.monotonic()
    peer.start()
    out = rank0.all_reduce(x)
    peer.join()
    assert time.monotonic() - started >= 0.6
    assert torch.equal(out, torch.full((4096,), 3.0, dtype=torch.float16))


def test_push_all_gather_stacks_the_ranks_in_order_between_all_reduces() -> None:
    """The kernel as an all-gather (the LM head's logits) shares a lane's slots and
    counters with its all-reduces: sum, gather, sum, each with the peer's push of that
    call, gives rank 0's input then the peer's (its -0.0 as +0.0) in the middle."""
    rank0 = Rank0(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    for epoch, gather in enumerate([False, True, False], start=1):
        x = torch.randint(-8, 9, (3000,), generator=gen).to(torch.bfloat16)
        x[x == 0] = -0.0
        peer = torch.randint(-8, 9, (3000,), generator=gen).to(torch.bfloat16)
        rank0.region(0, epoch, 1, 3000).copy_(peer)
        out = rank0.all_reduce(x, gather)
        want = torch.cat([x, peer]) if gather else (x.float() + peer.float()).bfloat16()
        assert torch.equal(out, want)
        if gather:
            assert not torch.signbit(out[:3000][x == 0]).any()
        assert (rank0.buffers[0] == k.LAMPORT_EMPTY).all()
        rank0.buffers[1].fill_(k.LAMPORT_EMPTY)


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("kernel", ["classic", "row"])
def test_projection_sends_its_output_into_the_push_all_reduce(silu_mul: bool, kernel: str
                                                               ) -> None:
    """``skinny.send_linear`` then the lane's kernel with ``SENT``, between plain
    calls of the lane: the projection stores exactly what ``skinny_gemm`` returns (its -0.0
    as +0.0) as rank 0's share of the call's slot in both buffers, the kernel sums it with
    the peer's without reading its input, clears rank 0's buffer and counts the call
    (``-0.0`` sent as ``+0.0`` is ``push_send``'s, shared with the kernel's own push).
    ``kernel``: the classic skinny kernel's tile, or the persistent row kernel's (its
    programs loop over several column blocks)."""
    from executor.kernels import skinny

    rank0 = Rank0(torch.float16)
    lane = skinny.SendLane(rank0.bases, rank0.counters, 0, WORLD, SLOT_ELEMS)
    gen = torch.Generator().manual_seed(3)
    n, k_in = 300, 48
    tile: skinny.Tile | skinny.RowTile = (
        skinny.Tile(block_n=64, block_k=32, num_warps=4, num_stages=1)
        if kernel == "classic" else skinny.RowTile(block_n=16, num_warps=4,
                                                        programs_per_sm=4))
    for epoch, send in enumerate([False, True, True, False, True], start=1):
        peer = torch.randint(-8, 9, (n,), generator=gen).to(torch.float16)
        rank0.region(0, epoch, 1, n).copy_(peer)
        if not send:
            x = torch.randint(-8, 9, (n,), generator=gen).to(torch.float16)
            assert torch.equal(rank0.all_reduce(x), (x.float() + peer.float()).half())
        else:
            # integers: the products and sums are exact, some outputs are zeros
            x = torch.randint(-2, 3, (1, 2 * k_in if silu_mul else k_in), generator=gen)
            w = torch.randint(-1, 2, (n, k_in), generator=gen).to(torch.float16)
            mine = skinny.skinny_gemm(x.half(), w, silu_mul=silu_mul, tile=tile)
            skinny.send_linear(x.half(), w, lane, silu_mul=silu_mul, tile=tile)
            pushed = rank0.region(1, epoch, 0, n)
            zeros = mine[0] == 0
            assert torch.equal(pushed, mine[0]) and (silu_mul or zeros.any())
            assert not torch.signbit(pushed[zeros]).any()
            stale = torch.full((1, n), float("nan"), dtype=torch.float16)  # never read
            out = rank0.all_reduce(stale, sent=True)
            assert torch.equal(out[0], (mine[0].float() + peer.float()).half())
        assert (rank0.buffers[0] == k.LAMPORT_EMPTY).all()
        assert (rank0.counters == epoch).all()
        rank0.buffers[1].fill_(k.LAMPORT_EMPTY)
    # a sent call is one block per program (it sums before its PDL wait, in registers)
    assert k.sent_fits(PROGRAMS * k.LAMPORT_MAX_BLOCK, PROGRAMS)
    assert not k.sent_fits(PROGRAMS * k.LAMPORT_MAX_BLOCK + 1, PROGRAMS)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_shard_embedding_copies_this_ranks_rows_and_zeros_the_rest(dtype: torch.dtype) -> None:
    """Rank 1 of 3 over a vocabulary of 50 (rows 17..33) with a hidden size over a block:
    ids below, in and above the shard (both ends) give exactly what the torch ops of
    ``VocabParallelEmbedding`` give (their signed zeros as +0.0)."""
    gen = torch.Generator().manual_seed(2)
    start, rows, hidden = 17, 17, embedding.BLOCK + 70
    weight = torch.randn(rows, hidden, generator=gen).to(dtype)
    ids = torch.tensor([0, 16, 17, 25, 33, 34, 49, 17], dtype=torch.int64)
    got = embedding._launch(ids, weight, start)
    local = ids - start
    mine = (local >= 0) & (local < rows)
    want = torch.nn.functional.embedding(local.clamp(0, rows - 1), weight)
    want = want * mine.unsqueeze(-1).to(dtype)
    assert torch.equal(got, want)
    assert not torch.signbit(got[~mine]).any()
    assert embedding._launch(ids[:0], weight, start).shape == (0, hidden)
