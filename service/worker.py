"""The one thread that touches the executor.

The executor is not thread-safe and owns the device stream, so every call into it,
construction included, runs on a single dedicated thread; the event loop only awaits the
results, so Health, the health service and metrics answer while a step runs.

Calls run in arrival order. A call is dropped without touching the executor if its deadline
passed or its caller cancelled while it waited, or if an earlier call hit a fatal device
error (UNAVAILABLE, nothing applied). A started call always runs to its end; if its caller
has gone its result is dropped, so work that must survive that (keeping a response for a
retry, metrics) belongs inside the call itself. At shutdown, after the grace period,
``close_queue`` refuses every call not started and ``abandon`` answers the callers still
waiting: UNAVAILABLE for a call that never started, ``OutcomeUnknown`` for the one whose
step is still running (it may apply after the answer; never told "not applied").
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, cast

import structlog

from executor import PendingStep
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
from service.errors import DeadlineExpired, OutcomeUnknown, Unavailable, is_fatal_device_error

if TYPE_CHECKING:
    from executor.weights.control import WeightControl

T = TypeVar("T")
log = structlog.get_logger(__name__)


class ExecutorLike(Protocol):
    """What the service needs from ``executor.executor.Executor``."""

    config: ExecutorConfig
    model_info: ModelInfo
    weights: WeightControl  # the version, updates, the trainer's group, sleep

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


class _Call:
    """One call on its way through the worker: queued, then started (or dropped)."""

    __slots__ = ("began", "dropped", "fn", "future", "loop", "submitted")

    def __init__(self, fn: Callable[[], object], future: asyncio.Future[object],
                 loop: asyncio.AbstractEventLoop) -> None:
        self.fn, self.future, self.loop = fn, future, loop
        self.submitted = time.perf_counter()
        self.began = False  # it has run its checks: it may be in the step (under _lock)
        self.dropped = False  # cancelled while queued: it never runs (under _lock)


class ExecutorWorker:
    """Runs functions of the executor, one at a time, on one thread.

    ``on_fatal`` is called on the event loop when a call fails with a fatal device error,
    also when that call's caller is gone. ``on_wait`` gets, on the worker thread, how long
    each call waited in the queue. ``after_call`` runs on the worker thread after every call
    that touched the executor (also one that raised), before its caller is answered: what
    it reads of the executor (the KV accounting) is then never older than the last call.

    A call travels to the thread through a ``SimpleQueue`` and its result back through
    ``call_soon_threadsafe`` onto an asyncio future: about half the host time of a thread
    pool's future chained to an asyncio one plus a wait on two futures, once per step of
    every stream (``bench.serving.session_latency``).
    """

    def __init__(self, on_fatal: Callable[[BaseException], None] | None = None,
                 on_wait: Callable[[float], None] | None = None,
                 after_call: Callable[[ExecutorLike], None] | None = None) -> None:
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="executor_0", daemon=True)
        self._thread.start()
        self._executor: ExecutorLike | None = None
        self._on_fatal = on_fatal
        self._on_wait = on_wait  # seconds each call waited before it started (a metric)
        self._after_call = after_call
        self._lock = threading.Lock()
        self._pending = 0
        self._queued: set[_Call] = set()  # submitted, not taken by the thread yet
        self._waiting: set[_Call] = set()  # callers awaiting their call's result
        self._closing = False  # set by close_queue: calls not started refuse
        self._abandoned = False  # set by abandon(): every waiting caller was answered
        self._stopped = False
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
        ctx = contextvars.copy_context()
        executor = cast(ExecutorLike, await self._submit(lambda: ctx.run(factory)))
        self._executor = executor
        return executor

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
        ctx = contextvars.copy_context()  # request_id etc. reach logs from the thread
        loop = asyncio.get_running_loop()

        def job() -> tuple[T, float, float]:
            started = time.perf_counter()
            if self._on_wait is not None:
                self._on_wait(started - call.submitted)
            if self._closing:
                raise Unavailable("the server stopped before this call started; nothing "
                                  "was applied")
            if self.failure is not None:
                raise Unavailable("the device failed during an earlier call and cannot be "
                                  f"trusted ({self.failure}); nothing was applied")
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExpired("the deadline passed while the call waited for the "
                                      "executor; nothing was applied")
            with self._lock:  # abandon() answers "not applied" only before this point
                if call.dropped:
                    raise Unavailable("the server stopped before this call started; nothing "
                                      "was applied")
                call.began = True
            try:
                value = ctx.run(fn, executor)
            except BaseException as exc:
                if is_fatal_device_error(exc) and self.failure is None:
                    self.failure = exc
                    if self._on_fatal is not None:
                        loop.call_soon_threadsafe(self._on_fatal, exc)
                raise
            finally:
                self._observe(executor)
            return value, started, time.perf_counter()

        call = _Call(job, loop.create_future(), loop)
        if self._abandoned:
            raise Unavailable("the server stopped before this call started; nothing was "
                              "applied")
        outcome = cast(tuple[T, float, float], await self._enqueue(call))
        value, started, ended = outcome
        return Timed(value, (started - call.submitted) * 1e3, (ended - started) * 1e3)

    def _observe(self, executor: ExecutorLike) -> None:
        """``after_call`` (worker thread); a failure there never replaces the call's own
        outcome."""
        if self._after_call is not None:
            try:
                self._after_call(executor)
            except Exception:
                log.warning("after_call_failed", exc_info=True)

    async def _submit(self, fn: Callable[[], object]) -> object:
        call = _Call(fn, asyncio.get_running_loop().create_future(),
                     asyncio.get_running_loop())
        return await self._enqueue(call)

    async def _enqueue(self, call: _Call) -> object:
        with self._lock:
            if self._stopped:
                raise RuntimeError("the executor worker is shut down")
            self._pending += 1
            self._queued.add(call)
        self._waiting.add(call)
        self._queue.put(call)
        try:
            return await call.future
        except asyncio.CancelledError:
            with self._lock:
                self._unqueue(call)  # never started: it never will
            raise
        finally:
            self._waiting.discard(call)

    # -- the worker thread ------------------------------------------------------------
    def _unqueue(self, call: _Call) -> bool:
        """Under ``_lock``: drop ``call`` if the thread has not taken it yet (it stops
        counting as pending at once); True if it was dropped."""
        if call not in self._queued:
            return False
        self._queued.discard(call)
        call.dropped = True
        self._pending -= 1
        return True

    def _serve(self) -> None:
        while (call := self._queue.get()) is not None:
            with self._lock:
                if call not in self._queued:  # dropped while it waited
                    continue
                self._queued.discard(call)
            try:
                value, exc = self._call(call)
            finally:
                # (before the answer: its caller may read ``pending`` as soon as it has it)
                with self._lock:
                    self._pending -= 1
            self._answer(call, value, exc)

    @staticmethod
    def _call(call: _Call) -> tuple[object, BaseException | None]:
        try:
            return call.fn(), None
        except BaseException as exc:  # handed to the caller on the loop
            return None, exc

    @staticmethod
    def _answer(call: _Call, value: object, exc: BaseException | None) -> None:
        def deliver() -> None:
            future = call.future
            if future.done():  # the caller is gone or was answered
                return
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(value)

        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
            call.loop.call_soon_threadsafe(deliver)

    # -- shutdown -----------------------------------------------------------------------
    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no call is queued or running, at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self._pending > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def fatal(self, exc: BaseException) -> None:
        """A fatal device error seen off the executor thread (a Session step's completion,
        where an asynchronous device error surfaces): from now on the worker refuses every
        call as it would after one raised on its thread, and ``on_fatal`` is told; on the
        loop."""
        if self.failure is None:
            self.failure = exc
            if self._on_fatal is not None:
                self._on_fatal(exc)

    def close_queue(self) -> None:
        """From now on, calls that have not started refuse (nothing applied)."""
        self._closing = True

    def abandon(self) -> None:
        """Answer every caller still waiting (see the module docstring); on the loop."""
        self._closing = True
        self._abandoned = True
        for call in list(self._waiting):
            future = call.future
            if future.done():
                continue
            with self._lock:
                began = call.began
                if not began and not self._unqueue(call):
                    call.dropped = True  # taken, not started: its checks refuse it
            if began:
                future.set_exception(OutcomeUnknown(
                    "the server's grace period ended while this call's step was still "
                    "running; it may still apply"))
            else:
                future.set_exception(Unavailable(
                    "the server stopped before this call started; nothing was applied"))

    def shutdown(self, wait: bool = True) -> None:
        """Stop the thread after the running call; queued calls are cancelled."""
        with self._lock:
            self._stopped = True
            queued = list(self._queued)
            for call in queued:
                self._unqueue(call)
        for call in queued:  # their callers see a cancellation, as before they started
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
                call.loop.call_soon_threadsafe(call.future.cancel)
        self._queue.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()
        self._executor = None
