"""Rank 0 to the other ranks: headers and packed steps on the control plane (host memory),
sampled tokens on the device group (a device tensor, no host round trip).

Two control-plane transports, picked once at start-up and agreed over the ranks
(``transport``): ``local`` (every rank on rank 0's host: a Unix-domain socket per rank,
polled for ``SPIN_S`` after each message, then a sleeping ``recv``) and ``gloo`` (a
broadcast on the control group; a step that fits ``inline`` entries rides in the header's
broadcast). Delivery is confirmed, so a hung rank fails a step within the collective
timeout: on ``local`` each rank answers a step once it has launched its forward, with the
times of receipt and launch, and rank 0 waits for the answers in ``confirm`` after its own
launch (``RankTiming``: the step's delivery and launch lag).

Every call here is a collective: rank 0 and every other rank make the matching calls in
the same order (``Executor`` on rank 0, ``executor.follower`` elsewhere). The protocol and
its reasons are in ``docs/tensor-parallel.md``.
"""

from __future__ import annotations

import datetime
import socket
import struct
import time
import uuid
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

from executor.api import RankTiming
from executor.distributed import collectives
from executor.distributed.collectives import CollectiveFailed, collective
from executor.distributed.group import TensorParallel
from executor.distributed.protocol import (
    HEADER_LEN,
    CaptureHeader,
    ForkHeader,
    Header,
    ShutdownHeader,
    StepHeader,
    decode,
)

#: Packed entries that travel inside the header's broadcast (gloo).
INLINE_ENTRIES = 1024
Transport = Literal["auto", "local", "gloo"]
#: How long the ranks try to connect at start-up before they all fall back to gloo.
CONNECT_TIMEOUT_S = 20.0
#: Each answer on ``local``: two int64, for a step the rank's monotonic clock (ns) when it
#: had received the step and when it had launched its forward, else zeros.
_ANSWER = struct.Struct("<qq")
ANSWER_BYTES = _ANSWER.size
_NOT_A_STEP = _ANSWER.pack(0, 0)
#: How long another rank polls for the next message after one arrived, before it sleeps
#: in ``recv``: while steps keep coming (a serving scheduler's), the rank never pays for
#: waking a sleeping process on a cold core; polling costs one busy CPU core per rank.
SPIN_S = 0.05


