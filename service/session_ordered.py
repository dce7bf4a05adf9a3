"""A Session's barrier steps: release, truncate, fork and update_weights.

Each runs when the stream's writer reaches it, so after every earlier step of the stream
has completed, and the reader launches nothing past it until it has run
(``SessionStream._ordered``). Here: the request checked (as its unary call checks it) and
turned into the job the writer runs on the executor thread.
"""

from __future__ import annotations

from collections.abc import Callable

from service import convert
from service.config import RequestLimits
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.idempotency import ResponseCache, fork_once
from service.stats import StatsRecorder
from service.weights_rpc import UpdateJob
from service.worker import ExecutorLike

#: The operations that wait for every earlier step of their stream.
ORDERED_OPS = frozenset({"release", "truncate", "fork", "update_weights"})
OrderedJob = Callable[[ExecutorLike], pb.SessionResponse]


def ordered_job(step: int, op: str, request: pb.SessionRequest, limits: RequestLimits,
                cache: ResponseCache, recorder: StatsRecorder,
                update_job: Callable[[pb.UpdateWeightsRequest], UpdateJob] | None
                ) -> OrderedJob:
    """The barrier step ``op`` of ``request`` as a job (raises for a bad request)."""
    run: OrderedJob
    if op == "release":
        seq_ids = convert.release_ids(request.release, limits)

        def run(ex: ExecutorLike) -> pb.SessionResponse:
            result = ex.release(seq_ids)
            cache.drop_sequences(seq_ids)
            return pb.SessionResponse(step=step, release=convert.release_response(result))
    elif op == "fork":
        parent, child, prefix = convert.fork_args(request.fork, limits)
        key = cache.key("Fork", request.fork)

        def run(ex: ExecutorLike) -> pb.SessionResponse:
            response, replayed = fork_once(ex, cache, key, parent, child, prefix)
            if replayed:
                recorder.retry_replayed("Fork")
            return pb.SessionResponse(step=step, fork=response)
    elif op == "update_weights":
        assert update_job is not None, "the servicer gives Sessions its weight updates"
        job = update_job(request.update_weights)

        def run(ex: ExecutorLike) -> pb.SessionResponse:
            return pb.SessionResponse(step=step, update_weights=job(ex))
    else:
        seq_id, length = convert.truncate_args(request.truncate, limits)

        def run(ex: ExecutorLike) -> pb.SessionResponse:
            result = ex.truncate(seq_id, length)
            return pb.SessionResponse(step=step, truncate=convert.truncate_response(result))

    return run
