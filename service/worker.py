"""The one thread that touches the executor.

The executor is not thread-safe and owns the device stream, so every call into it,
construction included, runs on a single dedicated thread. The event loop only awaits the
results, which keeps Health, the health service and metrics answering while a step runs.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from executor.api import (
    DecodeItem,
    ExecutorStatus,
    KVStats,
    ModelInfo,
    Phase,
    PhaseCapture,
    PrefillItem,
    ReleaseResult,
    StepResult,
)
from executor.config import ExecutorConfig
from service.errors import DeadlineExpired

T = TypeVar("T")


class ExecutorLike(Protocol):
    """What the service needs from ``executor.executor.Executor``."""

    config: ExecutorConfig
    model_info: ModelInfo

    def prefill(self, items: Sequence[PrefillItem]) -> StepResult: ...
    def decode(self, items: Sequence[DecodeItem]) -> StepResult: ...
    def release(self, seq_ids: Sequence[str]) -> ReleaseResult: ...
    def capture(self, phases: Sequence[Phase], force: bool = False, progress: bool = False
                ) -> tuple[PhaseCapture, ...]: ...
    def status(self) -> ExecutorStatus: ...
    def kv_stats(self) -> KVStats: ...
    def startup_phases(self) -> tuple[Phase, ...]: ...
    def drain_replay_seconds(self) -> dict[Phase, list[float]]: ...


@dataclass(frozen=True)
class Timed(Generic[T]):
    """A worker call's result with its wait and run times, in milliseconds."""

    value: T
    queue_ms: float
    execute_ms: float


class ExecutorWorker:
    """Runs functions of the executor, one at a time, on one thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor")
        self._executor: ExecutorLike | None = None
        self.pending = 0  # calls queued or running; read by Health

    @property
    def executor(self) -> ExecutorLike | None:
        return self._executor

    async def boot(self, factory: Callable[[], ExecutorLike]) -> ExecutorLike:
        """Build the executor on the worker thread (so the device context lives there)."""
        loop = asyncio.get_running_loop()
        ctx = contextvars.copy_context()
        self._executor = await loop.run_in_executor(self._pool, ctx.run, factory)
        return self._executor

    async def run(self, fn: Callable[[ExecutorLike], T], deadline: float | None = None
                  ) -> Timed[T]:
        """Run ``fn(executor)`` on the worker thread.

        ``deadline`` is a ``time.monotonic()`` instant: a call still queued then is dropped
        with ``DeadlineExpired`` and never touches the executor. A call cancelled while
        queued never runs; one cancelled while running finishes (a step cannot be
        interrupted) and its result is dropped.
        """
        executor = self._executor
        if executor is None:
            raise RuntimeError("the executor is not built yet")
        loop = asyncio.get_running_loop()
        ctx = contextvars.copy_context()  # request_id etc. reach logs from the thread
        submitted = time.perf_counter()

        def job() -> tuple[T, float, float]:
            started = time.perf_counter()
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExpired("the deadline passed while the call waited for the "
                                      "executor; nothing was applied")
            value = ctx.run(fn, executor)
            return value, started, time.perf_counter()

        self.pending += 1
        try:
            value, started, ended = await loop.run_in_executor(self._pool, job)
        finally:
            self.pending -= 1
        return Timed(value, (started - submitted) * 1e3, (ended - started) * 1e3)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the thread after the running call; queued calls are cancelled."""
        self._pool.shutdown(wait=wait, cancel_futures=True)
        self._executor = None