class StepChannel:
    def __init__(self, tp: TensorParallel, device: torch.device,
                 inline: int = INLINE_ENTRIES, transport: Transport = "auto",
                 spin_s: float = SPIN_S) -> None:
        if not tp.distributed:
            raise ValueError("a step channel needs process groups")
        self.tp, self.device, self.inline = tp, device, inline
        self._control = tp.control_group
        state = collectives.state(tp.device_group_name)
        assert state is not None, "a channel needs the group's process groups (init)"
        self._device_group = state.group
        # header | up to ``inline`` packed entries (the same size on every rank)
        self._message = torch.zeros(HEADER_LEN + inline, dtype=torch.int64)
        self._wire = self._message.numpy()  # the same memory: what ``local`` writes
        self._peers: list[socket.socket] = []  # rank 0, local: one per other rank
        self._leader: socket.socket | None = None  # another rank, local: rank 0's socket
        self._unconfirmed = 0  # rank 0, local: messages sent whose answers are not read
        self.spin_s = spin_s  # another rank, local: how long to poll after a message
        self._owed = False  # another rank, local: a step received, not yet answered
        self._received_ns = 0  # another rank, local: when that step's header arrived
        self._sent_ns = 0  # rank 0: when it began sending the last step
        self._last_message = 0.0  # when the last one arrived (time.monotonic)
        self.transport: Literal["local", "gloo"] = "gloo"
        if transport != "gloo" and tp.size > 1:
            self._connect(transport == "local", tp.timeout)

    # -- start-up -------------------------------------------------------------------------
    def _connect(self, required: bool, timeout: datetime.timedelta) -> None:
        """Rank 0 listens on a fresh abstract Unix socket whose name it broadcasts; every
        other rank connects and says its rank; rank 0 accepts them all. Each step is
        agreed over the ranks: either every rank uses the sockets or none does."""
        listener: socket.socket | None = None
        names: list[str | None] = [None]
        if self.tp.leads:
            try:
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                # NOTE: the abstract namespace (leading NUL): no file to clean up; shared
                # by the processes of one network namespace, so only ranks on this host
                # can connect.
                address = f"\0model-executor-{uuid.uuid4().hex}"
                listener.bind(address)
                listener.listen(self.tp.size)
                names[0] = address
            except OSError:
                pass
        dist.broadcast_object_list(names, src=0, group=self._control)
        name = names[0]
        connected = name is not None
        if name is not None and not self.tp.leads:
            try:
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.settimeout(CONNECT_TIMEOUT_S)
                conn.connect(name)  # lands in the listener's backlog
                conn.sendall(self.tp.rank.to_bytes(4, "little"))
                conn.settimeout(None)  # the next step may come in a day
                self._leader = conn
            except OSError:
                connected = False
        agreed = self.tp.min_over_ranks(int(connected)) == 1
        if agreed:  # every rank connected: rank 0 accepts them all, agreed once more
            accepted = self._accept(listener, timeout) if listener is not None else True
            agreed = self.tp.min_over_ranks(int(accepted)) == 1
        if listener is not None:
            listener.close()
        if agreed:
            self.transport = "local"
            return
        self._close_sockets()
        if required:
            raise CollectiveFailed("tensor-parallel control channel: the local transport "
                                   "was asked for but not every rank could connect")

    def _accept(self, listener: socket.socket, timeout: datetime.timedelta) -> bool:
        """Rank 0: every other rank's connection, in rank order."""
        listener.settimeout(CONNECT_TIMEOUT_S)
        by_rank: dict[int, socket.socket] = {}
        try:
            while len(by_rank) < self.tp.size - 1:
                conn, _ = listener.accept()
                conn.settimeout(timeout.total_seconds())  # bounds sends and confirmations
                by_rank[int.from_bytes(_read(conn, 4), "little")] = conn
        except (OSError, CollectiveFailed):
            for conn in by_rank.values():
                conn.close()
            return False
        self._peers = [by_rank[r] for r in sorted(by_rank)]
        return True

    def _close_sockets(self) -> None:
        for s in [*self._peers, *([self._leader] if self._leader else [])]:
            s.close()
        self._peers, self._leader = [], None

    # -- rank 0 ---------------------------------------------------------------------------
    def send(self, header: Header, packed: torch.Tensor | None = None) -> None:
        """Send ``header`` and, for a step, its packed host buffer to every other rank."""
        self._sent_ns = time.monotonic_ns()
        total = header.sizes.total if isinstance(header, StepHeader) else 0
        if total:
            assert packed is not None and packed.numel() >= total
        if self.transport == "local":
            self._send_local(header, packed, total)
            return
        self._message[:HEADER_LEN] = torch.tensor(header.encode(), dtype=torch.int64)
        if total and total <= self.inline:
            assert packed is not None
            self._message[HEADER_LEN : HEADER_LEN + total] = packed[:total]
        with collective("step broadcast"):
            dist.broadcast(self._message, src=0, group=self._control)
            if total > self.inline:
                assert packed is not None
                dist.broadcast(packed[:total].contiguous(), src=0, group=self._control)

    def _send_local(self, header: Header, packed: torch.Tensor | None, total: int) -> None:
        n = HEADER_LEN + total
        if n > self._wire.size:  # a long prefill: grow the (rank-0-only) buffer
            self._wire = np.zeros(max(n, 2 * self._wire.size), dtype=np.int64)
        self._wire[:HEADER_LEN] = header.encode()
        if total:
            assert packed is not None
            self._wire[HEADER_LEN:n] = packed[:total].numpy()
        data = self._wire[:n].data
        try:
            for peer in self._peers:
                peer.sendall(data)
        except OSError as exc:  # a peer gone (reset, broken pipe) or a full socket for long
            raise CollectiveFailed(f"tensor-parallel step send failed: {exc}") from exc
        if not isinstance(header, ShutdownHeader):  # not answered: rank 0 closes after it
            self._unconfirmed += 1

    def confirm(self, launched_ns: int | None = None) -> RankTiming | None:
        """Wait until every other rank answered every message sent so far (local; a gloo
        broadcast confirmed already). Raises ``CollectiveFailed`` past the timeout.

        With ``launched_ns``, this rank's monotonic clock when it launched the forward of
        the step it sent last: when the other ranks had that step and launched its
        forward, against this rank; None where that is not known (gloo, or the last
        message was not a step, or a rank did not say it launched)."""
        if not self._unconfirmed:
            return None
        n = self._unconfirmed * ANSWER_BYTES
        try:
            last = [_ANSWER.unpack_from(_read(peer, n), n - ANSWER_BYTES)
                    for peer in self._peers]
        except OSError as exc:  # socket.timeout is an OSError
            raise CollectiveFailed(f"tensor-parallel step delivery failed: {exc}") from exc
        self._unconfirmed = 0
        if launched_ns is None or not last or min(launched for _, launched in last) <= 0:
            return None
        received, launched = (max(times) for times in zip(*last, strict=True))
        return RankTiming((received - self._sent_ns) / 1e6,
                          max(0, launched - launched_ns) / 1e6)

    def send_sampled(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Each sampled row's (slot, token) to the other ranks' ``LastSampled`` tables."""
        with collective("sampled-token broadcast"):
            dist.broadcast(torch.stack((slots, tokens)), src=0, group=self._device_group)

    def agree(self, ok: bool) -> bool:
        """True only if every rank says ``ok`` (capture of one bucket)."""
        return self.tp.min_over_ranks(int(ok)) == 1

    # -- other ranks ----------------------------------------------------------------------
    def receive(self) -> tuple[Header, torch.Tensor | None]:
        """The next header and, for a step, its packed host buffer (a new tensor). A step
        is answered by ``launched`` (or, if that was not called, here, before the next
        message is read)."""
        if self._leader is not None:
            if self._owed:
                self._answer(self._leader, _NOT_A_STEP)
            return self._receive_local(self._leader)
        with collective("step broadcast"):
            dist.broadcast(self._message, src=0, group=self._control)
        header = decode(self._message[:HEADER_LEN].tolist())
        if not isinstance(header, StepHeader):
            return header, None
        total = header.sizes.total
        if total <= self.inline:
            return header, self._message[HEADER_LEN : HEADER_LEN + total].clone()
        packed = torch.empty(total, dtype=torch.int64)
        with collective("step broadcast"):
            dist.broadcast(packed, src=0, group=self._control)
        return header, packed

    def _receive_local(self, leader: socket.socket) -> tuple[Header, torch.Tensor | None]:
        try:
            view = self._wire[:HEADER_LEN].data.cast("B")
            _read_into(leader, view, self._spin_until())
            received = time.monotonic_ns()
            header = decode(self._wire[:HEADER_LEN].tolist())
            packed = None
            if isinstance(header, StepHeader):
                packed = torch.empty(header.sizes.total, dtype=torch.int64)
                if header.sizes.total:
                    _read_into(leader, packed.numpy().data.cast("B"))
        except OSError as exc:
            raise CollectiveFailed(f"tensor-parallel step receive failed: {exc}") from exc
        if isinstance(header, StepHeader):
            self._owed = True  # answered once its forward is launched (``launched``)
            self._received_ns = received
        elif not isinstance(header, ShutdownHeader):  # rank 0 closes right after it
            self._answer(leader, _NOT_A_STEP)
        self._last_message = time.monotonic()
        return header, packed

    def launched(self) -> None:
        """Another rank: it has launched the forward of the step it received last;
        answer that step with the time (local; nothing to do on gloo)."""
        if self._owed and self._leader is not None:
            self._answer(self._leader, _ANSWER.pack(self._received_ns, time.monotonic_ns()))

    def _answer(self, leader: socket.socket, answer: bytes) -> None:
        try:
            leader.sendall(answer)
        except OSError as exc:
            raise CollectiveFailed(f"tensor-parallel step answer failed: {exc}") from exc
        self._owed = False

    def _spin_until(self) -> float:
        """Until when to poll for the next message instead of sleeping in ``recv``: up to
        ``spin_s`` after the last one (0: sleep at once)."""
        return self._last_message + self.spin_s if self.spin_s > 0 else 0.0

    def receive_sampled(self, rows: int) -> torch.Tensor:
        """(2, rows) int64 on the device: slots, then tokens."""
        out = torch.empty(2, rows, dtype=torch.int64, device=self.device)
        with collective("sampled-token broadcast"):
            dist.broadcast(out, src=0, group=self._device_group)
        return out

    def close(self) -> None:
        """Close the local sockets (a peer then sees the end of its stream)."""
        self._close_sockets()


def _read_into(conn: socket.socket, view: memoryview, spin_until: float = 0.0) -> None:
    """Fill ``view`` from ``conn``; the end of the stream is a lost peer. Until the
    monotonic time ``spin_until``, poll without sleeping (the GIL is released around each
    poll), then block."""
    got = 0
    while got == 0 and time.monotonic() < spin_until:
        try:
            got = conn.recv_into(view, len(view), socket.MSG_DONTWAIT)
        except BlockingIOError:
            continue
        if got == 0:
            raise CollectiveFailed("tensor-parallel control connection closed by its peer")
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise CollectiveFailed("tensor-parallel control connection closed by its peer")
        got += n


def _read(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _read_into(conn, memoryview(buf))
    return bytes(buf)


__all__ = ["CaptureHeader", "ForkHeader", "ShutdownHeader", "StepChannel", "StepHeader"]
