"""``ExecutorWorker``: one thread runs the calls in order; what happens to a call that is
cancelled, times out in the queue, or is still waiting when the server gives up."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from typing import Any

import pytest

from service.errors import DeadlineExpired, OutcomeUnknown, Unavailable
from service.worker import ExecutorWorker

_REQUEST: contextvars.ContextVar[str] = contextvars.ContextVar("request", default="-")


class _Fake:
    """Stands in for the executor: records which calls ran, on which thread."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.threads: set[str] = set()

    def note(self, name: str) -> str:
        self.ran.append(name)
        self.threads.add(threading.current_thread().name)
        return name


async def _worker(**kwargs: Any) -> tuple[ExecutorWorker, _Fake]:
    worker = ExecutorWorker(**kwargs)
    fake = _Fake()
    built = await worker.boot(lambda: fake)  # type: ignore[arg-type,return-value]
    assert built is fake
    return worker, fake


def _busy(worker: ExecutorWorker) -> tuple[threading.Event, asyncio.Future[Any],
                                          asyncio.Future[Any]]:
    """A call that runs (noting "r") until the gate is set, and one queued behind it."""
    gate = threading.Event()
    running = asyncio.ensure_future(worker.run(lambda ex: gate.wait(5) and ex.note("r")))
    queued = asyncio.ensure_future(worker.run(lambda ex: ex.note("queued")))
    return gate, running, queued


def test_calls_run_in_order_on_one_thread_with_the_callers_context() -> None:
    async def main() -> None:
        worker, fake = await _worker()
        _REQUEST.set("req-7")
        results = await asyncio.gather(*(worker.run(
            lambda ex, i=i: ex.note(f"{i}:{_REQUEST.get()}")) for i in range(20)))
        assert [r.value for r in results] == [f"{i}:req-7" for i in range(20)]
        assert fake.ran == [f"{i}:req-7" for i in range(20)]
        assert len(fake.threads) == 1 and threading.current_thread().name not in fake.threads
        assert all(r.queue_ms >= 0 and r.execute_ms >= 0 for r in results)

        def fail(ex: Any) -> None:
            raise ValueError("bad call")

        with pytest.raises(ValueError, match="bad call"):
            await worker.run(fail)
        assert worker.pending == 0
        worker.shutdown()

    asyncio.run(main())


def test_a_call_cancelled_while_queued_never_runs_and_a_late_deadline_refuses() -> None:
    async def main() -> None:
        worker, fake = await _worker()
        gate, running, queued = _busy(worker)
        late = asyncio.ensure_future(worker.run(lambda ex: ex.note("late"),
                                                deadline=time.monotonic() + 0.05))
        await asyncio.sleep(0.1)
        assert worker.pending == 3
        queued.cancel()
        await asyncio.sleep(0.1)  # the deadline passes while it waits
        assert worker.pending == 2  # the cancelled call stopped counting at once
        gate.set()
        assert (await running).value == "r"
        with pytest.raises(asyncio.CancelledError):
            await queued
        with pytest.raises(DeadlineExpired):
            await late
        assert (await worker.run(lambda ex: ex.note("after"))).value == "after"
        assert fake.ran == ["r", "after"]
        assert worker.pending == 0
        worker.shutdown()

    asyncio.run(main())


def test_abandon_answers_the_running_call_unknown_and_the_queued_one_not_applied() -> None:
    async def main() -> None:
        worker, fake = await _worker()
        gate, running, queued = _busy(worker)
        await asyncio.sleep(0.1)
        worker.abandon()
        with pytest.raises(OutcomeUnknown):
            await running
        with pytest.raises(Unavailable, match="nothing was applied"):
            await queued
        with pytest.raises(Unavailable):  # nothing is accepted after it
            await worker.run(lambda ex: ex.note("later"))
        gate.set()
        worker.shutdown(wait=True)
        assert fake.ran == ["r"]  # the running step finished; the queued one never ran

    asyncio.run(main())


def test_shutdown_cancels_queued_calls_after_the_running_one() -> None:
    async def main() -> None:
        worker, fake = await _worker()
        gate, running, queued = _busy(worker)
        await asyncio.sleep(0.1)
        stopping = asyncio.ensure_future(asyncio.to_thread(worker.shutdown, True))
        await asyncio.sleep(0.1)
        assert not stopping.done()  # it waits for the running call
        gate.set()
        await stopping
        assert (await running).value == "r"
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert fake.ran == ["r"] and worker.pending == 0

    asyncio.run(main())


def test_a_fatal_device_error_refuses_every_later_call() -> None:
    seen: list[BaseException] = []

    async def main() -> None:
        worker, fake = await _worker(on_fatal=seen.append)

        def device_fault(ex: Any) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        with pytest.raises(RuntimeError, match="illegal memory access"):
            await worker.run(device_fault)
        with pytest.raises(Unavailable, match="device failed"):
            await worker.run(lambda ex: ex.note("after"))
        await asyncio.sleep(0.05)  # on_fatal is called on the loop
        assert len(seen) == 1 and fake.ran == []
        worker.shutdown()

    asyncio.run(main())
