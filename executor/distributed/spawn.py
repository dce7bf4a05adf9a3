"""Starting the ranks and watching them: rendezvous, spawned children, heartbeats.

Two ways to start N ranks, one code path after the rendezvous:

* ``--tensor-parallel-size N`` alone: the serving process is rank 0; it hosts a TCP store
  on loopback only (``host_store``) and spawns ranks 1..N-1 (``multiprocessing`` spawn
  context), each a fresh interpreter that dies with its parent (``PR_SET_PDEATHSIG``).
* A torchrun-style environment (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``,
  ``RANK``, ``LOCAL_RANK``): every process is started by the launcher and they meet at the
  store on ``MASTER_ADDR:MASTER_PORT`` (rank 0's, or torchrun's agent's).

Faults are found three ways, each naming the rank: a spawned child's exit (at once, with
its exit code or signal); a heartbeat counter in the store that stops moving for
``heartbeat_timeout_s``; and a collective that fails or outlives ``collective_timeout_s``.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from executor.distributed.all_reduce.paths import ALL_REDUCE_CHOICES
from executor.errors import ConfigError

_ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
#: Where spawned ranks meet: they share this host, and the store has no authentication.
LOOPBACK = "127.0.0.1"
#: ``--tp-gemm-send`` values (``ParallelConfig.gemm_send`` is True for "on").
GEMM_SEND_MODES = ("on", "off")


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks and how long a rank that stops answering is waited for.

    collective_timeout_s: bound of every data-plane collective (a step on a hung rank
        fails within it on the others).
    heartbeat_interval_s / heartbeat_timeout_s: each rank bumps a counter in the store
        every interval; a rank whose counter has not moved for the timeout has failed.
    all_reduce: ``--tp-all-reduce`` (``ALL_REDUCE_CHOICES``): "auto" (the default: each
        size to the fastest algorithm, timed at start-up), "nccl", or one of the one-shot
        algorithms "symm_mem", "flags", "push" (``all_reduce/paths.py``), NCCL where it
        cannot run.
    gemm_send: ``--tp-gemm-send``: where the push algorithm takes a one-row all-reduce,
        o_proj/down_proj's GEMM stores its output into the push buffers and the kernel
        only sums (True, the default); False: a separate all-reduce after each projection.
    """

    tensor_parallel_size: int = 1
    collective_timeout_s: float = 120.0
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 15.0
    all_reduce: str = "auto"
    gemm_send: bool = True

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size must be >= 1, got "
                              f"{self.tensor_parallel_size}")
        if self.collective_timeout_s <= 0 or self.heartbeat_timeout_s <= 0 \
                or not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ConfigError("timeouts must be > 0 and the heartbeat interval below the "
                              "heartbeat timeout")
        if self.all_reduce not in ALL_REDUCE_CHOICES:
            raise ConfigError(f"--tp-all-reduce must be one of {', '.join(ALL_REDUCE_CHOICES)}, "
                              f"got {self.all_reduce!r}")
        if not isinstance(self.gemm_send, bool):
            raise ConfigError(f"--tp-gemm-send must be one of {', '.join(GEMM_SEND_MODES)}, "
                              f"got {self.gemm_send!r}")

    @property
    def collective_timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.collective_timeout_s)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet and who this process is."""

    master_addr: str
    master_port: int
    world_size: int
    rank: int
    local_rank: int
    agent_store: bool = False  # torchrun's agent hosts the store

    @staticmethod
    def from_env(env: Mapping[str, str]) -> Rendezvous | None:
        """The torchrun-style rendezvous of ``env``; None if it names none."""
        if not all(k in env for k in _ENV_KEYS):
            present = [k for k in _ENV_KEYS if k in env]
            if present and "RANK" in present:
                raise ConfigError(f"a torchrun-style launch needs {', '.join(_ENV_KEYS)}; "
                                  f"only {', '.join(present)} are set")
            return None
        try:
            world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
            port, local = int(env["MASTER_PORT"]), int(env.get("LOCAL_RANK", env["RANK"]))
        except ValueError as exc:
            raise ConfigError(f"bad torchrun-style environment: {exc}") from None
        if not 0 <= rank < world:
            raise ConfigError(f"RANK {rank} is not in [0, WORLD_SIZE {world})")
        return Rendezvous(env["MASTER_ADDR"], port, world, rank, local,
                          env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")

    def store(self, timeout: datetime.timedelta) -> dist.Store:
        """The store every rank reaches (rank 0 hosts it unless torchrun's agent does).

        Rank 0 binds it to the address ``MASTER_ADDR`` names when that address is on this
        host (the one the other ranks dial); otherwise (a NAT or service address) torch
        binds every interface, as torchrun's agent does (docs/tensor-parallel.md)."""
        store: dist.TCPStore
        if not self.agent_store and self.rank == 0:
            try:
                store = host_store(self.master_addr, self.master_port, self.world_size,
                                   timeout)
            except OSError:
                store = dist.TCPStore(self.master_addr, self.master_port, self.world_size,
                                      is_master=True, timeout=timeout,
                                      wait_for_workers=False)
        else:
            store = dist.TCPStore(self.master_addr, self.master_port, self.world_size,
                                  is_master=False, timeout=timeout, wait_for_workers=False)
        return dist.PrefixStore("model_executor", store)


def host_store(addr: str, port: int, world_size: int,
               timeout: datetime.timedelta) -> dist.TCPStore:
    """Host a TCP store listening on ``addr`` alone (``port`` 0: a free one, ``.port``).

    torch's own store server listens on every interface (IPv4 and IPv6) whatever its
    ``host_name``, and the store has no authentication: so the listening socket is made
    here and handed over (``master_listen_fd``; the store owns and closes it). Raises
    ``OSError`` when ``addr`` cannot be bound (not on this host, or the port is taken).
    """
    family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port,
                                                          type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    bound_port = sock.getsockname()[1]
    return dist.TCPStore(addr, bound_port, world_size, is_master=True, timeout=timeout,
                         wait_for_workers=False, master_listen_fd=sock.detach())


def rank_device(device: str, local_rank: int) -> str:
    """Each rank's device: ``cuda:<local rank>`` on CUDA (one GPU per process)."""
    if device.startswith("cuda"):
        if device != "cuda":
            raise ConfigError(f"--device {device} with tensor parallelism: each rank uses "
                              "cuda:<LOCAL_RANK> (set CUDA_VISIBLE_DEVICES to choose the "
                              "GPUs); pass --device cuda")
        return f"cuda:{local_rank}"
    return device


def die_with_parent() -> None:
    """Have the kernel kill this process when its parent dies (Linux; else nothing)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before the call above
        os._exit(1)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


FailureCallback = Callable[[int, str], None]


class Heartbeat:
    """Bump this rank's counter in the store; watch the others' (rank 0) or rank 0's.

    ``on_failure(rank, reason)`` runs once, on the heartbeat thread, for the first rank
    found silent, or with this rank's own number when the store cannot be reached
    (its host, rank 0 or torchrun's agent, is gone).
    """

    def __init__(self, store: dist.Store, rank: int, size: int, config: ParallelConfig,
                 on_failure: FailureCallback) -> None:
        self.store, self.rank, self.size, self.config = store, rank, size, config
        self.on_failure = on_failure
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{rank}",
                                        daemon=True)
        self.watched = list(range(1, size)) if rank == 0 else [0]

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        seen = {r: (-1, time.monotonic()) for r in self.watched}
        interval, timeout = self.config.heartbeat_interval_s, self.config.heartbeat_timeout_s
        while not self._stop.wait(interval):
            try:
                self.store.add(f"hb/{self.rank}", 1)
                counts = {r: self.store.add(f"hb/{r}", 0) for r in self.watched}
            except Exception as exc:  # any store failure means the same
                if not self._stop.is_set():
                    self.on_failure(self.rank, f"the rendezvous store is unreachable ({exc})")
                return
            now = time.monotonic()
            for r, count in counts.items():
                last, since = seen[r]
                if count != last:
                    seen[r] = (count, now)
                elif count > 0 and now - since > timeout:
                    self.on_failure(r, f"no heartbeat for {now - since:.1f} s (hung, stopped "
                                    "or unreachable)")
                    return


class ChildWatch:
    """Rank 0's watch on the ranks it spawned: the first to exit is a failure, unless
    ``expect_exit`` was called (a clean shutdown)."""

    def __init__(self, children: dict[int, Any], on_failure: FailureCallback) -> None:
        self.children, self.on_failure = children, on_failure
        self._expected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-watch", daemon=True)

    def start(self) -> ChildWatch:
        self._thread.start()
        return self

    def expect_exit(self) -> None:
        self._expected.set()

    def _run(self) -> None:
        by_sentinel = {p.sentinel: r for r, p in self.children.items()}
        while by_sentinel and not self._expected.is_set():
            ready = multiprocessing.connection.wait(list(by_sentinel), timeout=0.5)
            for sentinel in ready:
                rank = by_sentinel.pop(sentinel)  # type: ignore[call-overload]
                if self._expected.is_set():
                    return
                proc = self.children[rank]
                proc.join(1)
                self.on_failure(rank, f"its process {describe_exit(proc.exitcode)}")
                return

    def stop_all(self, timeout: float = 10.0) -> list[int | None]:
        """Wait for the children, then SIGTERM and SIGKILL those still running; their exit
        codes, in rank order."""
        deadline = time.monotonic() + timeout
        for proc in self.children.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.children.values():
            if proc.is_alive():
                proc.terminate()
                proc.join(3)
            if proc.is_alive():
                proc.kill()
                proc.join(3)
        return [p.exitcode for _, p in sorted(self.children.items())]


def spawn_context() -> Any:
    return multiprocessing.get_context("spawn")
