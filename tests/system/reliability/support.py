"""Helpers shared by the reliability tests: live servers whose calls are counted into the
figures, the KV accounting check, a gate that holds a step on the executor thread, and
status/detail accessors."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from executor.api import KVStats
from executor.config import ExecutorConfig
from service.config import ServerConfig
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.server import ExecutorFactory
from tests.service.harness import ServerHarness, tiny_config
from tests.system.reliability.figures import Figures

__all__ = ["Gate", "ServerHarness", "check_kv", "details", "rpc_error", "serving",
           "tiny_config", "wait_until"]


@contextmanager
def serving(figures: Figures, executor_config: ExecutorConfig | None = None,
            server_config: ServerConfig | None = None, factory: ExecutorFactory | None = None,
            ready: bool = True) -> Iterator[ServerHarness]:
    """A live in-process server on a free loopback port; its calls go into ``figures``."""
    harness = ServerHarness(executor_config, server_config, factory)
    try:
        if ready:
            harness.wait_ready()
        yield harness
    finally:
        try:
            figures.add_scrape(scrape_registry(harness))  # also after a stop
        finally:
            harness.close()


def scrape_registry(harness: ServerHarness
                    ) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The server's metrics read from its registry (no exporter needed)."""
    text = generate_latest(harness.server.metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def check_kv(harness: ServerHarness, figures: Figures, expected: KVStats | None = None
             ) -> KVStats:
    """Assert the executor's accounting invariant (free + used == total, nothing owned
    twice), on the executor thread so no step runs meanwhile; the stats, which must equal
    ``expected`` when given and agree with what Health reports."""
    executor: Any = harness.server.worker.executor
    assert executor is not None

    def run(ex: Any) -> KVStats:
        ex.kv.check_invariants()
        return ex.kv.stats()  # type: ignore[no-any-return]

    if harness.server.worker.failure is not None:  # the worker refuses jobs: check here
        stats = run(executor)
    else:
        stats = harness.call(harness.server.worker.run(run)).value
    if expected is not None:
        assert stats == expected
    figures.invariant_checks += 1
    return stats


def rpc_error(fn: Any, request: Message, timeout: float = 10, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(request, timeout=timeout, **kwargs)
    return info.value


def details(err: grpc.RpcError) -> dict[str, Message]:
    """google.rpc details by short type name (one of each kind)."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    out: dict[str, Message] = {}
    for detail in status.details if status is not None else ():
        name = detail.TypeName().rsplit(".", 1)[-1]
        msg: Message = getattr(error_details_pb2, name)()
        detail.Unpack(msg)
        out[name] = msg
    return out


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        time.sleep(0.005)


def pending(harness: ServerHarness) -> int:
    return int(harness.stub.Health(pb.HealthRequest(), timeout=5).pending_calls)


class Gate:
    """Wraps an executor method so calls whose first seq_id is ``hold`` stop on the executor
    thread until ``open()``: a slow step, injected. Counts the calls that reached it."""

    def __init__(self, harness: ServerHarness, method: str, hold: str) -> None:
        self.executor: Any = harness.executor
        self.method = method
        self.real = getattr(self.executor, method)
        self.hold = hold
        self.entered = threading.Event()
        self._open = threading.Event()
        self.calls: list[list[str]] = []  # seq_ids of every call that reached the executor
        setattr(self.executor, method, self._call)

    def _call(self, items: Any) -> Any:
        self.calls.append([it.seq_id for it in items])
        if items and items[0].seq_id == self.hold and not self._open.is_set():
            self.entered.set()
            assert self._open.wait(30), "gate never opened"
        return self.real(items)

    def open(self) -> None:
        self._open.set()

    def restore(self) -> None:
        self._open.set()
        setattr(self.executor, self.method, self.real)

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
