"""The Executor servicer: proto in -> one call on the executor thread -> proto out.

It checks the server is READY, converts the request (``service/convert.py``), runs the
call on the worker, records step metrics and the KV snapshot, and answers with the step's
timings. Errors are raised, never caught: the interceptor maps them to status codes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import grpc
import structlog

from executor.api import (
    DecodeItem,
    ExecutorStatus,
    KVStats,
    Phase,
    PrefillItem,
    StepResult,
)
from service import convert
from service.config import RequestLimits
from service.errors import Unavailable
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc
from service.health import Lifecycle, State
from service.stats import StatsRecorder
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


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class ExecutorServicer(pb_grpc.ExecutorServicer):
    def __init__(self, lifecycle: Lifecycle, worker: ExecutorWorker, recorder: StatsRecorder,
                 limits: RequestLimits, version: str) -> None:
        self._lifecycle = lifecycle
        self._worker = worker
        self._recorder = recorder
        self._limits = limits
        self._version = version
        self._started = time.monotonic()
        # Last known executor status, for Health: read without touching the executor.
        self.status: ExecutorStatus | None = None

    # -- state shared with the server's boot sequence -----------------------------------
    def update_status(self, status: ExecutorStatus) -> None:
        self.status = status
        self._recorder.kv(status.kv)
        self._recorder.graphs(status.graphs)

    def _update_kv(self, kv: KVStats) -> None:
        if self.status is not None:
            self.status = dataclasses.replace(self.status, kv=kv)
        self._recorder.kv(kv)

    def _require_ready(self) -> None:
        state = self._lifecycle.state
        if state is State.READY:
            return
        why = _WHY_NOT_READY[state]
        if state is State.UNHEALTHY and self._lifecycle.reason:
            why = f"{why} ({self._lifecycle.reason})"
        raise Unavailable(why, _RETRY_AFTER_S[state])

    # -- RPCs ---------------------------------------------------------------------------
    async def Prefill(self, request: pb.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> pb.StepResponse:
        structlog.contextvars.bind_contextvars(
            items=len(request.items), tokens=sum(len(it.token_ids) for it in request.items))
        self._require_ready()
        items = convert.prefill_items(request, self._limits)
        return await self._step(lambda ex: ex.prefill(items), items, context)

    async def Decode(self, request: pb.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> pb.StepResponse:
        structlog.contextvars.bind_contextvars(items=len(request.items),
                                               tokens=len(request.items))
        self._require_ready()
        items = convert.decode_items(request, self._limits)
        return await self._step(lambda ex: ex.decode(items), items, context)

    async def _step(self, call: Callable[[ExecutorLike], StepResult],
                    items: Sequence[PrefillItem] | Sequence[DecodeItem],
                    context: grpc.aio.ServicerContext) -> pb.StepResponse:
        def run(ex: ExecutorLike) -> tuple[StepResult, KVStats, dict[Phase, list[float]]]:
            return call(ex), ex.kv_stats(), ex.drain_replay_seconds()

        timed = await self._worker.run(run, _deadline(context))
        result, kv, replays = timed.value
        self._recorder.step(result.step, len(items), timed.execute_ms / 1e3)
        self._recorder.replays(replays)
        self._update_kv(kv)
        structlog.contextvars.bind_contextvars(path=result.step.path)
        return convert.step_response(result, timed.queue_ms, timed.execute_ms)

    async def Release(self, request: pb.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        structlog.contextvars.bind_contextvars(items=len(request.seq_ids))
        self._require_ready()
        seq_ids = convert.release_ids(request, self._limits)
        timed = await self._worker.run(lambda ex: (ex.release(seq_ids), ex.kv_stats()),
                                       _deadline(context))
        result, kv = timed.value
        self._update_kv(kv)
        return convert.release_response(result)

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
            self._lifecycle.state.value, self.status, self._version,
            time.monotonic() - self._started, self._worker.pending)
