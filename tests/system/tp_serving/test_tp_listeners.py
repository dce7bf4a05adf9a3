"""A spawned tensor-parallel server listens on no wildcard address: the ranks' rendezvous
store (no authentication; the heartbeats live there) is on loopback, like gRPC by default."""

from __future__ import annotations

import ipaddress

from tests.helpers.serving import ServeProcess, listening_addresses


def test_no_rank_listens_on_every_interface(tiny_tp2: ServeProcess) -> None:
    server = tiny_tp2
    pids = {0: server.proc.pid, **server.rank_pids}
    listeners = {rank: listening_addresses(pid) for rank, pid in pids.items()}
    assert ("127.0.0.1", server.port) in listeners[0], listeners  # the view works
    # gloo's pairs bind the address the host name resolves to; nothing binds "any"
    wildcard = {rank: [(a, p) for a, p in found if ipaddress.ip_address(a).is_unspecified]
                for rank, found in listeners.items()}
    assert wildcard == {0: [], 1: []}, listeners
