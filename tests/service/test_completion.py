"""``CompletionThreads``: a Session step's wait off the loop; each call starts at once on
a thread of its own (never behind another caller's wait), up to the pool's size."""

from __future__ import annotations

import asyncio
import threading

import pytest

from service.completion import CompletionThreads


def test_value_and_exception_reach_the_caller_off_the_loop() -> None:
    pool = CompletionThreads(name="t")

    async def main() -> None:
        loop_thread = threading.current_thread().name
        assert await pool.run(lambda: threading.current_thread().name) != loop_thread

        def fail() -> None:
            raise ValueError("device")

        with pytest.raises(ValueError, match="device"):
            await pool.run(fail)
        # Sequential calls reuse the idle thread.
        for _ in range(5):
            assert await pool.run(lambda: 1) == 1
        assert pool.threads == 1

    asyncio.run(main())


def test_a_blocked_call_does_not_hold_up_another() -> None:
    pool = CompletionThreads(max_threads=4, name="t")
    release = threading.Event()

    async def main() -> None:
        blocked = pool.run(lambda: release.wait(10))
        assert await asyncio.wait_for(pool.run(lambda: "free"), 5) == "free"
        assert pool.threads == 2
        release.set()
        assert await blocked is True

    asyncio.run(main())


def test_calls_queue_once_every_thread_is_busy() -> None:
    pool = CompletionThreads(max_threads=1, name="t")
    release = threading.Event()
    order: list[str] = []

    def first_call() -> None:
        release.wait(10)
        order.append("first")

    async def main() -> None:
        first = pool.run(first_call)
        second = pool.run(lambda: order.append("second"))
        await asyncio.sleep(0.05)
        assert order == [] and pool.threads == 1
        release.set()
        await asyncio.gather(first, second)
        assert order == ["first", "second"]

    asyncio.run(main())


def test_a_caller_that_stops_waiting_does_not_stop_the_call() -> None:
    pool = CompletionThreads(name="t")
    release, ran = threading.Event(), threading.Event()

    def call() -> None:
        release.wait(10)
        ran.set()

    async def main() -> None:
        future = pool.run(call)
        future.cancel()
        release.set()
        assert await asyncio.to_thread(ran.wait, 5)
        assert await pool.run(lambda: 2) == 2  # the thread serves on

    asyncio.run(main())
