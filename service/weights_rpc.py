"""The weight RPCs: UpdateWeights, InitWeightTransfer, DestroyWeightTransfer, Sleep, WakeUp.

Each checks the server state and the request here (proto in), runs one call of the
executor's ``WeightControl`` on the executor thread, between steps (``service/worker.py``
runs one call at a time), and answers (proto out). UpdateWeights with a ``request_id``
is idempotent like Fork: a retry gets the stored answer and never copies twice. After
Sleep and WakeUp (and an update that refilled discarded weights) the lifecycle follows
what sleeps: SLEEPING while anything does or discarded weights wait, else READY.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import grpc

from executor.api import SLEEP_TAGS as TAGS
from executor.api import ExecutorStatus
from executor.api import SleepTag as Tag
from executor.errors import FieldViolation, InvalidRequest, StateConflict
from executor.weights import TensorMeta, TransferConfig, parse_dtype
from service.config import RequestLimits
from service.errors import Unavailable
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.health import Lifecycle, State
from service.idempotency import ResponseCache
from service.stats import StatsRecorder
from service.worker import ExecutorLike, ExecutorWorker

MAX_VERSION_BYTES = 256
#: States a weight operation runs in (the others refuse it).
_ALLOWED = (State.READY, State.SLEEPING)
UpdateJob = Callable[[ExecutorLike], pb.UpdateWeightsResponse]


class WeightsService:
    """The servicer's weight RPCs; ``publish`` takes the executor's status after each."""

    def __init__(self, lifecycle: Lifecycle, worker: ExecutorWorker, cache: ResponseCache,
                 limits: RequestLimits, publish: Callable[[ExecutorStatus], None],
                 recorder: StatsRecorder) -> None:
        self._lifecycle, self._worker, self._cache = lifecycle, worker, cache
        self._limits, self._publish, self._recorder = limits, publish, recorder

    # -- UpdateWeights --------------------------------------------------------------------
    def update_job(self, request: pb.UpdateWeightsRequest) -> UpdateJob:
        """The update as a job for the executor thread (also a Session step's): checked
        here, replayed for a retry of one that applied."""
        version, source = _update_args(request, self._limits)
        key = self._cache.key("UpdateWeights", request)

        def job(ex: ExecutorLike) -> pb.UpdateWeightsResponse:
            if key is not None and (original := self._cache.get_update(key)) is not None:
                return original
            control = ex.weights
            if isinstance(source, str):
                result = control.update_from_disk(version, source)
            else:
                result = control.update_from_trainer(version, *source)
            response = pb.UpdateWeightsResponse(
                weight_version=result.weight_version, tensors_updated=result.tensors_updated,
                bytes_updated=result.bytes_updated, update_ms=result.update_ms,
                check_ms=result.check_ms)
            if key is not None:
                self._cache.put(key, (), response)
            self._recorder.weights_updated("disk" if isinstance(source, str) else
                                           "distributed", result.update_ms / 1e3)
            self._publish(ex.status())  # Health names the version at once
            return response

        return job

    async def update_weights(self, request: pb.UpdateWeightsRequest,
                             context: grpc.aio.ServicerContext) -> pb.UpdateWeightsResponse:
        key = self._cache.key("UpdateWeights", request)
        if key is not None and (original := self._cache.get_update(key)) is not None:
            return original  # the original applied: never copy twice
        self._require_state("UpdateWeights")
        response = (await self._worker.run(self.update_job(request))).value
        await self._settle()
        return response

    # -- the trainer's group --------------------------------------------------------------
    async def init_transfer(self, request: pb.InitWeightTransferRequest,
                            context: grpc.aio.ServicerContext
                            ) -> pb.InitWeightTransferResponse:
        self._require_state("InitWeightTransfer")
        config = _transfer_config(request)
        joined = (await self._worker.run(
            lambda ex: ex.weights.init_transfer(config))).value
        return pb.InitWeightTransferResponse(ranks=joined.ranks, init_ms=joined.init_ms)

    async def destroy_transfer(self, request: pb.DestroyWeightTransferRequest,
                               context: grpc.aio.ServicerContext
                               ) -> pb.DestroyWeightTransferResponse:
        self._require_state("DestroyWeightTransfer")
        destroyed = (await self._worker.run(
            lambda ex: ex.weights.destroy_transfer())).value
        return pb.DestroyWeightTransferResponse(destroyed=destroyed)

    # -- Sleep, WakeUp --------------------------------------------------------------------
    async def sleep(self, request: pb.SleepRequest,
                    context: grpc.aio.ServicerContext) -> pb.SleepResponse:
        self._require_state("Sleep")
        tags = _tags(request.tags)

        def run(ex: ExecutorLike) -> pb.SleepResponse:
            result = ex.weights.sleep(tags, request.discard_weights,
                                      request.drop_sequences)
            if result.dropped_seq_ids:  # their retries now get ABORTED, as after Release
                self._cache.drop_sequences(result.dropped_seq_ids)
            self._publish(ex.status())
            return pb.SleepResponse(sleeping=result.sleeping, freed_bytes=result.freed_bytes,
                                    dropped_seq_ids=result.dropped_seq_ids,
                                    sleep_ms=result.sleep_ms)

        response = (await self._worker.run(run)).value
        await self._settle()
        return response

    async def wake_up(self, request: pb.WakeUpRequest,
                      context: grpc.aio.ServicerContext) -> pb.WakeUpResponse:
        self._require_state("WakeUp")
        tags = _tags(request.tags)

        def run(ex: ExecutorLike) -> pb.WakeUpResponse:
            result = ex.weights.wake(tags)
            self._publish(ex.status())
            return pb.WakeUpResponse(sleeping=result.sleeping, restore_ms=result.restore_ms,
                                     recapture_ms=result.recapture_ms,
                                     weights_discarded=result.weights_discarded)

        response = (await self._worker.run(run)).value
        await self._settle()
        return response

    # -- state ------------------------------------------------------------------------------
    def _require_state(self, method: str) -> None:
        state = self._lifecycle.state
        if state in _ALLOWED:
            return
        if state in (State.STARTING, State.CAPTURING):
            raise Unavailable(f"the server is {state.name.lower()}; {method} runs once it is "
                              "READY", 1.0)
        raise StateConflict(f"{method} is refused while the server is {state.name} "
                            f"({self._lifecycle.reason or 'it will not serve again'})",
                            f"SERVER_{state.name}")

    async def _settle(self) -> None:
        """READY or SLEEPING, as the executor's memory now is."""
        ex = self._worker.executor
        if ex is None or self._lifecycle.state not in _ALLOWED:
            return
        control = ex.weights
        asleep = bool(control.sleeping) or control.memory.discarded
        await self._lifecycle.set(State.SLEEPING if asleep else State.READY)


# -- requests ---------------------------------------------------------------------------------
def _update_args(request: pb.UpdateWeightsRequest, limits: RequestLimits
                 ) -> tuple[str, str | tuple[list[TensorMeta], int]]:
    bad: list[FieldViolation] = []
    if len(request.request_id) > limits.max_request_id_chars:
        bad.append(FieldViolation("request_id", f"at most {limits.max_request_id_chars} "
                                  f"characters, got {len(request.request_id)}"))
    if not 0 < len(request.weight_version.encode()) <= MAX_VERSION_BYTES:
        bad.append(FieldViolation("weight_version", f"required: 1..{MAX_VERSION_BYTES} "
                                  "bytes naming the new version"))
    kind = request.WhichOneof("source")
    source: str | tuple[list[TensorMeta], int] = ""
    if kind is None or (kind == "path" and not request.path):
        bad.append(FieldViolation("source", "give path (a Hugging Face directory on the "
                                  "server) or distributed (a trainer's broadcast)"))
    elif kind == "path":
        source = request.path
    else:
        d = request.distributed
        metas = []
        if not d.tensors:
            bad.append(FieldViolation("distributed.tensors", "the manifest is empty"))
        for i, t in enumerate(d.tensors):
            dtype = parse_dtype(t.dtype)
            if not t.name or dtype is None or any(n < 0 for n in t.shape):
                bad.append(FieldViolation(f"distributed.tensors[{i}]", f"tensor {t.name!r}: "
                                          "needs a name, a shape of sizes >= 0 and a dtype "
                                          "of bfloat16, float16, float32, float64"))
                continue
            metas.append(TensorMeta(t.name, tuple(t.shape), dtype))
        if d.bucket_bytes < 0:
            bad.append(FieldViolation("distributed.bucket_bytes", "must be >= 0 (0: default)"))
        source = (metas, d.bucket_bytes)
    if bad:
        raise InvalidRequest(bad)
    return request.weight_version, source


def _transfer_config(request: pb.InitWeightTransferRequest) -> TransferConfig:
    bad = []
    if not request.master_address:
        bad.append(FieldViolation("master_address", "required: the trainer's store host"))
    if not 0 < request.master_port < 65536:
        bad.append(FieldViolation("master_port", "required: 1..65535"))
    if request.world_size < 2:
        bad.append(FieldViolation("world_size", "at least 2: the trainer and this server"))
    if request.backend not in ("nccl", "gloo"):
        bad.append(FieldViolation("backend", f"'nccl' or 'gloo', got {request.backend!r}"))
    if request.timeout_s < 0:
        bad.append(FieldViolation("timeout_s", "must be >= 0 (0: 120 s)"))
    if bad:
        raise InvalidRequest(bad)
    return TransferConfig(request.master_address, request.master_port, request.world_size,
                          request.rank_offset, request.backend,  # type: ignore[arg-type]
                          request.group_name or "weight_transfer", request.timeout_s or 120.0)


def _tags(tags: Iterable[str]) -> list[Tag]:
    names = list(tags)
    bad = [FieldViolation(f"tags[{i}]", f"unknown tag {t!r}; one of {', '.join(TAGS)}")
           for i, t in enumerate(names) if t not in TAGS]
    if bad:
        raise InvalidRequest(bad)
    return [t for t in TAGS if t in names] or list(TAGS)
