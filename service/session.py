"""The ``Session`` stream: steps launched as they arrive, answered in step order.

Three parties share one stream's state:

* the reader (a task) reads requests, keeps step numbers increasing, refuses steps after
  a failure until it is acknowledged (ABORTED), and *launches* each step on the executor
  thread (``Executor.launch_*``: validate, allocate, run, sample on the device, start the
  tokens' copy to the host), at most ``depth`` unanswered at once;
* the writer (the handler's generator) takes launched steps in order, waits for each
  one's device work off the executor thread, builds its response, stores it for retries,
  records metrics and sends it; a device failure found there rolls back, on the executor
  thread, every step launched after it and then the step itself, newest first;
* the executor thread, where launches and roll-backs run in arrival order and where the
  list of launched steps lives (``_launched``), so a roll-back sees every launch queued
  before it.

A stream that ends early (cancelled, timed out, broken) stops the reader; the steps already
launched still complete, in a task of their own, and their responses go to the retry cache
(steps with a request_id), not to the gone client. A launch the reader is in the middle of
then is not cancelled: the reader finishes it, queues its entry and stops (``_drain``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from google.rpc import code_pb2, error_details_pb2, status_pb2

from executor import PendingStep
from executor.api import KVStats, StepResult
from executor.errors import FieldViolation, InvalidRequest
from service import convert, errors
from service.completion import CompletionThreads
from service.config import RequestLimits
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.idempotency import Key, ResponseCache
from service.stats import StatsRecorder
from service.worker import ExecutorLike, ExecutorWorker

log = structlog.get_logger("model_executor.session")


class InflightSteps:
    """Session steps launched with a request_id and not answered yet, by key. A retry that
    arrives meanwhile (a unary call, another stream) waits for the original's response
    instead of running the step a second time; ``None`` means the original did not apply.
    Added on the executor thread at launch, so a retry's own job there sees it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: dict[Key, concurrent.futures.Future[convert.StepResponse | None]] = {}

    def add(self, key: Key) -> None:
        with self._lock:
            self._steps[key] = concurrent.futures.Future()

    def get(self, key: Key) -> concurrent.futures.Future[convert.StepResponse | None] | None:
        with self._lock:
            return self._steps.get(key)

    def resolve(self, key: Key, response: convert.StepResponse | None) -> None:
        with self._lock:
            future = self._steps.pop(key, None)
        if future is not None:
            future.set_result(response)


# Drains of streams that ended early, kept referenced until they finish.
_DRAINING: set[asyncio.Future[None]] = set()
# Where launched steps are waited for and built, off the loop (threads start on first use).
_COMPLETIONS = CompletionThreads(name="session_complete")


class StepAborted(Exception):
    """A step refused or rolled back because an earlier step of its session failed."""


@dataclass
class _Entry:
    """One step on its way to its response."""

    step: int
    op: str  # "prefill" | "decode" | "release" | "truncate" | "fork"
    pending: PendingStep | None = None  # launched, to complete
    response: pb.SessionResponse | None = None  # ready (error, release, replayed)
    key: Key | None = None
    seq_ids: list[str] = field(default_factory=list)
    items: int = 0
    packed: bool = False  # DecodeRequest.packed_outputs
    launched_at: float = 0.0
    kv: KVStats | None = None
    replays: dict[Any, list[float]] = field(default_factory=dict)
    # A release, truncate or fork, run by the writer in step order (after every earlier step
    # has completed); ``applied`` is set once it has run.
    ordered: Callable[[ExecutorLike], pb.SessionResponse] | None = None
    applied: asyncio.Event = field(default_factory=asyncio.Event)


def fork_once(ex: ExecutorLike, cache: ResponseCache, key: Key | None, parent: str,
              child: str, prefix: int | None) -> tuple[pb.ForkResponse, bool]:
    """Fork on the executor thread (so ordered with the steps) unless the call's
    ``request_id`` already applied: ``(response, replayed)``."""
    if key is not None and (original := cache.get_fork(key)) is not None:
        return original, True
    response = convert.fork_response(ex.fork(parent, child, prefix))
    if key is not None:
        cache.put(key, [child], response)
    return response, False


