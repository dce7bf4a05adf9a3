"""``WeightControl``: the served weight version, in-place updates, the trainer's group,
sleep and wake-up, on every rank.

Rank 0 checks a whole source before anything is written (``WeightLayout.check``), then
tells the other ranks (a ``WeightsHeader`` and the operation's arguments as one object on
the control group) and every rank copies its slices into the existing parameters; the
ranks then agree. A copy that failed anywhere leaves a mix of versions: rank 0 raises
``WeightUpdateFailed`` (the service turns UNHEALTHY). All of it runs on the executor's
thread between steps, never during a forward.

Sleep releases memory by tag (``executor/sleep.py``) and the CUDA graphs with it (their
addresses change); waking up takes the memory back, then rank 0 recaptures what was
captured (every rank follows its capture header) and reports the time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from executor.api import SLEEP_TAGS as TAGS
from executor.api import Phase
from executor.api import SleepTag as Tag
from executor.distributed.protocol import WeightsHeader
from executor.errors import (
    FieldViolation,
    InvalidRequest,
    StateConflict,
    TransferUnavailable,
    WeightUpdateFailed,
)
from executor.sleep import SleepingMemory
from executor.weights.transfer import TransferConfig, TransferGroup, receive
from executor.weights.update import (
    TensorMeta,
    TensorReader,
    WeightLayout,
    directory_manifest,
    directory_tensors,
    reference_dtypes,
)

if TYPE_CHECKING:
    from executor.executor import Executor
    from executor.model.spec import ModelSpec

_log = logging.getLogger("executor.weights")


@dataclass(frozen=True)
class UpdateResult:
    weight_version: str
    tensors_updated: int
    bytes_updated: int
    update_ms: float
    check_ms: float


@dataclass(frozen=True)
class SleepResult:
    sleeping: tuple[str, ...]
    freed_bytes: int  # over every rank
    dropped_seq_ids: tuple[str, ...]
    sleep_ms: float


@dataclass(frozen=True)
class WakeResult:
    sleeping: tuple[str, ...]
    restore_ms: float
    recapture_ms: float
    weights_discarded: bool


@dataclass(frozen=True)
class TransferJoined:
    ranks: tuple[int, ...]
    init_ms: float


class WeightControl:
    def __init__(self, executor: Executor, version: str) -> None:
        self._ex = executor
        self.version = version
        self._layout: WeightLayout | None = None
        model: Any = executor.model
        pool = executor.pool
        self.memory = SleepingMemory(model.parameters(), (pool.k_buffer, pool.v_buffer),
                                     executor.device)
        self.group: TransferGroup | None = None
        self._released_phases: tuple[Phase, ...] = ()  # captured before Sleep released them
        self._written = False  # the update under way has written a weight on this rank

    # -- what steps may do ---------------------------------------------------------------
    @property
    def sleeping(self) -> tuple[str, ...]:
        return tuple(t for t in TAGS if t in self.memory.asleep)

    def check_steps(self) -> None:
        """Refuse a step while anything sleeps or discarded weights wait for an update."""
        if self.memory.asleep:
            raise StateConflict(f"the server is asleep ({', '.join(self.sleeping)} released "
                                "by Sleep): call WakeUp first", "SLEEPING")
        if self.memory.discarded:
            raise StateConflict("Sleep discarded the weights: UpdateWeights must refill "
                                "them before a step runs", "WEIGHTS_DISCARDED")

    # -- updates (rank 0) ------------------------------------------------------------------
    def layout(self) -> WeightLayout:
        """The served checkpoint's tensors (built on first use: reads its headers)."""
        if self._layout is None:
            ex = self._ex
            _check_updatable(ex.spec, ex.model_info.quantization, ex.tp.size)
            files = None
            if ex.config.model.load_format == "safetensors":
                from executor.weights.catalog import resolve_model_source
                from executor.weights.loader import _weight_files

                files = _weight_files(resolve_model_source(ex.config.model.source))
            model: Any = ex.model
            self._layout = WeightLayout(model, ex.spec, ex.tp.size,
                                        reference_dtypes(files))
        return self._layout

    def update_from_disk(self, version: str, path: str) -> UpdateResult:
        """Check every tensor of the directory at ``path``, then copy them in."""
        started = time.perf_counter()
        manifest, files = directory_manifest(Path(path))
        self.layout().check(manifest, "path")
        check_ms = (time.perf_counter() - started) * 1e3
        self._announce("update_disk", path)
        count, nbytes = self._apply(lambda: self._copy_files(files))
        return self._updated(version, count, nbytes, started, check_ms)

    def update_from_trainer(self, version: str, metas: Sequence[TensorMeta],
                            bucket_bytes: int) -> UpdateResult:
        """Check the trainer's manifest, tell it the verdict, then receive its buckets."""
        started = time.perf_counter()
        group = self._require_group()
        refusal: InvalidRequest | StateConflict | None = None
        try:
            self.layout().check(metas, "distributed.tensors")
        except (InvalidRequest, StateConflict) as exc:
            refusal = exc
        check_ms = (time.perf_counter() - started) * 1e3
        self._announce("update_trainer", (tuple(metas), bucket_bytes))
        self._verdict(group, refusal is None)
        if refusal is not None:
            raise refusal
        count, nbytes = self._apply(lambda: self._receive(group, metas, bucket_bytes), True)
        return self._updated(version, count, nbytes, started, check_ms)

    def _verdict(self, group: TransferGroup, ok: bool | None = None) -> bool:
        """Every rank: the manifest's verdict, sent by rank 0 (``ok``) to the trainer and
        the other ranks. A group that fails here (the trainer gone before sending) is
        left on every rank: nothing was written, and a new InitWeightTransfer starts over."""
        failure: BaseException | None = None
        accepted = False
        try:
            accepted = group.verdict(group.config.rank_offset, ok)
        except Exception as exc:
            failure = exc
        if self._ex.tp.min_over_ranks(int(failure is None)) != 1:
            self._leave()
            raise TransferUnavailable(
                "the weight-transfer group failed before any weight was sent"
                f"{f' ({failure})' if failure else ' (on another rank)'}; nothing changed: "
                "call InitWeightTransfer again")
        return accepted

    def _updated(self, version: str, count: int, nbytes: int, started: float,
                 check_ms: float) -> UpdateResult:
        self.version = version
        self._recapture_if_awake()
        return UpdateResult(version, count, nbytes, (time.perf_counter() - started) * 1e3,
                            check_ms)

    def _apply(self, copy: Callable[[], tuple[int, int]], distributed: bool = False
               ) -> tuple[int, int]:
        """Every rank: run ``copy`` into the weights (taking their memory back if they
        sleep: they are all overwritten), then agree; raise if any rank failed
        (``distributed``: the copy reads the trainer's group, left if it broke)."""
        if "weights" in self.memory.asleep:
            self.memory.sleep("weights", discard=True)  # drops a backup the update replaces
            self.memory.wake("weights")
        failure: BaseException | None = None
        result = (0, 0)
        self._written = False  # set by the copy before its first byte
        try:
            result = copy()
            if self._ex.device.type == "cuda":
                torch.cuda.synchronize(self._ex.device)
        except Exception as exc:  # I/O, a trainer gone
            failure = exc
            _log.error("weight update failed during the copy: %s", exc)
        tp = self._ex.tp
        if tp.min_over_ranks(int(failure is None)) == 1:
            self.memory.refilled()
            return result
        why = f" ({failure})" if failure else " on another rank"
        if tp.min_over_ranks(int(not self._written)) == 1:  # no rank wrote a byte
            if distributed:  # its order of collectives is broken: it cannot go on
                self._leave()
            raise TransferUnavailable(
                f"the weight update's source failed before any weight was written{why}; "
                "the old weights serve on", "UPDATE_SOURCE_FAILED") from failure
        self.memory.discarded = True  # never serve the mix
        raise WeightUpdateFailed(
            f"the weight update failed while copying{why}; the model holds a mix of two "
            "versions and cannot serve") from failure

    def _copy_files(self, files: Sequence[Path]) -> tuple[int, int]:
        layout, rank = self.layout(), self._ex.tp.rank
        count = nbytes = 0
        for reader, name, where in directory_tensors(files):
            self._written = True
            n = layout.copy_tensor(reader, name, rank, where)
            count, nbytes = count + (layout.resolve(name) is not None), nbytes + n
        return count, nbytes

    def _receive(self, group: TransferGroup, metas: Sequence[TensorMeta],
                 bucket_bytes: int) -> tuple[int, int]:
        layout, rank = self.layout(), self._ex.tp.rank
        totals = [0, 0]

        def keep(tensors: dict[str, torch.Tensor]) -> None:
            self._written = True
            reader = TensorReader(tensors)
            for name in tensors:
                n = layout.copy_tensor(reader, name, rank, "the trainer's broadcast")
                totals[0] += layout.resolve(name) is not None
                totals[1] += n

        receive(group, metas, bucket_bytes, keep)
        return totals[0], totals[1]

    # -- the trainer's group -------------------------------------------------------------
    def init_transfer(self, config: TransferConfig) -> TransferJoined:
        if self.group is not None:
            c = self.group.config
            raise StateConflict(f"a weight-transfer group is already set up (with "
                                f"{c.master_address}:{c.master_port}); call "
                                "DestroyWeightTransfer first", "TRANSFER_GROUP_EXISTS")
        if config.rank_offset + self._ex.tp.size > config.world_size or \
                config.rank_offset < 1:
            last = config.rank_offset + self._ex.tp.size - 1
            raise InvalidRequest([FieldViolation(
                "rank_offset", f"ranks {config.rank_offset}..{last} (one per rank of this "
                f"server) must lie in 1..world_size-1 (world_size {config.world_size}; "
                "rank 0 is the trainer)")])
        self._announce("init_transfer", config)
        return self._join(config)

    def _join(self, config: TransferConfig) -> TransferJoined:
        failure: BaseException | None = None
        try:
            self.group = TransferGroup(config, config.rank_offset + self._ex.tp.rank,
                                       self._ex.device)
        except Exception as exc:  # a store or peer that never came
            failure = exc
        if self._ex.tp.min_over_ranks(int(failure is None)) != 1:
            if self.group is not None:
                self.group.close()
                self.group = None
            raise TransferUnavailable(
                f"could not join the weight-transfer group at {config.master_address}:"
                f"{config.master_port} within {config.timeout_s:g} s"
                f"{f': {failure}' if failure else ' (on another rank)'}; nothing kept")
        assert self.group is not None
        init_ms = self.group.init_ms
        ranks = tuple(config.rank_offset + r for r in range(self._ex.tp.size))
        return TransferJoined(ranks, init_ms)

    def destroy_transfer(self) -> bool:
        if self.group is None:
            return False
        self._announce("destroy_transfer", None)
        self._leave()
        return True

    def _leave(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def _require_group(self) -> TransferGroup:
        if self.group is None:
            raise StateConflict("no weight-transfer group: call InitWeightTransfer first",
                                "NO_TRANSFER_GROUP")
        return self.group

    # -- sleep and wake-up ---------------------------------------------------------------
    def sleep(self, tags: Sequence[Tag], discard: bool, drop: bool) -> SleepResult:
        started = time.perf_counter()
        ex = self._ex
        dropped: tuple[str, ...] = ()
        if discard and "weights" in tags and not self.memory.discarded:
            _check_refillable(ex.spec, ex.model_info.quantization, ex.tp.size)
        if "kv_cache" in tags and "kv_cache" not in self.memory.asleep:
            live = ex.kv.seq_ids()
            if live and not drop:
                shown = ", ".join(repr(s) for s in live[:5])
                raise StateConflict(
                    f"{len(live)} sequence(s) hold the KV cache ({shown}"
                    f"{', ...' if len(live) > 5 else ''}): release them, or set "
                    "drop_sequences to release them with the KV cache", "SEQUENCES_LIVE")
            dropped = tuple(live)
            ex.release(live)
        self._announce("sleep", (tuple(tags), discard))
        freed = self._sleep(tags, discard)
        return SleepResult(self.sleeping, sum(ex.tp.gather_over_ranks(freed)), dropped,
                           (time.perf_counter() - started) * 1e3)

    def _sleep(self, tags: Sequence[Tag], discard: bool) -> int:
        newly = [t for t in tags if t not in self.memory.asleep]
        if newly and self._ex.runners:  # their graphs hold the addresses that go away
            captured = tuple(p for p, r in self._ex.runners.items() if r.captured_sizes())
            self._released_phases = tuple(dict.fromkeys((*self._released_phases, *captured)))
            for runner in self._ex.runners.values():
                runner.release()
        return sum(self.memory.sleep(t, discard) for t in tags)

    def wake(self, tags: Sequence[Tag]) -> WakeResult:
        started = time.perf_counter()
        self._announce("wake", tuple(tags))
        for tag in tags:
            self.memory.wake(tag)
        restore_ms = (time.perf_counter() - started) * 1e3
        recapture_ms = self._recapture_if_awake()
        return WakeResult(self.sleeping, restore_ms, recapture_ms, self.memory.discarded)

    def _recapture_if_awake(self) -> float:
        """Rank 0, once nothing sleeps and the weights hold values: capture again what
        Sleep released (every rank follows the capture header); milliseconds."""
        if self.memory.asleep or self.memory.discarded or not self._released_phases:
            return 0.0
        started = time.perf_counter()
        phases, self._released_phases = self._released_phases, ()
        self._ex.capture(phases, force=True)
        return (time.perf_counter() - started) * 1e3

    # -- the other ranks ------------------------------------------------------------------
    def _announce(self, op: str, args: object) -> None:
        ex = self._ex
        if ex.channel is None or not ex.tp.leads:
            return
        ex.channel.send(WeightsHeader())
        dist.broadcast_object_list([(op, args)], src=0, group=ex.tp.control_group)

    def follow(self) -> None:
        """A rank other than 0: join the weight operation rank 0 announced."""
        ex = self._ex
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=ex.tp.control_group)
        op, args = box[0]
        try:
            if op == "update_disk":  # (a directory this rank cannot read fails the copy)
                self._apply(lambda: self._copy_files(directory_manifest(Path(args))[1]))
            elif op == "update_trainer":
                metas, bucket_bytes = args
                group = self._require_group()
                if self._verdict(group):
                    self._apply(lambda: self._receive(group, metas, bucket_bytes), True)
            elif op == "init_transfer":
                self._join(args)
            elif op == "destroy_transfer":
                self._leave()
            elif op == "sleep":
                ex.tp.gather_over_ranks(self._sleep(*args))  # rank 0 sums them
            elif op == "wake":
                for tag in args:
                    self.memory.wake(tag)
        except (WeightUpdateFailed, TransferUnavailable) as exc:  # rank 0 reports it
            _log.error("weight operation %s failed on this rank: %s", op, exc)


