"""The Executor servicer: proto in -> one call on the executor thread -> proto out.

It checks the server is READY, converts the request (``service/convert.py``), runs the
call on the worker, records step metrics, and answers with the step's timings (the KV
accounting that Health reports is the worker's, read after every executor call). Errors
are raised, never caught: the interceptor maps them to status codes.

Prefill and Decode with a ``request_id`` are idempotent: they run through the
``RetryGate`` (``service/idempotency.py``), and the job stores its own response and records
the step's metrics before it returns, so both survive a caller that gave up while it ran.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
import structlog
from google.protobuf.message import Message

from executor.api import (
    DecodeItem,
    ExecutorStatus,
    PrefillItem,
    StepResult,
)
from executor.errors import StateConflict
from service import convert
from service.config import RequestLimits
from service.errors import Unavailable
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc
from service.health import Lifecycle, State
from service.idempotency import Key, Replayed, ResponseCache, RetryGate, fork_once
from service.session import SessionShared, SessionStream
from service.stats import StatsRecorder
from service.weights_rpc import WeightsService
from service.worker import ExecutorLike, ExecutorWorker

_RETRY_AFTER_S: dict[State, float | None] = {
    State.STARTING: 1.0, State.CAPTURING: 1.0, State.DRAINING: None, State.UNHEALTHY: None,
}
_WHY_NOT_READY: dict[State, str] = {
    State.STARTING: "the server is starting (loading weights, allocating the KV cache)",
    State.CAPTURING: "the server is capturing CUDA graphs",
    State.DRAINING: "the server is shutting down; use another replica",
    State.UNHEALTHY: "the server is unhealthy and must be restarted",
}


Item = TypeVar("Item", PrefillItem, DecodeItem)
R = TypeVar("R", bound=Message)


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class ExecutorServicer(pb_grpc.ExecutorServicer):
    def __init__(self, lifecycle: Lifecycle, worker: ExecutorWorker, recorder: StatsRecorder,
                 limits: RequestLimits, version: str, cache: ResponseCache,
                 session_depth: int = 2, session_idle_timeout_s: float = 0.0) -> None:
        self._lifecycle = lifecycle
        self._worker = worker
        self._recorder = recorder
        self._limits = limits
        self._cache = cache
        self._version = version
        self._gate = RetryGate(worker, cache)
        # UpdateWeights, the trainer's group, Sleep and WakeUp (``service/weights_rpc.py``).
        self.weights = WeightsService(lifecycle, worker, cache, limits, self.update_status,
                                      recorder)
        # The Session streams' shared parts (completion threads, drains of gone streams).
        self.sessions = SessionShared(worker, self._gate, recorder, limits, session_depth,
                                      self._require_ready, session_idle_timeout_s,
                                      self.weights.update_job)
        self._started = time.monotonic()
        # Last known executor status, for Health: read without touching the executor.
        self.status: ExecutorStatus | None = None

    # -- state shared with the server's boot sequence -----------------------------------
    def update_status(self, status: ExecutorStatus) -> None:
        """The model and graphs of ``status``; its KV accounting is not kept: the worker
        publishes that on the executor thread after every call (``StatsRecorder.kv``), and
        this one, taken earlier, may be older than the last call's."""
        self.status = status
        self._recorder.graphs(status.graphs)
        self._recorder.sleeping(bool(status.model.sleeping) or status.model.weights_discarded)

    def current_status(self) -> ExecutorStatus | None:
        """The executor's status with the KV accounting after the last executor call."""
        kv = self._recorder.latest_kv
        if self.status is None or kv is None or self.status.kv is kv:
            return self.status
        self.status = dataclasses.replace(self.status, kv=kv)
        return self.status

    def _require_ready(self) -> None:
        state = self._lifecycle.state
        if state is State.READY:
            return
        if state is State.SLEEPING:
            raise StateConflict("the server is asleep (Sleep gave its memory back): call "
                                "WakeUp first, or UpdateWeights to refill discarded weights",
                                "SLEEPING")
        why = _WHY_NOT_READY[state]
        if state is State.UNHEALTHY and self._lifecycle.reason:
            why = f"{why} ({self._lifecycle.reason})"
        raise Unavailable(why, _RETRY_AFTER_S[state])

    # -- RPCs ---------------------------------------------------------------------------
    async def Prefill(self, request: pb.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        structlog.contextvars.bind_contextvars(
            items=len(request.items), tokens=sum(len(it.token_ids) for it in request.items))
        return await self._step(
            "Prefill", self._cache.key("Prefill", request),
            lambda: convert.prefill_items(request, self._limits),
            lambda ex, items: ex.prefill(items), pb.PrefillResponse, context)

    async def Decode(self, request: pb.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> pb.DecodeResponse:
        structlog.contextvars.bind_contextvars(items=len(request.items),
                                               tokens=len(request.items))
        return await self._step(
            "Decode", self._cache.key("Decode", request),
            lambda: convert.decode_items(request, self._limits),
            lambda ex, items: ex.decode(items, convert.decode_steps(request)),
            pb.DecodeResponse, context, packed=request.packed_outputs)

    async def _step(self, method: str, key: Key | None, items_of: Callable[[], list[Item]],
                    call: Callable[[ExecutorLike, list[Item]], StepResult],
                    message: convert.StepResponseType,
                    context: grpc.aio.ServicerContext, packed: bool = False) -> Any:
        # A retry whose original finished is answered at once, in any state: it runs nothing.
        cached = self._gate.cached(key)
        if cached is not None:
            return self._replayed(method, cached)
        self._require_ready()
        items = items_of()
        submitted = time.perf_counter()

        def run(ex: ExecutorLike) -> convert.StepResponse:
            started = time.perf_counter()
            result = call(ex, items)
            replays = ex.drain_replay_seconds()
            execute_s = time.perf_counter() - started
            response = convert.step_response(result, (started - submitted) * 1e3,
                                             execute_s * 1e3, message, packed)
            self._gate.answer(key, [it.seq_id for it in items], response)
            self._recorder.step(result.step, len(items), execute_s)
            self._recorder.replays(replays)
            self._recorder.retry_cache(*self._cache.size())
            return response

        response = await self._gate.run(key, run, deadline=_deadline(context))
        if isinstance(response, Replayed):  # the original ran, or was a Session step
            return self._replayed(method, response.response)
        structlog.contextvars.bind_contextvars(path=convert.PATH_NAMES[response.step.path])
        if response.step.fallback_reason:
            structlog.contextvars.bind_contextvars(
                fallback_reason=response.step.fallback_reason)
        return response

    def _replayed(self, method: str, response: R) -> R:
        structlog.contextvars.bind_contextvars(replayed=True)
        self._recorder.retry_replayed(method)
        return response

    async def Session(self, request_iterator: AsyncIterator[pb.SessionRequest],
                      context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[pb.SessionResponse]:
        """Pipelined steps over one stream (``service/session.py``)."""
        async for response in SessionStream(self.sessions).run(request_iterator, context):
            yield response

    async def Release(self, request: pb.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        structlog.contextvars.bind_contextvars(items=len(request.seq_ids))
        self._require_ready()
        seq_ids = convert.release_ids(request, self._limits)

        def run(ex: ExecutorLike) -> pb.ReleaseResponse:
            result = ex.release(seq_ids)
            self._cache.drop_sequences(seq_ids)  # retries of their calls now get ABORTED
            self._recorder.retry_cache(*self._cache.size())
            return convert.release_response(result)

        return (await self._worker.run(run, _deadline(context))).value

    async def Truncate(self, request: pb.TruncateRequest,
                       context: grpc.aio.ServicerContext) -> pb.TruncateResponse:
        self._require_ready()
        seq_id, length = convert.truncate_args(request, self._limits)

        def run(ex: ExecutorLike) -> pb.TruncateResponse:
            return convert.truncate_response(ex.truncate(seq_id, length))

        return (await self._worker.run(run, _deadline(context))).value

    async def Fork(self, request: pb.ForkRequest,
                   context: grpc.aio.ServicerContext) -> pb.ForkResponse:
        key = self._cache.key("Fork", request)
        cached = self._cache.get_fork(key) if key is not None else None
        if cached is not None:  # the original applied: never run twice
            return self._replayed("Fork", cached)
        self._require_ready()
        parent, child, prefix = convert.fork_args(request, self._limits)
        structlog.contextvars.bind_contextvars(parent=parent, child=child)

        def run(ex: ExecutorLike) -> tuple[pb.ForkResponse, bool]:
            response, replayed = fork_once(ex, self._cache, key, parent, child, prefix)
            if not replayed:  # else the original ran while this retry waited
                self._recorder.retry_cache(*self._cache.size())
            return response, replayed

        response, replayed = (await self._worker.run(run, _deadline(context))).value
        return self._replayed("Fork", response) if replayed else response

    async def Capture(self, request: pb.CaptureRequest,
                      context: grpc.aio.ServicerContext) -> pb.CaptureResponse:
        self._require_ready()
        phases = convert.capture_phases(request)
        timed = await self._worker.run(
            lambda ex: (ex.capture(phases, force=request.force), ex.status()))
        captures, status = timed.value
        self._recorder.capture(captures, force=request.force)
        self.update_status(status)
        return convert.capture_response(captures)

    async def Health(self, request: pb.HealthRequest,
                     context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        return convert.health_response(
            self._lifecycle.state.value, self.current_status(), self._version,
            time.monotonic() - self._started, self._worker.pending)

    # -- weights (``service/weights_rpc.py``) ---------------------------------------------
    async def UpdateWeights(self, request: pb.UpdateWeightsRequest,
                            context: grpc.aio.ServicerContext) -> pb.UpdateWeightsResponse:
        structlog.contextvars.bind_contextvars(weight_version=request.weight_version)
        response = await self.weights.update_weights(request, context)
        structlog.contextvars.bind_contextvars(  # on the call's one log line
            tensors_updated=response.tensors_updated, bytes_updated=response.bytes_updated,
            update_ms=round(response.update_ms, 1))
        return response

    async def InitWeightTransfer(self, request: pb.InitWeightTransferRequest,
                                 context: grpc.aio.ServicerContext
                                 ) -> pb.InitWeightTransferResponse:
        return await self.weights.init_transfer(request, context)

    async def DestroyWeightTransfer(self, request: pb.DestroyWeightTransferRequest,
                                    context: grpc.aio.ServicerContext
                                    ) -> pb.DestroyWeightTransferResponse:
        return await self.weights.destroy_transfer(request, context)

    async def Sleep(self, request: pb.SleepRequest,
                    context: grpc.aio.ServicerContext) -> pb.SleepResponse:
        return await self.weights.sleep(request, context)

    async def WakeUp(self, request: pb.WakeUpRequest,
                     context: grpc.aio.ServicerContext) -> pb.WakeUpResponse:
        return await self.weights.wake_up(request, context)
