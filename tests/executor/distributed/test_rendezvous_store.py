"""The rendezvous store listens on the address the ranks dial, never on every interface:
it has no authentication, and the ranks' keys (heartbeats, agreements) live there."""

from __future__ import annotations

import datetime
import os
import socket

from executor.distributed import LOOPBACK, Rendezvous, host_store
from tests.helpers.serving import listening_addresses

TIMEOUT = datetime.timedelta(seconds=10)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def test_spawned_ranks_store_listens_on_loopback_only() -> None:
    store = host_store(LOOPBACK, 0, 2, TIMEOUT)
    assert store.port > 0
    assert (LOOPBACK, store.port) in listening_addresses(os.getpid())
    assert [a for a, p in listening_addresses(os.getpid()) if p == store.port] == [LOOPBACK]
    client = Rendezvous(LOOPBACK, store.port, 2, 1, 1).store(TIMEOUT)
    client.set("k", "v")
    assert store.get("model_executor/k") == b"v"


def test_rank_zero_binds_the_master_address_it_is_given() -> None:
    """A torchrun-style launch on one host (MASTER_ADDR=127.0.0.1): rank 0's store is
    reachable there and nowhere else."""
    port = _free_port()
    store = Rendezvous(LOOPBACK, port, 2, 0, 0).store(TIMEOUT)
    bound = [a for a, p in listening_addresses(os.getpid()) if p == port]
    assert bound == [LOOPBACK], bound
    Rendezvous(LOOPBACK, port, 2, 1, 1).store(TIMEOUT).set("k", "v")
    assert store.get("k") == b"v"

