"""``Executor``: the facade over the model, the KV cache, the graphs and sampling.

``boot.py`` builds its parts, in order. Every public call then reads validate ->
allocate -> forward (``forward.py``) -> pend (``steps.py``): it validates completely, then
allocates atomically, then runs; if the forward pass fails after allocation, the
allocation is rolled back, so a call applies to all of its items or to none. Each
sequence's last sampled token has one owner (``last_sampled.py``). The executor is not
thread-safe: one thread drives it.

Under tensor parallelism (``tp``, ``executor/distributed``) every rank builds one. Rank
0 validates, allocates and samples; each step it runs reaches the other ranks first as a
header and its packed batch (``StepChannel``), and they run the same forward
(``follower.py``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from executor.api import (
    BatchNeeds,
    DecodeItem,
    ExecutorStatus,
    ForkResult,
    GraphStatus,
    KVStats,
    Phase,
    PhaseCapture,
    PrefillItem,
    ReleaseResult,
    SamplingParams,
    StepResult,
    TruncateResult,
)
from executor.boot import boot
from executor.config import ExecutorConfig
from executor.distributed.group import TensorParallel
from executor.distributed.protocol import CaptureHeader, ForkHeader, ShutdownHeader
from executor.errors import GraphsUnavailable
from executor.forward_batch import BeforeTransfer, ForwardBatch
from executor.grammar import GrammarBook
from executor.grammar_flow import GrammarFlow, served_tokenizer
from executor.kv import Allocation
from executor.step_plan import DecodeMemo, SamplePlan, decode_columns
from executor.steps import PendingStep
from executor.validation import (
    validate_decode,
    validate_fork,
    validate_prefill,
    validate_truncate,
)
from executor.weights.control import WeightControl


class Executor:
    def __init__(self, config: ExecutorConfig, tp: TensorParallel | None = None) -> None:
        self.config = config
        self.tp = tp or TensorParallel.single()
        parts = boot(config, self.tp)  # the parts, named below for callers and tests
        at, w, cache, att, pools = (parts.at, parts.weights, parts.cache, parts.attention,
                                    parts.pools)
        self.device, self.dtype, self.switches = at.device, at.dtype, at.switches
        self.model, self.spec, self.boot_seconds = w.model, w.spec, w.seconds
        self.pool, self.table, self.kv = cache.pool, cache.table, cache.kv
        self.limits, self.channel = cache.limits, cache.channel
        self.rank_memory_bytes = cache.rank_memory_bytes
        self.attn, self.fuses_decode_rope = att.attn, att.fuses_decode_rope
        self.model_info = att.model_info
        self.sampler, self.staging, self.last = pools.sampler, pools.staging, pools.last
        self.pools = pools.steps  # pinned buffers and events of launched steps
        self.runners, self.forward = parts.graphs.runners, parts.graphs.forward
        self._graph_modes = parts.graphs.modes
        # The last decode launch, for the next one if it continues the same items.
        self._decode_memo: DecodeMemo | None = None
        # The weight version, in-place updates, the trainer's group, sleep and wake-up.
        self.weights = WeightControl(self, config.model.weight_version)
        self._last_needs: tuple[tuple[SamplingParams, ...], BatchNeeds] | None = None
        vocab = self.limits.vocab_size
        self.grammars = GrammarFlow(GrammarBook(served_tokenizer(config.model.source, vocab),
                                                vocab), self.forward.mask_worker)

    # -- steps --------------------------------------------------------------------------
    def prefill(self, items: Sequence[PrefillItem]) -> StepResult:
        """Admit unknown sequences / extend known ones; sample where ``item.sample``."""
        return self._synchronous(self.launch_prefill(items))

    def decode(self, items: Sequence[DecodeItem], num_steps: int = 1) -> StepResult:
        """Append each item's token to its sequence and sample the next one; with
        ``num_steps`` k > 1, k decode steps, each feeding its samples back on the device."""
        return self._synchronous(self.launch_decode(items, num_steps))

    def launch_prefill(self, items: Sequence[PrefillItem]) -> PendingStep:
        """Validate, allocate, run and sample a prefill without waiting for the device
        (see ``executor/steps.py``); ``complete`` gives its result."""
        started = time.perf_counter()
        self.weights.check_steps()
        validate_prefill(items, self.kv.length, self.limits)
        self.grammars.validate(items)
        self.grammars.check_own_masks(items, self.kv.length)
        alloc = self.kv.allocate([(it.seq_id, len(it.token_ids)) for it in items])
        had_last = self.last.had(it.seq_id for it in items)
        try:
            rows = [i for i, it in enumerate(items) if it.sample]
            tokens = [t for it in items for t in it.token_ids]
            every = frozenset(i for i in rows if items[i].every_position)
            plan = SamplePlan.of(items, alloc, rows, every)
            masks = self.grammars.prefill_masks(items, rows,
                                                [e.seq_len for e in alloc.extensions])
            sample, info = self.forward.prefill(tokens, alloc, rows, every, plan, masks)
        except BaseException:
            self.kv.rollback(alloc)
            raise
        self.last.after_prefill(items)
        step = self.pools.pend(PendingStep(
            "prefill", tuple(it.seq_id for it in items), alloc,
            tuple(e.seq_len for e in alloc.extensions), plan.item_rows, tuple(plan.params),
            tuple(frozenset() for _ in plan.params), [] if sample is None else [sample],
            info, started=started, had_last=had_last, position_rows=plan.position_rows,
            weight_version=self.weights.version))
        if masks is not None:
            self.grammars.track(step, 0)
        return step

    def launch_decode(self, items: Sequence[DecodeItem], num_steps: int = 1) -> PendingStep:
        """Validate, allocate ``num_steps`` tokens per sequence up front, then run that
        many decode steps, each reading the previous one's samples on the device (one
        graph replay per step, no host round trip); ``complete`` gives the result. An
        item without a token continues from its sequence's last sampled token."""
        started = time.perf_counter()
        self.weights.check_steps()
        memo = self._decode_memo
        if memo is not None and not memo.repeats(items, num_steps, self.kv.version,
                                                 self.limits.servable_context):
            memo = None
        if memo is not None:
            # The step before, continued: nothing else touched the cache since it (the
            # version), so its validation still holds, with each sequence longer by its
            # own tokens and every one of them holding a last sample.
            assert memo.columns is not None  # (``repeats`` says so)
            columns = memo.columns
        else:
            validate_decode(items, self.kv.length, self.limits, num_steps, self.last.has)
            columns = decode_columns(items, self.last.has)
        seq_ids, tokens, sampling, stops, had_last = columns
        needs = self._needs(sampling)
        if memo is None and needs.grammar:
            self.grammars.validate(items)  # compiles them (cached)
        if needs.grammar and needs.controls:  # (every launch: it depends on the matchers)
            self.grammars.check_own_masks(items, self.kv.length)
        self._decode_memo = None
        done: dict[int, int] = {}
        dead_ends: dict[int, int] = {}
        masks = self.grammars.decode_masks(seq_ids, tokens, sampling, self.kv.length, done,
                                           dead_ends, needs)
        alloc = self.kv.extend(seq_ids, num_steps)
        try:
            samples, seq_lens, info = self.forward.decode(alloc, tokens, list(sampling),
                                                          num_steps, masks, needs)
        except BaseException:
            self.kv.rollback(alloc)
            raise
        self.last.after_decode(seq_ids)
        if memo is not None:  # a repeat keeps its items and columns: only these move
            memo.kv_version, memo.max_len = self.kv.version, max(seq_lens)
        else:
            memo = DecodeMemo.after(items, num_steps, self.kv.version, max(seq_lens), columns)
        self._decode_memo = memo
        step = self.pools.pend(PendingStep(
            "decode", seq_ids, alloc, seq_lens, tuple(range(len(seq_ids))), sampling, stops,
            samples, info, started=started, had_last=had_last,
            weight_version=self.weights.version, needs=needs))
        if masks is not None:
            step.grammar_done, step.grammar_dead_ends = done, dead_ends
            self.grammars.track(step, num_steps - 1)
        return step

    def _needs(self, sampling: tuple[SamplingParams, ...]) -> BatchNeeds:
        """``BatchNeeds`` of a decode's parameters, kept for the next launch with the same
        columns (a pipelined scheduler's repeats pass the same tuple)."""
        last = self._last_needs
        if last is None or last[0] is not sampling:
            last = self._last_needs = (sampling, BatchNeeds.of(sampling))
        return last[1]

    def complete(self, step: PendingStep) -> StepResult:
        """Wait for a launched step's device work and build its result."""
        return step.finish()

    def abort(self, step: PendingStep) -> None:
        """Roll back a launched, not completed step: its KV allocation and lengths, as if
        it never ran. Steps launched after it must be aborted first (newest first). Its
        sequences' last sampled tokens are gone (overwritten on the device): until they
        sample again, their next decode must give its token."""
        if step.finished:
            raise ValueError("a completed step cannot be aborted")
        if step.done is not None:
            step.done.synchronize()  # its device work must not outlive its allocation
        step.recycled()
        self.grammars.forget(step)
        self.kv.rollback(step.alloc)
        step.finished = True
        sampled = {sid for sid, row in zip(step.seq_ids, step.rows, strict=True)
                   if row is not None}
        self.last.restore(step.had_last, sampled, self.kv.__contains__)

    def _synchronous(self, step: PendingStep) -> StepResult:
        try:
            return self.complete(step)
        except BaseException:
            if not step.finished:
                self.abort(step)
            raise

    # -- sequences ----------------------------------------------------------------------
    def release(self, seq_ids: Sequence[str]) -> ReleaseResult:
        """Free everything the sequences hold; unknown ids are reported, not an error."""
        released, freed, unknown = 0, 0, []
        for sid in dict.fromkeys(seq_ids):  # de-duplicated, order kept
            n = self.kv.release(sid)
            if n is None:
                unknown.append(sid)
            else:
                released += 1
                freed += n
                self.last.forget(sid)
                self.grammars.release(sid)
        return ReleaseResult(released, tuple(unknown), freed)

    def fork(self, parent_id: str, child_id: str, prefix_len: int | None = None) -> ForkResult:
        """Admit ``child_id`` sharing the first ``prefix_len`` tokens (default: all) of
        ``parent_id``'s KV: nothing is copied, the locations are reference-counted, and
        what either sequence appends afterwards goes to fresh locations of its own. Prefill
        and Decode continue the child from ``prefix_len``; a child that shares all of a
        parent whose last step sampled also inherits that token, so its first decode may
        use it (``token_id=None``). Atomic: unknown parent (NOT_FOUND), a child id in use
        or ``prefix_len`` outside ``[0, parent length]`` (INVALID_ARGUMENT), no free slot
        (RESOURCE_EXHAUSTED) change nothing."""
        length = validate_fork(parent_id, child_id, prefix_len, self.kv.length)
        parent = self.kv.get(parent_id)
        assert parent is not None  # (validated)
        child = self.kv.fork(parent_id, child_id, length)
        inherits = length == parent.length and \
            self.last.inherit(parent_id, parent.slot, child_id, child.slot)
        self.grammars.settle()  # the parent's matcher has every sampled token
        self.grammars.book.fork(parent_id, child_id, length, inherits)
        if self.channel is not None:  # the other ranks' tables and last tokens too
            self.channel.send(ForkHeader(parent.slot, child.slot, length, inherits))
        return ForkResult(length, length, inherits)

    def truncate(self, seq_id: str, length: int) -> TruncateResult:
        """Keep the first ``length`` tokens of ``seq_id`` and free the KV past them (roll back
        a rejected draft, or rewind a conversation); Prefill and Decode then continue from
        ``length``. A shorter sequence has no last sampled token to continue from: its next
        decode gives its token. Atomic: an unknown sequence (NOT_FOUND) or a length outside
        ``[0, current length]`` (INVALID_ARGUMENT) changes nothing."""
        validate_truncate(seq_id, length, self.kv.length)
        freed = self.kv.truncate(seq_id, length)
        if freed:
            self.last.forget(seq_id)
        self.grammars.settle()
        self.grammars.book.truncate(seq_id, length)
        return TruncateResult(length, freed)

    # -- graphs, status, tests' access ----------------------------------------------------
    def capture(self, phases: Sequence[Phase] = ("decode", "prefill"), force: bool = False,
                progress: bool = False) -> tuple[PhaseCapture, ...]:
        """Capture CUDA graphs for ``phases`` (recapture with ``force``)."""
        if self.device.type != "cuda":
            raise GraphsUnavailable(
                f"CUDA graphs need a CUDA device; this executor runs on {self.device.type}")
        disabled = [p for p in phases if self._graph_modes[p] == "disabled"]
        if disabled:
            raise GraphsUnavailable(
                f"graph mode is 'disabled' for {', '.join(disabled)}; start the server with a "
                "graph mode for that phase to capture it")
        missing = [p for p in phases if p not in self.runners]
        if missing:
            raise GraphsUnavailable(f"no graph runner for {', '.join(missing)} in this build")
        # Steps launched ahead (a Session) may still be replaying graphs that a forced
        # recapture releases: let them finish first.
        torch.cuda.synchronize(self.device)
        if self.channel is not None and self.tp.leads:  # every rank captures the same
            self.channel.send(CaptureHeader(tuple(dict.fromkeys(phases)), force))
        with self.switches:  # graphs keep the launches they were captured with
            return tuple(self.runners[p].capture_all(force=force, progress=progress)
                         for p in dict.fromkeys(phases))

    def drain_replay_seconds(self) -> dict[Phase, list[float]]:
        """Durations of graph replays finished since the last call (CUDA events that have
        completed; reading them adds no host sync)."""
        return {phase: r.drain_replay_seconds() for phase, r in self.runners.items()}

    def kv_stats(self) -> KVStats:
        return self.kv.stats()

    def startup_phases(self) -> tuple[Phase, ...]:
        """Phases to capture at start-up: those with a graph mode and a runner."""
        return tuple(self.runners)

    def status(self) -> ExecutorStatus:
        graphs = tuple(
            GraphStatus(phase, mode, self.runners[phase].captured_sizes()
                        if phase in self.runners else ())
            for phase, mode in self._graph_modes.items())
        info = dataclasses.replace(self.model_info, weight_version=self.weights.version,
                                   sleeping=self.weights.sleeping,
                                   weights_discarded=self.weights.memory.discarded)
        return ExecutorStatus(info, self.kv.stats(), graphs)

    def close(self) -> None:
        """Stop the grammar mask worker; rank 0: tell the other ranks to leave their
        loop (nothing else to free)."""
        self.forward.mask_worker.close()
        if self.channel is not None and self.tp.leads:
            try:
                self.channel.send(ShutdownHeader())
            finally:
                self.channel.close()

    def build_batch(self, phase: Phase, token_ids: list[int], alloc: Allocation,
                    logits_rows: list[int], bucket: int | None = None,
                    every_position: frozenset[int] = frozenset(),
                    before_transfer: BeforeTransfer | None = None) -> ForwardBatch:
        """``Forward.build_batch`` (for tests and benchmarks)."""
        return self.forward.build_batch(phase, token_ids, alloc, logits_rows, bucket,
                                        every_position, before_transfer)

    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """``Forward.forward_logits``: eager logits, unsampled (for tests and benchmarks)."""
        return self.forward.forward_logits(batch)