class SessionStream:
    def __init__(self, worker: ExecutorWorker, cache: ResponseCache, recorder: StatsRecorder,
                 limits: RequestLimits, depth: int,
                 require_ready: Callable[[], None],
                 update_kv: Callable[[KVStats], None], inflight: InflightSteps) -> None:
        self._worker, self._cache, self._recorder = worker, cache, recorder
        self._inflight = inflight
        self._limits, self._require_ready, self._update_kv = limits, require_ready, update_kv
        self._slots = asyncio.Semaphore(depth)
        self._queue: asyncio.Queue[_Entry | BaseException | None] = asyncio.Queue()
        self._failed: int | None = None  # the failed step not yet acknowledged
        self._launched: list[tuple[int, PendingStep]] = []  # executor thread only
        self._last_step: int | None = None
        # The reader is inside ``_launch``: a stream that ends meanwhile lets it finish
        # (setting ``_stopping``) instead of cancelling it.
        self._in_launch = False
        self._stopping = False
        # The last decode request converted, and its items (reused for an equal request).
        self._last_decode: tuple[pb.DecodeRequest, list[Any]] | None = None
        # Answered steps whose metrics are recorded after their answer is sent.
        self._unrecorded: list[tuple[_Entry, StepResult, float]] = []
        # Per-step lines are DEBUG; asked once per stream, not per step (a filtered
        # structlog call still builds a bound logger and runs a processor).
        self._debug = logging.getLogger("model_executor.session").isEnabledFor(logging.DEBUG)

    # -- writer: the handler's generator ------------------------------------------------
    async def run(self, requests: AsyncIterator[pb.SessionRequest],
                  context: grpc.aio.ServicerContext) -> AsyncIterator[pb.SessionResponse]:
        reader = asyncio.ensure_future(self._read(requests))
        finished = False
        try:
            while True:
                entry = await self._queue.get()
                if entry is None:
                    finished = True
                    break
                if isinstance(entry, BaseException):
                    raise entry
                response = await self._answer(entry)
                yield response
                self._slots.release()
                self._record()
        finally:
            if not finished:  # the stream ended early: launched steps still complete
                if self._in_launch:  # a launch that reached the executor thread applies
                    self._stopping = True
                else:
                    reader.cancel()
                task = asyncio.ensure_future(self._drain(reader))
                _DRAINING.add(task)
                task.add_done_callback(_DRAINING.discard)

    async def _answer(self, entry: _Entry) -> pb.SessionResponse:
        if entry.ordered is not None:
            try:
                entry.response = (await self._worker.run(entry.ordered)).value
            except BaseException as exc:
                self._failed = entry.step
                self._recorder.error(exc)
                entry.response = _error(entry.step, exc)
            finally:
                entry.applied.set()
        if entry.response is not None:
            return entry.response
        assert entry.pending is not None
        try:
            result = await self._complete(entry.pending)
        except StepAborted as exc:
            self._resolve(entry, None)
            return _error(entry.step, exc)
        except BaseException as exc:  # a device failure: roll back this step and later ones
            self._failed = entry.step
            await self._worker.run(lambda ex: self._roll_back(ex, entry.step))
            self._recorder.error(exc)
            self._resolve(entry, None)
            return _error(entry.step, exc)
        return self._respond(entry, result)

    def _resolve(self, entry: _Entry, response: convert.StepResponse | None) -> None:
        if entry.key is not None:
            self._inflight.resolve(entry.key, response)

    async def _complete(self, pending: PendingStep) -> StepResult:
        """Wait for a launched step off the executor thread (its event) and build it."""
        if pending.finished:
            raise StepAborted("rolled back: an earlier step of this session failed when it "
                              "completed; nothing of this step applied")
        if pending.done is None:  # CPU: the work ran at launch
            return pending.finish()
        return await _COMPLETIONS.run(pending.finish)

    def _respond(self, entry: _Entry, result: StepResult) -> pb.SessionResponse:
        """The step's answer, kept for retries; its metrics are recorded by ``_record``
        once the answer is sent (off the path to the scheduler's next step)."""
        execute_s = time.perf_counter() - entry.launched_at
        # Made in place in the answer (not apart and copied in); the cache keeps that part.
        answer = pb.SessionResponse(step=entry.step)
        response: convert.StepResponse = answer.prefill if entry.op == "prefill" \
            else answer.decode
        convert.fill_step_response(response, result, 0.0, execute_s * 1e3, entry.packed)
        if entry.key is not None:
            self._cache.put(entry.key, entry.seq_ids, response)
        self._resolve(entry, response)
        self._unrecorded.append((entry, result, execute_s))
        return answer

    def _record(self) -> None:
        for entry, result, execute_s in self._unrecorded:
            self._recorder.step(result.step, entry.items, execute_s)
            self._recorder.replays(entry.replays)
            if entry.kv is not None:
                self._update_kv(entry.kv)
            if self._debug:
                log.debug("session step", step=entry.step, op=entry.op)
        if self._unrecorded:
            self._recorder.retry_cache(*self._cache.size())
        self._unrecorded.clear()

    async def _drain(self, reader: asyncio.Future[None]) -> None:
        """Complete what the gone stream launched, for the retry cache and metrics."""
        while not self._queue.empty() or not reader.done():
            if self._queue.empty():  # the reader finishes the launch it was in, then stops
                with contextlib.suppress(BaseException):  # it queued its outcome
                    await reader
                continue
            entry = self._queue.get_nowait()
            if isinstance(entry, _Entry) and entry.ordered is not None:
                entry.applied.set()  # never applied: its stream is gone
            elif isinstance(entry, _Entry) and entry.pending is not None:
                try:
                    await self._answer(entry)
                except BaseException:  # nothing to tell a gone client; logged by metrics
                    log.warning("session step failed after its stream ended",
                                step=entry.step, exc_info=True)
                self._record()

    # -- reader ---------------------------------------------------------------------------
    async def _read(self, requests: AsyncIterator[pb.SessionRequest]) -> None:
        try:
            async for request in requests:
                await self._slots.acquire()
                # Never cancelled (see ``run``): a launch that reached the executor thread
                # applies even when the stream ends meanwhile, so its entry must reach the
                # queue (``_drain``). Awaited here, not in a task of its own: a task and a
                # shield per step cost the loop about 10 us (dev VM).
                self._in_launch = True
                try:
                    entry = await self._launch(request)
                finally:
                    self._in_launch = False
                if entry.ordered is None:  # an ordered step queued itself, in order
                    self._queue.put_nowait(entry)
                if self._stopping:
                    return
            self._queue.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a protocol error or an unparseable message
            self._queue.put_nowait(exc)

    async def _launch(self, request: pb.SessionRequest) -> _Entry:
        step, op = request.step, request.WhichOneof("op")
        if op is None:
            raise InvalidRequest([FieldViolation(
                "op", "a Session request needs one of prefill, decode, release, "
                "truncate or fork")])
        if self._last_step is not None and step <= self._last_step:
            raise InvalidRequest([FieldViolation(
                "step", f"step {step} is not greater than the previous step {self._last_step}")])
        self._last_step = step
        if self._failed is not None:
            if request.ack_failed_step != self._failed:
                return _Entry(step, op, response=_error(step, StepAborted(
                    f"step {self._failed} failed; steps after it are refused until a "
                    f"request sets ack_failed_step={self._failed}; nothing applied")))
            self._failed = None
        try:
            self._require_ready()
            if op in ("release", "truncate", "fork"):
                return await self._ordered(step, op, request)
            return await self._launch_step(step, op, request)
        except StepAborted as exc:  # an earlier step's failure, found at this launch: that
            # step stays the one to acknowledge (nothing of this one applied)
            return _Entry(step, op, response=_error(step, exc))
        except BaseException as exc:
            self._failed = step
            self._recorder.error(exc)
            return _Entry(step, op, response=_error(step, exc))

    async def _ordered(self, step: int, op: str, request: pb.SessionRequest) -> _Entry:
        """A release, truncate or fork runs when the writer reaches it, so after every
        earlier step has completed; the reader launches nothing past it until then."""
        run: Callable[[ExecutorLike], pb.SessionResponse]
        if op == "release":
            seq_ids = convert.release_ids(request.release, self._limits)

            def run(ex: ExecutorLike) -> pb.SessionResponse:
                result = ex.release(seq_ids)
                self._cache.drop_sequences(seq_ids)
                self._update_kv(ex.kv_stats())
                return pb.SessionResponse(step=step, release=convert.release_response(result))
        elif op == "fork":
            parent, child, prefix = convert.fork_args(request.fork, self._limits)
            key = self._cache.key("Fork", request.fork)

            def run(ex: ExecutorLike) -> pb.SessionResponse:
                response, replayed = fork_once(ex, self._cache, key, parent, child, prefix)
                if replayed:
                    self._recorder.retry_replayed("Fork")
                else:
                    self._update_kv(ex.kv_stats())
                return pb.SessionResponse(step=step, fork=response)
        else:
            seq_id, length = convert.truncate_args(request.truncate, self._limits)

            def run(ex: ExecutorLike) -> pb.SessionResponse:
                result = ex.truncate(seq_id, length)
                self._update_kv(ex.kv_stats())
                return pb.SessionResponse(step=step,
                                          truncate=convert.truncate_response(result))

        entry = _Entry(step, op, ordered=run)
        self._queue.put_nowait(entry)
        await entry.applied.wait()
        return entry

    async def _launch_step(self, step: int, op: str, request: pb.SessionRequest) -> _Entry:
        body: pb.PrefillRequest | pb.DecodeRequest = getattr(request, op)
        method = "Prefill" if op == "prefill" else "Decode"
        key = self._cache.key(method, body)
        items: list[Any] = (convert.prefill_items(body, self._limits)
                            if isinstance(body, pb.PrefillRequest)
                            else self._decode_items(body))
        entry = _Entry(step, op, key=key, seq_ids=[it.seq_id for it in items],
                       items=len(items), packed=isinstance(body, pb.DecodeRequest)
                       and body.packed_outputs)

        def launch(ex: ExecutorLike) -> _Entry | concurrent.futures.Future[Any]:
            if self._failed is not None:  # a device failure was found meanwhile
                raise StepAborted(f"step {self._failed} failed; nothing of this step applied")
            if key is not None:  # a retry: answered by its original, never run twice
                if (cached := self._cache.get_step(key)) is not None:
                    entry.response = _stepped(step, op, cached)
                    return entry
                if (original := self._inflight.get(key)) is not None:
                    return original
                self._inflight.add(key)
                added.append(key)
            entry.launched_at = time.perf_counter()
            if op == "prefill":
                entry.pending = ex.launch_prefill(items)
            else:
                assert isinstance(body, pb.DecodeRequest)
                entry.pending = ex.launch_decode(items, convert.decode_steps(body))
            self._launched = [(s, p) for s, p in self._launched if not p.finished]
            self._launched.append((step, entry.pending))
            entry.kv, entry.replays = ex.kv_stats(), ex.drain_replay_seconds()
            return entry

        added: list[Key] = []  # the key this step registered as in flight, if any
        while True:
            try:
                outcome = (await self._worker.run(launch)).value
            except BaseException:
                for k in added:  # never launched: a waiting retry must run it itself
                    self._inflight.resolve(k, None)
                raise
            if isinstance(outcome, _Entry):
                if outcome.response is not None:
                    self._recorder.retry_replayed(method)
                return outcome
            original = await asyncio.wrap_future(outcome)  # launched by another stream
            if original is not None:
                self._recorder.retry_replayed(method)
                return _Entry(step, op, response=_stepped(step, op, original))

    def _decode_items(self, body: pb.DecodeRequest) -> list[Any]:
        """``convert.decode_items``, except that a request equal to the last one converted
        reuses its items: a pipelined decode loop sends the same request step after step
        (items continuing from their last samples), and comparing it whole runs in C (3 us
        at batch 64 on the dev VM, converting it about 50)."""
        last = self._last_decode
        if last is not None and body == last[0]:
            return last[1]
        items: list[Any] = convert.decode_items(body, self._limits)
        self._last_decode = (body, items)
        return items

    def _roll_back(self, ex: ExecutorLike, failed: int) -> None:
        """On the executor thread: abort every unfinished step from ``failed`` on."""
        for step, pending in reversed(self._launched):
            if step >= failed and not pending.finished:
                ex.abort(pending)
        self._update_kv(ex.kv_stats())


def _stepped(step: int, op: str, response: convert.StepResponse) -> pb.SessionResponse:
    if isinstance(response, pb.PrefillResponse):
        return pb.SessionResponse(step=step, prefill=response)
    return pb.SessionResponse(step=step, decode=response)


def _error(step: int, exc: BaseException) -> pb.SessionResponse:
    if isinstance(exc, StepAborted):
        status = status_pb2.Status(code=code_pb2.ABORTED, message=str(exc))
        status.details.add().Pack(error_details_pb2.ErrorInfo(
            reason="STEP_ABORTED", domain=errors.DOMAIN))
    else:
        status = errors.to_status(exc, f"session-step-{step}")
    code = errors.grpc_code(status)
    return pb.SessionResponse(step=step, error=pb.StepError(
        code=code.value[0], code_name=code.name, message=status.message,
        status=status.SerializeToString()))
