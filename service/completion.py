"""Blocking waits off the event loop: a Session step's completion (``PendingStep.finish``
waits for the step's device event, then builds its outputs).

A call travels to a thread through a ``SimpleQueue`` and its outcome comes back through
``call_soon_threadsafe`` onto an asyncio future, as in ``service.worker``: less host time
than ``loop.run_in_executor``, which chains a ``concurrent.futures.Future`` and its
condition to an asyncio future by two callbacks. Like the default thread pool, each call
starts at once (a thread is added while every thread is busy, up to ``max_threads``; then
calls queue), so one stream's wait never holds up another's; threads are daemons and are
never retired. The servicer owns one pool for its Session streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[Callable[[], Any], "asyncio.Future[Any]", asyncio.AbstractEventLoop]


class CompletionThreads:
    """Runs ``fn()`` on a thread of its own and answers on the caller's loop.

    A caller that stops waiting (its future cancelled) does not stop ``fn``: it runs to its
    end and its outcome is dropped.
    """

    def __init__(self, max_threads: int | None = None, name: str = "completion") -> None:
        # The default thread pool's size (concurrent.futures.ThreadPoolExecutor).
        self._max = max_threads if max_threads is not None else min(32, (os.cpu_count() or 1)
                                                                     + 4)
        self._name = name
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._busy = 0  # calls submitted and not finished

    @property
    def threads(self) -> int:
        """Threads started so far."""
        return self._threads

    def run(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """``fn()`` off the loop; await the returned future for its value or exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            self._busy += 1
            spawn = self._busy > self._threads and self._threads < self._max
            if spawn:
                self._threads += 1
                index = self._threads
        if spawn:
            threading.Thread(target=self._serve, name=f"{self._name}_{index}",
                             daemon=True).start()
        self._jobs.put((fn, future, loop))
        return future

    def _serve(self) -> None:
        while True:
            fn, future, loop = self._jobs.get()
            try:
                value, exc = fn(), None
            except BaseException as e:  # handed to the caller on its loop
                value, exc = None, e
            with self._lock:
                self._busy -= 1
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
                loop.call_soon_threadsafe(_deliver, future, value, exc)
            del fn, future, loop, value, exc  # hold nothing while idle


def _deliver(future: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if future.done():  # the caller stopped waiting
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)
