"""The one thread that touches the executor.

The executor is not thread-safe and owns the device stream, so every call into it,
construction included, runs on a single dedicated thread. The event loop only awaits the
results, which keeps Health, the health service and metrics answering while a step runs.

Calls run in arrival order. A call is dropped without touching the executor if its deadline
passed while it waited, if its caller cancelled it while it waited, or if an earlier call hit
a fatal device error (the device cannot be trusted any more: UNAVAILABLE, nothing applied).
A call that has started always runs to its end (a step cannot be interrupted); if its caller
has gone, its result is dropped here, so work that must survive that (keeping a response for
a retry, metrics) belongs inside the call itself.

At shutdown, once the grace period is over, ``close_queue`` makes every call that has not
started refuse (UNAVAILABLE, nothing applied) and ``abandon`` answers the callers still
waiting: UNAVAILABLE for a call that never started, ``OutcomeUnknown`` for the one whose
step is still running (it may apply after the answer; the caller is never told "not
applied" for it).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from executor.api import (
    DecodeItem,
    ExecutorStatus,
    ForkResult,
    KVStats,
    ModelInfo,
    Phase,
    PhaseCapture,
    PrefillItem,
    ReleaseResult,
    StepResult,
    TruncateResult,
)
from executor.config import ExecutorConfig
from executor.steps import PendingStep
from service.errors import DeadlineExpired, OutcomeUnknown, Unavailable, is_fatal_device_error

T = TypeVar("T")


class ExecutorLike(Protocol):
    """What the service needs from ``executor.executor.Executor``."""

    config: ExecutorConfig
    model_info: ModelInfo

    def prefill(self, items: Sequence[PrefillItem]) -> StepResult: ...
    def decode(self, items: Sequence[DecodeItem], num_steps: int = 1) -> StepResult: ...
    def launch_prefill(self, items: Sequence[PrefillItem]) -> PendingStep: ...
    def launch_decode(self, items: Sequence[DecodeItem], num_steps: int = 1
                      ) -> PendingStep: ...
    def complete(self, step: PendingStep) -> StepResult: ...
    def abort(self, step: PendingStep) -> None: ...
    def release(self, seq_ids: Sequence[str]) -> ReleaseResult: ...
    def truncate(self, seq_id: str, length: int) -> TruncateResult: ...
    def fork(self, parent_id: str, child_id: str, prefix_len: int | None = None
             ) -> ForkResult: ...
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
    """Runs functions of the executor, one at a time, on one thread.

    ``on_fatal`` is called on the event loop when a call fails with a fatal device error,
    also when that call's caller is gone. ``on_wait`` gets, on the worker thread, how long
    each call waited in the queue.
    """

    def __init__(self, on_fatal: Callable[[BaseException], None] | None = None,
                 on_wait: Callable[[float], None] | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor")
        self._executor: ExecutorLike | None = None
        self._on_fatal = on_fatal
        self._on_wait = on_wait  # seconds each call waited before it started (a metric)
        self._lock = threading.Lock()
        self._pending = 0
        self._closing = False  # set by close_queue: calls not started refuse
        self._abandoned: asyncio.Future[None] | None = None  # done once abandon() ran
        self.failure: BaseException | None = None  # the fatal device error, once seen

    @property
    def pending(self) -> int:
        """Calls queued or running; read by Health."""
        return self._pending

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

        began = threading.Event()  # the job has run its checks (it may be in the step)

        def job() -> tuple[T, float, float]:
            started = time.perf_counter()
            if self._on_wait is not None:
                self._on_wait(started - submitted)
            if self._closing:
                raise Unavailable("the server stopped before this call started; nothing "
                                  "was applied")
            if self.failure is not None:
                raise Unavailable("the device failed during an earlier call and cannot be "
                                  f"trusted ({self.failure}); nothing was applied")
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExpired("the deadline passed while the call waited for the "
                                      "executor; nothing was applied")
            began.set()
            try:
                value = ctx.run(fn, executor)
            except BaseException as exc:
                if is_fatal_device_error(exc) and self.failure is None:
                    self.failure = exc
                    if self._on_fatal is not None:
                        loop.call_soon_threadsafe(self._on_fatal, exc)
                raise
            return value, started, time.perf_counter()

        with self._lock:
            self._pending += 1
        try:
            future = self._pool.submit(job)
        except BaseException:  # the pool is shut down
            self._finished(None)
            raise
        future.add_done_callback(self._finished)  # also for a call dropped from the queue
        wrapped = asyncio.wrap_future(future, loop=loop)
        if self._abandoned is None:
            self._abandoned = loop.create_future()
        try:
            await asyncio.wait((wrapped, self._abandoned), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            wrapped.cancel()  # cancels ``future`` only while it is queued (see above)
            raise
        if not wrapped.done():  # abandoned at shutdown
            wrapped.cancel()
            if began.is_set():
                raise OutcomeUnknown("the server's grace period ended while this call's step "
                                     "was still running; it may still apply")
            raise Unavailable("the server stopped before this call started; nothing was "
                              "applied")
        value, started, ended = wrapped.result()
        return Timed(value, (started - submitted) * 1e3, (ended - started) * 1e3)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no call is queued or running, at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self._pending > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def close_queue(self) -> None:
        """From now on, calls that have not started refuse (nothing applied)."""
        self._closing = True

    def abandon(self) -> None:
        """Answer every caller still waiting (see the module docstring); on the loop."""
        self._closing = True
        if self._abandoned is not None and not self._abandoned.done():
            self._abandoned.set_result(None)

    def _finished(self, _: object) -> None:
        with self._lock:
            self._pending -= 1

    def shutdown(self, wait: bool = True) -> None:
        """Stop the thread after the running call; queued calls are cancelled."""
        self._pool.shutdown(wait=wait, cancel_futures=True)
        self._executor = None