def _not_updatable(spec: ModelSpec, quantization: str, tp_size: int) -> str:
    """What of the served weights the copy into existing parameters does not cover yet
    (FP8 weights, and checkpoints storing q/k/v and gate/up fused (Phi-3) split over
    tensor-parallel ranks), or ""."""
    return (f"FP8 weights ({quantization})" if quantization
            else f"{spec.architecture}'s fused qkv_proj / gate_up_proj under tensor "
            "parallelism" if spec.features.fused_checkpoint and tp_size > 1 else "")


def _check_updatable(spec: ModelSpec, quantization: str, tp_size: int) -> None:
    """Refuse (FAILED_PRECONDITION, nothing applied) an update ``_not_updatable`` names."""
    what = _not_updatable(spec, quantization, tp_size)
    if what:
        raise StateConflict(f"UpdateWeights does not update {what} yet; it serves dense "
                            "unquantized models", "UPDATE_UNSUPPORTED")


def _check_refillable(spec: ModelSpec, quantization: str, tp_size: int) -> None:
    """Refuse Sleep(discard_weights) where no UpdateWeights could refill what it drops: the
    server would never serve again."""
    what = _not_updatable(spec, quantization, tp_size)
    if what:
        raise StateConflict(f"Sleep would discard {what}, which UpdateWeights cannot refill "
                            "yet; sleep without discard_weights (the weights are kept in "
                            "host memory)", "UPDATE_UNSUPPORTED")
