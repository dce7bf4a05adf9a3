"""Leaving the process groups (``bootstrap.shutdown``): one order on every rank, and a
bound, so a teardown blocked on a peer or inside the backend cannot keep a process alive.
A world of one on CPU (gloo) runs the real groups; the blocking destroy is simulated."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from executor.distributed import bootstrap
from tests.executor.distributed.world import world_of_one

CPU = torch.device("cpu")


def test_teardown_runs_in_one_order_and_leaves_no_group(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    calls: list[str] = []
    real_barrier, real_destroy = dist.barrier, dist.destroy_process_group
    with world_of_one(CPU) as tp:
        names = {id(tp.control): "control", id(tp.startup): "startup"}

        def barrier(group: Any = None, **kw: Any) -> Any:
            calls.append(f"barrier {names.get(id(group), 'default')}")
            return real_barrier(group=group, **kw)

        def destroy(group: Any = None) -> None:
            calls.append(f"destroy {names.get(id(group), 'default')}")
            real_destroy(group)

        monkeypatch.setattr(dist, "barrier", barrier)
        monkeypatch.setattr(dist, "destroy_process_group", destroy)
        assert bootstrap.shutdown(tp, timeout_s=30)
        assert calls == ["barrier control", "destroy startup", "destroy control",
                         "destroy default"]
        assert not dist.is_initialized()


def test_a_blocked_teardown_is_given_up_within_its_bound(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """A destroy that never returns (a peer gone, a communicator stuck): ``shutdown``
    says so within its bound, and the caller exits the process instead of waiting."""
    release = threading.Event()
    real_destroy = dist.destroy_process_group

    def stuck(group: Any = None) -> None:
        release.wait(60)
        real_destroy(group)

    with world_of_one(CPU) as tp:
        monkeypatch.setattr(dist, "destroy_process_group", stuck)
        started = time.monotonic()
        assert not bootstrap.shutdown(tp, timeout_s=0.5)
        assert time.monotonic() - started < 5
        release.set()  # let the left-behind teardown finish, for the next test
        deadline = time.monotonic() + 30
        while dist.is_initialized() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not dist.is_initialized()
