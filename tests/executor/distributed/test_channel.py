"""The step channel between real processes, over each transport (local Unix sockets and
gloo): every kind of header arrives as sent, with its packed buffer (inline in gloo's
header broadcast or after it), the sampled tokens land on the other rank, rank 0 learns
how much later than its own the other rank launched a step (local), and a rank that
stops reading fails rank 0's confirmation within the timeout."""

from __future__ import annotations

import datetime
import multiprocessing
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from executor.api import RankTiming
from executor.distributed import bootstrap
from executor.distributed.channel import StepChannel, Transport
from executor.distributed.collectives import CollectiveFailed
from executor.distributed.protocol import (
    CaptureHeader,
    ForkHeader,
    Mode,
    ShutdownHeader,
    StepHeader,
)
from executor.packing import PackedSizes

INLINE = 64
LATE_S = 0.05


def _messages() -> list[tuple[Any, torch.Tensor | None]]:
    small = PackedSizes(5, 3, 2, 0, 2)  # 8 * 4 + 2 * 5 + 2 = 44 entries: inline
    large = PackedSizes(30, 2, 3, 0, 3)  # 32 * 4 + 15 + 3 = 146 entries: a second message
    return [
        (StepHeader("prefill", Mode.LOGITS, None, small, 2), torch.arange(small.total)),
        (StepHeader("decode", Mode.GRAPH, 8, large, 3), torch.arange(large.total) * 7),
        (StepHeader("prefill", Mode.KV_ONLY, None, PackedSizes(0, 0, 0, 0, 0), 0),
         torch.empty(0, dtype=torch.int64)),
        (ForkHeader(1, 2, 33, True), None),
        (CaptureHeader(("decode", "prefill"), False), None),
        (ShutdownHeader(), None),
    ]


def _rank(rank: int, port: int, out: Any, transport: Transport, spin_s: float) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    tp = bootstrap.init(rank, 2, torch.device("cpu"), store, datetime.timedelta(seconds=60))
    channel = StepChannel(tp, torch.device("cpu"), inline=INLINE, transport=transport,
                          spin_s=spin_s)
    received: list[Any] = [channel.transport]
    lags: list[RankTiming | None] = []
    for i, (header, packed) in enumerate(_messages()):
        if rank == 0:
            if i == 2:  # past the receiver's polling: it sleeps in recv for this one
                time.sleep(spin_s + 0.1)
            channel.send(header, packed)
            launched = time.monotonic_ns()  # "our forward": launched right after the send
            if i == 1:  # this step: the other rank launches first
                time.sleep(LATE_S)
                launched = time.monotonic_ns()
            lags.append(channel.confirm(launched))
        else:
            got, got_packed = channel.receive()
            received.append((got, None if got_packed is None else got_packed.tolist()))
            if i == 0:  # the first step: this rank launches LATE_S after rank 0
                time.sleep(LATE_S)
            if i < 2:  # the third step is never said launched: answered at the next read
                channel.launched()
    slots, tokens = torch.tensor([4, 0, 2]), torch.tensor([17, 99, 5])
    if rank == 0:
        channel.send_sampled(slots, tokens)
        out.put((0, lags))
    else:
        received.append(("sampled", channel.receive_sampled(3).tolist()))
        out.put((1, received))
    channel.close()
    bootstrap.shutdown(tp)


def _context() -> Any:
    """Ranks forked from a forkserver that imported torch and this module once: a fresh
    ``spawn`` process re-imports them for every rank of every test, seconds each on a
    small machine (and the ranks' start-up skew counts against the collective timeout)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def _spawn(target: Any, *args: Any) -> tuple[list[Any], Any]:
    ctx = _context()
    out = ctx.Queue()
    probe = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    port = probe.port
    del probe  # free the port for rank 0's store
    procs = [ctx.Process(target=target, args=(r, port, out, *args)) for r in range(2)]
    for p in procs:
        p.start()
    return procs, out


@pytest.mark.parametrize(("transport", "spin_s"), [("local", 0.05), ("local", 0.0),
                                                   ("gloo", 0.05), ("auto", 0.05)])
def test_headers_and_packed_steps_cross_between_processes(transport: Transport,
                                                         spin_s: float) -> None:
    procs, out = _spawn(_rank, transport, spin_s)
    try:
        got = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    received, lags = got[1], got[0]
    assert received[0] == ("gloo" if transport == "gloo" else "local")
    want = [(h, None if p is None else p.tolist()) for h, p in _messages()]
    assert received[1:-1] == want
    assert received[-1] == ("sampled", [[4, 0, 2], [17, 99, 5]])
    if transport == "gloo":  # a broadcast confirms delivery, not launches
        assert lags == [None] * len(want)
        return
    # the late launch, then one ahead of rank 0's (0, not negative); then a step never
    # said launched, a fork and a capture: no lag; SHUTDOWN is not answered. Each step
    # arrived after it was sent, and before the other rank launched it.
    late, early = lags[0], lags[1]
    assert late is not None and early is not None
    assert LATE_S * 1e3 * 0.8 < late.launch_lag_ms < 5000
    assert early.launch_lag_ms == 0.0
    for got in (late, early):
        assert 0 < got.delivery_ms < 2000
    assert late.delivery_ms < late.launch_lag_ms
    assert lags[2:] == [None, None, None, None]


def _silent_rank(rank: int, port: int, out: Any, reads_second: bool) -> None:
    """Rank 1 takes (and launches) one step, then stops reading, or reads the second step
    but never launches it (``reads_second``: stuck before its launch); rank 0 reports what
    its next confirmation raised and how long it took (timeout 2 s)."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    tp = bootstrap.init(rank, 2, torch.device("cpu"), store, datetime.timedelta(seconds=2))
    channel = StepChannel(tp, torch.device("cpu"), transport="local")
    header, packed = _messages()[0]
    if rank == 0:
        channel.send(header, packed)
        channel.confirm()
        channel.send(header, packed)
        started = time.monotonic()
        try:
            channel.confirm()
            out.put(("confirmed", 0.0))
        except CollectiveFailed as exc:
            out.put((str(exc), time.monotonic() - started))
        store.set("done", "1")
    else:
        channel.receive()
        channel.launched()
        if reads_second:
            channel.receive()
        store.wait(["done"], datetime.timedelta(seconds=60))
    channel.close()


@pytest.mark.parametrize("reads_second", [False, True], ids=["stops-reading", "never-launches"])
def test_a_rank_that_stops_reading_fails_the_confirmation_within_the_timeout(
        reads_second: bool) -> None:
    procs, out = _spawn(_silent_rank, reads_second)
    try:
        what, waited = out.get(timeout=120)
    finally:
        for p in procs:
            p.join(60)
    assert "delivery failed" in what and 1.5 < waited < 10


def _slow_rank(rank: int, port: int, out: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    tp = bootstrap.init(rank, 2, torch.device("cpu"), store, datetime.timedelta(seconds=2))
    if rank == 1:
        time.sleep(5)  # loading its weights, longer than the collective timeout
    tp.settle()
    out.put((rank, tp.min_over_ranks(10 + rank)))
    bootstrap.shutdown(tp)


def test_settle_waits_for_a_rank_slower_than_the_collective_timeout() -> None:
    ctx = _context()
    out = ctx.Queue()
    probe = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    port = probe.port
    del probe
    procs = [ctx.Process(target=_slow_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(60)
    assert got == [(0, 10), (1, 10)] and [p.exitcode for p in procs] == [0, 0]
