"""The ``Session`` stream: steps launched as they arrive, answered in step order.

* The reader (a task) reads requests, keeps step numbers increasing, refuses steps after a
  failure until it is acknowledged (ABORTED), and launches each step on the executor thread
  (validate, allocate, run, sample, start the tokens' copy to the host), at most ``depth``
  unanswered at once.
* The writer (the handler's generator) takes launched steps in order, waits for each off the
  executor thread, answers it and stores it for retries; a device failure found there rolls
  back, on the executor thread, every step launched after it and then the step itself.
* On the executor thread launches and roll-backs run in arrival order; the launched steps
  (``_launched``) live there, so a roll-back sees every launch queued before it.

A stream that ends early stops the reader; steps already launched (the one being waited for
included) still complete in a task of their own (``_drain``) and their responses go to the
retry cache, not the gone client. A stream with nothing unanswered and no new request for
``idle_timeout_s`` is closed (``SessionIdle``, ``service/idle.py``). A failed step is
logged like a failed unary call, under its own ``request_id`` (else one made from the
stream's), which its INTERNAL status names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from executor import PendingStep
from executor.api import StepResult
from executor.errors import FieldViolation, InvalidRequest
from service import convert, errors
from service.completion import CompletionThreads
from service.config import RequestLimits
from service.errors import SessionIdle, StepAborted, Unavailable, step_error
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.idempotency import Key, Replayed, RetryGate
from service.idle import IdleTimer
from service.interceptors import MAX_HEADER_REQUEST_ID
from service.session_ordered import ORDERED_OPS, ordered_job
from service.stats import StatsRecorder
from service.weights_rpc import UpdateJob
from service.worker import ExecutorLike, ExecutorWorker

log = structlog.get_logger("model_executor.session")


@dataclass(frozen=True)
class SessionShared:
    """What every Session stream of one servicer shares; the servicer owns it."""

    worker: ExecutorWorker
    gate: RetryGate
    recorder: StatsRecorder
    limits: RequestLimits
    depth: int  # launched steps not yet answered, per stream
    require_ready: Callable[[], None]
    idle_timeout_s: float  # 0: never closed for idleness
    # An UpdateWeights step's job (``WeightsService.update_job``); None: not offered.
    update_weights: Callable[[pb.UpdateWeightsRequest], UpdateJob] | None = None
    # Where launched steps are waited for and built, off the loop (threads start on use).
    completions: CompletionThreads = field(
        default_factory=lambda: CompletionThreads(name="session_complete"))
    # Drains of streams that ended early, kept referenced until they finish.
    draining: set[asyncio.Future[None]] = field(default_factory=set)


@dataclass
class _Entry:
    """One step on its way to its response."""

    step: int
    op: str  # "prefill" | "decode" | "release" | "truncate" | "fork" | "update_weights"
    request_id: str = ""  # the step's own (its body's), if any
    pending: PendingStep | None = None  # launched, to complete
    response: pb.SessionResponse | None = None  # ready (error, release, replayed)
    key: Key | None = None
    seq_ids: list[str] = field(default_factory=list)
    items: int = 0
    packed: bool = False  # DecodeRequest.packed_outputs
    launched_at: float = 0.0
    # The wait for its completion off the loop, once asked: a drain takes it over when
    # the writer's wait was cancelled (``finish`` runs once).
    finishing: asyncio.Future[StepResult] | None = None
    replays: dict[Any, list[float]] = field(default_factory=dict)
    # A barrier step (``ORDERED_OPS``), run by the writer in step order (after every
    # earlier step has completed); ``applied`` is set once it has run.
    ordered: Callable[[ExecutorLike], pb.SessionResponse] | None = None
    applied: asyncio.Event = field(default_factory=asyncio.Event)


class SessionStream:
    """One ``Session`` call: its reader, writer and the steps between them."""

    def __init__(self, shared: SessionShared) -> None:
        self._shared = shared
        self._worker, self._gate, self._recorder = shared.worker, shared.gate, shared.recorder
        self._cache = shared.gate.cache
        self._limits, self._require_ready = shared.limits, shared.require_ready
        self._slots = asyncio.Semaphore(shared.depth)
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
        # The interceptor bound the stream's request id: steps without one log under it.
        self._stream_id = str(structlog.contextvars.get_contextvars().get("request_id", ""))
        self._idle = IdleTimer(self._shared.idle_timeout_s, self._close_idle)
        self._reader = reader = asyncio.ensure_future(self._read(requests))
        finished = False
        current: _Entry | None = None  # the step being answered
        try:
            while True:
                entry = await self._queue.get()
                if entry is None:
                    finished = True
                    break
                if isinstance(entry, BaseException):
                    raise entry
                current = entry
                response = await self._answer(entry)
                current = None
                self._idle.answered()
                yield response
                self._slots.release()
                self._record()
        finally:
            self._idle.cancel()
            if not finished:  # the stream ended early: launched steps still complete
                if self._in_launch:  # a launch that reached the executor thread applies
                    self._stopping = True
                else:
                    reader.cancel()
                task = asyncio.ensure_future(self._drain(reader, current))
                self._shared.draining.add(task)
                task.add_done_callback(self._shared.draining.discard)

    def _close_idle(self) -> None:
        """The idle timer expired: nothing is unanswered, so the reader waits for a request
        (never inside a launch) and can be cancelled; the writer ends the stream."""
        self._reader.cancel()
        self._queue.put_nowait(SessionIdle(self._shared.idle_timeout_s))

    async def _answer(self, entry: _Entry) -> pb.SessionResponse:
        if entry.ordered is not None:
            try:
                entry.response = (await self._worker.run(entry.ordered)).value
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                self._failed = entry.step
                entry.response = self._failure(entry.step, exc, entry.request_id)
            finally:
                entry.applied.set()
        if entry.response is not None:
            return entry.response
        assert entry.pending is not None
        try:
            result = await self._complete(entry)
        except asyncio.CancelledError:  # the stream ended: the drain completes the step
            raise
        except StepAborted as exc:
            self._gate.abandon(entry.key)
            return self._failure(entry.step, exc, entry.request_id)
        except BaseException as exc:  # a device failure: roll back this step and later ones
            self._failed = entry.step
            response = self._failure(entry.step, exc, entry.request_id)
            # After a fatal error the device is not touched again (the worker refuses).
            with contextlib.suppress(Unavailable):
                await self._worker.run(lambda ex: self._roll_back(ex, entry.step))
            self._gate.abandon(entry.key)
            return response
        return self._respond(entry, result)

    async def _complete(self, entry: _Entry) -> StepResult:
        """Wait for a launched step off the executor thread (its event) and build it: on a
        completion thread, or here if its device work is done. The wait is shielded: a
        writer cancelled meanwhile leaves it to the drain."""
        pending = entry.pending
        assert pending is not None
        if entry.finishing is None:
            if pending.finished:
                raise StepAborted("rolled back: an earlier step of this session failed "
                                  "when it completed; nothing of this step applied")
            if pending.done is None or (pending.on_sampled is None and pending.done.query()):
                # CPU: the work ran at launch; or the device is done with it (a host-bound
                # pipeline): no wait, so no hop to a thread (grammar rows still take it).
                return pending.finish()
            entry.finishing = self._shared.completions.run(pending.finish)
        return await asyncio.shield(entry.finishing)

    def _failure(self, step: int, exc: BaseException, request_id: str) -> pb.SessionResponse:
        """A failed step's answer, logged like a failed unary call: a bug with its
        traceback at ERROR, any other error with its code and reason at INFO. Named by the
        step's ``request_id``, else ``<stream's request id>-step-<step>``: the id an
        INTERNAL status quotes is the one in the log."""
        if not isinstance(exc, StepAborted):
            self._recorder.error(exc)
        if errors.is_fatal_device_error(exc):  # as a unary call's: the server turns UNHEALTHY
            self._worker.fatal(exc)
        request_id = request_id[:MAX_HEADER_REQUEST_ID] or f"{self._stream_id}-step-{step}"
        response = step_error(step, exc, request_id)
        fields: dict[str, Any] = {"step": step, "request_id": request_id,
                                  "stream_request_id": self._stream_id,
                                  "code": response.error.code_name}
        if isinstance(exc, StepAborted) or errors.is_expected(exc):
            log.info("session_step_failed", message=response.error.message, **fields)
        else:
            log.error("session_step_failed", **fields, exc_info=exc)
        return response

    def _respond(self, entry: _Entry, result: StepResult) -> pb.SessionResponse:
        """The step's answer, kept for retries; its metrics are recorded by ``_record``
        once the answer is sent (off the path to the scheduler's next step)."""
        execute_s = time.perf_counter() - entry.launched_at
        # Made in place in the answer (not apart and copied in); the cache keeps that part.
        answer = pb.SessionResponse(step=entry.step)
        response: convert.StepResponse = answer.prefill if entry.op == "prefill" \
            else answer.decode
        convert.fill_step_response(response, result, 0.0, execute_s * 1e3, entry.packed)
        self._gate.answer(entry.key, entry.seq_ids, response)
        self._unrecorded.append((entry, result, execute_s))
        return answer

    def _record(self) -> None:
        for entry, result, execute_s in self._unrecorded:
            self._recorder.step(result.step, entry.items, execute_s)
            self._recorder.replays(entry.replays)
            if self._debug:
                log.debug("session step", step=entry.step, op=entry.op)
        if self._unrecorded:
            self._recorder.retry_cache(*self._cache.size())
        self._unrecorded.clear()

    async def _drain(self, reader: asyncio.Future[None], current: _Entry | None) -> None:
        """Complete what the gone stream launched (``current``: the step it was answering,
        first), for the retry cache and metrics."""
        if current is not None and current.pending is not None:
            await self._drain_step(current)
        while not self._queue.empty() or not reader.done():
            if self._queue.empty():  # the reader finishes the launch it was in, then stops
                with contextlib.suppress(BaseException):  # it queued its outcome
                    await reader
                continue
            entry = self._queue.get_nowait()
            if isinstance(entry, _Entry) and entry.ordered is not None:
                entry.applied.set()  # never applied: its stream is gone
            elif isinstance(entry, _Entry) and entry.pending is not None:
                await self._drain_step(entry)

    async def _drain_step(self, entry: _Entry) -> None:
        try:
            await self._answer(entry)
        except BaseException:  # nothing to tell a gone client
            log.warning("session step failed after its stream ended",
                        step=entry.step, exc_info=True)
        self._record()

    # -- reader ---------------------------------------------------------------------------
    async def _read(self, requests: AsyncIterator[pb.SessionRequest]) -> None:
        try:
            async for request in requests:
                self._idle.received()
                await self._slots.acquire()
                # Never cancelled (see ``run``): a launch that reached the executor thread
                # applies even when the stream ends meanwhile, so its entry must reach the
                # queue (``_drain``). Awaited here, not in a task of its own: a task and a
                # shield per step would add event-loop work to every step.
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
                "truncate, fork or update_weights")])
        if self._last_step is not None and step <= self._last_step:
            raise InvalidRequest([FieldViolation(
                "step", f"step {step} is not greater than the previous step {self._last_step}")])
        self._last_step = step
        request_id = str(getattr(getattr(request, op), "request_id", ""))
        if self._failed is not None:
            if request.ack_failed_step != self._failed:
                return _Entry(step, op, response=self._failure(step, StepAborted(
                    f"step {self._failed} failed; steps after it are refused until a "
                    f"request sets ack_failed_step={self._failed}; nothing applied"),
                    request_id))
            self._failed = None
        try:
            self._require_ready()
            if op in ORDERED_OPS:
                return await self._ordered(step, op, request, request_id)
            return await self._launch_step(step, op, request, request_id)
        except StepAborted as exc:  # an earlier step's failure, found at this launch: that
            # step stays the one to acknowledge (nothing of this one applied)
            return _Entry(step, op, response=self._failure(step, exc, request_id))
        except BaseException as exc:
            self._failed = step
            return _Entry(step, op, response=self._failure(step, exc, request_id))

    async def _ordered(self, step: int, op: str, request: pb.SessionRequest,
                       request_id: str) -> _Entry:
        """A barrier step (``service/session_ordered.py``) runs when the writer reaches it,
        so after every earlier step has completed; the reader launches nothing past it
        until then."""
        shared = self._shared
        run = ordered_job(step, op, request, self._limits, self._cache, self._recorder,
                          shared.update_weights)
        entry = _Entry(step, op, request_id, ordered=run)
        self._queue.put_nowait(entry)
        await entry.applied.wait()
        return entry

    async def _launch_step(self, step: int, op: str, request: pb.SessionRequest,
                           request_id: str) -> _Entry:
        body: pb.PrefillRequest | pb.DecodeRequest = getattr(request, op)
        method = "Prefill" if op == "prefill" else "Decode"
        key = self._cache.key(method, body)
        items: list[Any] = (convert.prefill_items(body, self._limits)
                            if isinstance(body, pb.PrefillRequest)
                            else self._decode_items(body))
        entry = _Entry(step, op, request_id, key=key, seq_ids=[it.seq_id for it in items],
                       items=len(items), packed=isinstance(body, pb.DecodeRequest)
                       and body.packed_outputs)

        def refuse_after_failure() -> None:
            if self._failed is not None:  # a device failure was found meanwhile
                raise StepAborted(f"step {self._failed} failed; nothing of this step applied")

        def launch(ex: ExecutorLike) -> _Entry:
            entry.launched_at = time.perf_counter()
            if op == "prefill":
                entry.pending = ex.launch_prefill(items)
            else:
                assert isinstance(body, pb.DecodeRequest)
                entry.pending = ex.launch_decode(items, convert.decode_steps(body))
            self._launched = [(s, p) for s, p in self._launched if not p.finished]
            self._launched.append((step, entry.pending))
            entry.replays = ex.drain_replay_seconds()
            return entry

        outcome = await self._gate.run(key, launch, hold=True, check=refuse_after_failure)
        if isinstance(outcome, Replayed):
            self._recorder.retry_replayed(method)
            return _Entry(step, op, response=_stepped(step, outcome.response))
        return outcome

    def _decode_items(self, body: pb.DecodeRequest) -> list[Any]:
        """``convert.decode_items``, except that a request equal to the last one converted
        reuses its items: a pipelined decode loop sends the same request step after step
        (items continuing from their last samples), and comparing it whole (in C) costs a
        small fraction of converting it."""
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


def _stepped(step: int, response: convert.StepResponse) -> pb.SessionResponse:
    if isinstance(response, pb.PrefillResponse):
        return pb.SessionResponse(step=step, prefill=response)
    return pb.SessionResponse(step=step, decode=response)
