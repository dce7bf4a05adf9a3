"""The idle clock of a stream: how long it has had nothing to do.

A stream is idle while every request it received has been answered; the clock runs from
the stream's start and from each answer that left it with nothing unanswered. A step held
on the executor (or the device) therefore never counts as idle time, however long it takes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class IdleTimer:
    """Calls ``on_expiry()`` (on the loop, once) when the stream has been idle for
    ``timeout_s``; 0 never expires. ``received()`` per request, ``answered()`` per answer:
    per step only a counter moves; the one timer handle is re-armed at most once per
    timeout, not per step."""

    def __init__(self, timeout_s: float, on_expiry: Callable[[], None]) -> None:
        self._timeout = timeout_s
        self._on_expiry = on_expiry
        self._unanswered = 0
        self._idle_since = time.monotonic()
        self._handle: asyncio.TimerHandle | None = None
        if timeout_s > 0:
            self._arm(timeout_s)

    def received(self) -> None:
        self._unanswered += 1

    def answered(self) -> None:
        self._unanswered -= 1
        if self._unanswered == 0:
            self._idle_since = time.monotonic()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self, delay: float) -> None:
        self._handle = asyncio.get_running_loop().call_later(delay, self._check)

    def _check(self) -> None:
        if self._unanswered > 0:  # busy: idle at the earliest one timeout from now
            self._arm(self._timeout)
            return
        left = self._idle_since + self._timeout - time.monotonic()
        if left > 0:
            self._arm(left)
            return
        self._handle = None
        self._on_expiry()
