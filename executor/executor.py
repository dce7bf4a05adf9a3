"""``Executor``: owns the model, the KV pools, the sequence table and the graph runners.

Start-up reads top to bottom as a boot sequence:

    1. resolve device and dtype
    2. read the config, settle the attention backend (before anything big is allocated),
       load weights                     (HF directory -> our modules)
    3. size and allocate the KV cache   (pools + request-slot table)
    4. attention backend and sampler
    5. graph runners                    (capture happens on ``capture``)

Under tensor parallelism (``tp``, ``executor/distributed``) every rank builds one: each
loads its weight shard and allocates its KV shard (its KV heads). Rank 0 validates,
allocates and samples; each step it runs reaches the other ranks first as a header and
its packed batch (``StepChannel``), and they run the same forward (``follow``).

Every public call validates completely, then allocates atomically, then runs; if the
forward pass fails after allocation, the allocation is rolled back, so a call applies to
all of its items or to none. The executor is not thread-safe: one thread drives it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from executor.api import (
    DecodeItem,
    ExecutorStatus,
    ForkResult,
    GraphStatus,
    KVStats,
    ModelInfo,
    Path,
    Phase,
    PhaseCapture,
    PrefillItem,
    RankTiming,
    ReleaseResult,
    SamplingParams,
    StepInfo,
    StepResult,
    TruncateResult,
)
from executor.attention import create_backend, resolve_backend_name
from executor.attention.base import AttentionShape
from executor.config import ExecutorConfig
from executor.distributed import group
from executor.distributed.channel import StepChannel
from executor.distributed.group import TensorParallel
from executor.distributed.protocol import (
    CaptureHeader,
    ForkHeader,
    Mode,
    ShutdownHeader,
    StepHeader,
)
from executor.errors import (
    ConfigError,
    FieldViolation,
    GraphsUnavailable,
    InvalidRequest,
    SequenceNotFound,
)
from executor.forward_batch import BeforeTransfer, ForwardBatch, PinnedStaging
from executor.graphs.buckets import (
    default_decode_buckets,
    default_prefill_buckets,
    normalize_buckets,
)
from executor.graphs.dispatch import Decision, GraphKey, RunnerState, decide
from executor.graphs.graph_runner import GraphRunner
from executor.graphs.registry import make_capture_backend, resolve_graph_mode
from executor.kernels.switches import KernelSwitches
from executor.kv import Allocation, KVCacheManager, KVPool, ReqToTokenTable
from executor.kv.manager import Columns
from executor.packing import USE_LAST_SAMPLED, PackedSizes
from executor.sampling import DeviceSample, PinnedPool, Sampler, device_tensor
from executor.steps import PendingStep
from executor.validation import Limits, validate_decode, validate_prefill
from executor.weights.catalog import model_name, resolve_model_source
from executor.weights.loader import load_hf_config, load_model
from executor.weights.sharding import local_spec

#: Spare step events kept for reuse (more than the deepest pipeline needs).
_EVENTS_KEPT = 16
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_TOKENS = 32768


class Executor:
    def __init__(self, config: ExecutorConfig, tp: TensorParallel | None = None) -> None:
        self.config = config
        self.tp = tp or TensorParallel.single()
        # -- 1. device and dtype -------------------------------------------------------
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {config.device!r} requested but CUDA is not available")
        dtype_name = config.model.dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        self.dtype = _DTYPES[dtype_name]
        # Process-wide kernel launch choices (PDL, the row kernel), held active around
        # each forward and capture so executors sharing a process launch as configured.
        self.switches = KernelSwitches.resolve(config.pdl, config.skinny_row_kernel,
                                               self.device)

        # -- 2. weights ----------------------------------------------------------------
        source = config.model.source
        model_dir = resolve_model_source(source)  # tiny, a named model, or a directory
        spec = local_spec(load_hf_config(model_dir), self.tp.size)  # this rank's heads
        max_context = config.cache.max_context or spec.max_position
        # Settled before the weights load: a backend that cannot serve here fails fast.
        shape = AttentionShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.attn_scale)
        started = time.perf_counter()
        backend_name = resolve_backend_name(config.attention_backend, self.device, self.dtype,
                                            shape)
        #: Seconds per boot step (FlashInfer's probe JIT-compiles its kernels in "attention").
        self.boot_seconds = {"attention": time.perf_counter() - started}
        started = time.perf_counter()
        self.model, self.spec = load_model(model_dir, self.dtype, self.device, max_context,
                                           spec, self.tp, config.model.load_format,
                                           config.model.seed)
        self.model_info = ModelInfo(
            name=model_name(source, model_dir),
            architecture=spec.architecture,
            dtype=dtype_name,
            device=str(self.device),
            vocab_size=spec.vocab_size,
            max_context=max_context,
            attention_backend=backend_name,
            load_format=config.model.load_format,
        )
        self.boot_seconds["weights"] = time.perf_counter() - started

        # -- 3. KV cache ---------------------------------------------------------------
        # Every rank holds the same locations (of its own KV heads): the fewest any fits.
        self.tp.settle()  # ranks load their slices at different speeds
        num_tokens = self.tp.min_over_ranks(self._kv_tokens(max_context))
        self.pool = KVPool(spec.num_layers, num_tokens, spec.num_kv_heads, spec.head_dim,
                           self.dtype, self.device)
        self.table = ReqToTokenTable(config.cache.max_sequences, max_context, self.device)
        self.kv = KVCacheManager(self.table, num_tokens)
        #: Bytes of weights and KV cache each rank holds, in rank order.
        weights = self.model.parameters() if isinstance(self.model, torch.nn.Module) else ()
        self.rank_memory_bytes = self.tp.gather_over_ranks(
            sum(p.numel() * p.element_size() for p in weights) + self.pool.nbytes)
        self.channel = StepChannel(self.tp, self.device) if self.tp.distributed else None
        self.model_info = dataclasses.replace(self.model_info,
                                              tensor_parallel_size=self.tp.size,
                                              rank_memory_bytes=self.rank_memory_bytes)

        # -- 4. attention and sampling -------------------------------------------------
        self.attn = create_backend(backend_name, shape, self.pool, self.table)
        rotary = getattr(self.model, "rotary", None)
        can_fuse = (self.attn.can_fuse_decode_rope and rotary is not None
                    and not spec.features.qk_norm)
        if config.fuse_decode_rope == "on" and not can_fuse:
            raise ConfigError(
                f"--fuse-decode-rope on needs the triton attention backend (this one is "
                f"{backend_name!r}) and a model with RoPE and no per-head q/k norm")
        #: Whether the decode attention kernel applies RoPE (the model then does not).
        self.fuses_decode_rope = can_fuse and config.fuse_decode_rope != "off"
        if self.fuses_decode_rope:
            self.attn.fuse_decode_rope(rotary.cos, rotary.sin)  # type: ignore[union-attr]
        features = ("fused_decode_rope",) * self.fuses_decode_rope + \
            self.switches.features + group.projection_features(self.tp)
        self.model_info = dataclasses.replace(
            self.model_info, kernel_features=features,
            tp_all_reduce=group.all_reduce_algorithm(self.tp) if self.tp.distributed else "")
        self.sampler = Sampler()
        # Each sequence's last sampled token, by request slot, written by sampling on the
        # device; a decode item without a token reads it there (``USE_LAST_SAMPLED``).
        self.last_tokens = torch.zeros(config.cache.max_sequences, dtype=torch.int64,
                                       device=self.device)
        self._last_sampled: set[str] = set()  # sequences whose last step sampled
        # The last decode launch, for the next one if it continues the same items.
        self._decode_memo: _DecodeMemo | None = None
        # Every batch's metadata goes to the device through one reused pinned buffer.
        self.staging = PinnedStaging(self.device) if self.device.type == "cuda" else None
        # NOTE: every step runs on the device's current stream at start-up; events record
        # on it without looking it up per step (that lookup costs more than the record).
        self._stream = torch.cuda.current_stream(self.device) \
            if self.device.type == "cuda" else None
        # Launched steps' samples are copied into pooled pinned buffers and their ends
        # marked by pooled events, handed back when each step is done (``_recycle``).
        self._pinned = PinnedPool()
        self._events: deque[torch.cuda.Event] = deque()
        self.limits = Limits(spec.vocab_size, max_context, config.max_prefill_tokens,
                             config.decode_batch_limit, kv_tokens=num_tokens)

        # -- 5. graph runners (captured by ``capture``, at start-up by the service) ------
        self._graph_modes: dict[Phase, str] = {"decode": config.graphs.decode_mode,
                                               "prefill": config.graphs.prefill_mode}
        for phase, mode in self._graph_modes.items():  # a name the phase has (any device)
            resolve_graph_mode(phase, mode, cuda=True)
        self.runners: dict[Phase, GraphRunner] = {}
        for phase in ("decode", "prefill"):
            runner = self._make_runner(phase)
            if runner is not None:
                self.runners[phase] = runner

    # ------------------------------------------------------------------------------------
    # Boot helpers
    # ------------------------------------------------------------------------------------
    def _kv_tokens(self, max_context: int) -> int:
        cache = self.config.cache
        if cache.kv_tokens is not None:
            return cache.kv_tokens
        if self.device.type != "cuda":
            return min(cache.max_sequences * max_context, CPU_DEFAULT_KV_TOKENS)
        free, _total = torch.cuda.mem_get_info(self.device)
        per_token = KVPool.bytes_per_token(self.spec.num_layers, self.spec.num_kv_heads,
                                           self.spec.head_dim, self.dtype)
        tokens = int(free * cache.kv_memory_fraction) // per_token
        if tokens <= 0:
            raise ConfigError(f"no device memory left for the KV cache ({free} bytes free)")
        return tokens

    def _make_runner(self, phase: Phase) -> GraphRunner | None:
        mode = self._graph_modes[phase]
        if mode == "disabled" or self.device.type != "cuda":
            return None
        backend = make_capture_backend(mode, self.device, self.config.graphs, self._model_key())
        if backend.attention_in_graph and phase not in self.attn.capturable:
            raise ConfigError(
                f"{phase} graph mode {mode!r} captures attention, and attention backend "
                f"{self.attn.name!r} cannot be captured for {phase}; use --attention-backend "
                f"triton, another graph mode, or disable {phase} graphs")
        graphs = self.config.graphs
        if phase == "decode":
            buckets = graphs.decode_buckets or default_decode_buckets(
                self.config.decode_batch_limit)
        else:
            buckets = graphs.prefill_buckets or default_prefill_buckets(
                self.config.max_prefill_tokens)
        runner = GraphRunner(phase, self.model, self.attn, backend,
                             normalize_buckets(buckets), self.limits.max_context, self.table,
                             self.device, self.last_tokens)
        if self.channel is not None:  # a bucket failing on any rank fails on all
            runner.agree = self.channel.agree
        return runner

    def _model_key(self) -> str:
        """What a compiled forward depends on besides our code: layout, dtype, context
        (the RoPE table is a graph input) and the kernel choice."""
        raw = f"{self.spec!r}|{self.dtype}|{self.limits.max_context}|{self.model.kernels}"
        if self.tp.distributed:  # the collectives are part of the compiled graph
            raw += f"|tp{self.tp.rank}/{self.tp.size}"
        return hashlib.sha256(raw.encode()).hexdigest()[:16]

    # ------------------------------------------------------------------------------------
    # Public API
    # ------------------------------------------------------------------------------------
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
        validate_prefill(items, self.kv.length, self.limits)
        alloc = self.kv.allocate([(it.seq_id, len(it.token_ids)) for it in items])
        had_last = {it.seq_id: it.seq_id in self._last_sampled for it in items}
        try:
            rows = [i for i, it in enumerate(items) if it.sample]
            tokens = [t for it in items for t in it.token_ids]
            decision = self._decide("prefill", len(tokens))
            every = frozenset(i for i in rows if items[i].every_position)
            plan = _SamplePlan.of(items, alloc, rows, every)
            batch = self.build_batch("prefill", tokens, alloc, rows, decision.bucket, every,
                                     self._announcer("prefill", decision, plan.params,
                                                     plan.targets))
            sample, info = self._step(batch, decision, plan.params, plan.positions,
                                      plan.targets)
            if sample is not None:
                self._remember_last(sample, device_tensor(
                    [alloc.extensions[i].slot for i in rows], torch.int64, self.device),
                    None if not every else device_tensor(plan.last_rows, torch.int64,
                                                         self.device))
        except BaseException:
            self.kv.rollback(alloc)
            raise
        for it in items:
            (self._last_sampled.add if it.sample else self._last_sampled.discard)(it.seq_id)
        return self._pending(PendingStep(
            "prefill", tuple(it.seq_id for it in items), alloc,
            tuple(e.seq_len for e in alloc.extensions), plan.item_rows, tuple(plan.params),
            tuple(frozenset() for _ in plan.params), [] if sample is None else [sample],
            info, started=started, had_last=had_last, position_rows=plan.position_rows))

    def launch_decode(self, items: Sequence[DecodeItem], num_steps: int = 1) -> PendingStep:
        """Validate, allocate ``num_steps`` tokens per sequence up front, then run that
        many decode steps, each reading the previous one's samples on the device (one
        graph replay per step, no host round trip); ``complete`` gives the result. An
        item without a token continues from its sequence's last sampled token."""
        started = time.perf_counter()
        last = self._last_sampled
        memo = self._decode_memo
        if memo is not None and not memo.repeats(items, num_steps, self.kv.version,
                                                 self.limits.servable_context):
            memo = None
        if memo is not None:
            # The step before, continued: nothing else touched the cache since it (the
            # version), so its validation still holds, with each sequence longer by its
            # own tokens and every one of them holding a last sample.
            assert memo.columns is not None  # (``repeats`` says so)
            seq_ids, tokens, sampling, stops, had_last = memo.columns
        else:
            validate_decode(items, self.kv.length, self.limits, num_steps, last.__contains__)
            # Per-item work is most of a large batch's host time: the items' columns come
            # from one transposition, and each list is made once, in C where it can be.
            seq_ids, tokens, sampling, stop_ids = zip(*items, strict=True)
            stops = tuple(frozenset(stop) if stop else _NO_STOPS for stop in stop_ids) \
                if any(stop_ids) else (_NO_STOPS,) * len(items)
            had_last = dict(zip(seq_ids, map(last.__contains__, seq_ids), strict=True))
        self._decode_memo = None
        alloc = self.kv.extend(seq_ids, num_steps)
        params = list(sampling)
        n = len(items)
        rows = list(range(n))
        samples: list[DeviceSample] = []
        ranks: RankTiming | None = None  # the worst over the steps
        try:
            decision = self._decide("decode", len(items))
            first = [USE_LAST_SAMPLED] * n if tokens.count(None) == n else \
                [USE_LAST_SAMPLED if t is None else t for t in tokens]
            announce = self._announcer("decode", decision, params, None)
            for step in range(num_steps):
                sub = alloc if num_steps == 1 else _decode_step(alloc, num_steps, step)
                batch = self.build_batch("decode", first if step == 0 else
                                         [USE_LAST_SAMPLED] * n, sub, rows, decision.bucket,
                                         before_transfer=announce)
                # each sequence's length after this step: the index of its new token + 1
                sample, info = self._step(batch, decision, params, batch.seq_lens_host,
                                          remember=batch.req_pool_indices)
                assert sample is not None
                self._remember_last(sample, batch.req_pool_indices, stored=True)
                samples.append(sample)
                if info.ranks is not None:
                    ranks = info.ranks if ranks is None else ranks.worst(info.ranks)
        except BaseException:
            self.kv.rollback(alloc)
            raise
        last.update(seq_ids)
        if memo is not None:  # a repeat keeps its items and columns: only these move
            memo.kv_version, memo.max_len = self.kv.version, max(batch.seq_lens_host)
        else:
            memo = _DecodeMemo(
                tuple(items), num_steps, self.kv.version, max(batch.seq_lens_host),
                (seq_ids, (None,) * n, sampling, stops, dict.fromkeys(seq_ids, True))
                if tokens.count(None) == n else None)
        self._decode_memo = memo
        if num_steps != 1:
            info = dataclasses.replace(info, num_tokens=info.num_tokens * num_steps,
                                       padded_tokens=info.padded_tokens * num_steps,
                                       num_steps=num_steps,
                                       ranks=ranks)
        return self._pending(PendingStep(
            "decode", seq_ids, alloc, batch.seq_lens_host, tuple(rows), sampling, stops,
            samples, info, started=started, had_last=had_last))

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
        self.kv.rollback(step.alloc)
        step.finished = True
        sampled = {sid for sid, row in zip(step.seq_ids, step.rows, strict=True)
                   if row is not None}
        for seq_id, had in step.had_last.items():
            if had and seq_id not in sampled and self.kv.get(seq_id) is not None:
                self._last_sampled.add(seq_id)
            else:
                self._last_sampled.discard(seq_id)

    def _synchronous(self, step: PendingStep) -> StepResult:
        try:
            return self.complete(step)
        except BaseException:
            if not step.finished:
                self.abort(step)
            raise

    def _pending(self, step: PendingStep) -> PendingStep:
        """Start the copies of the step's samples to the host; mark its end on the device.
        The pinned buffers and the event come from pools the step gives them back to
        when it is done (``_recycle``): none is allocated per step."""
        if self._stream is None:
            return step
        for sample in step.samples:
            sample.stage(self._pinned)
        step.done = self._events.pop() if self._events else torch.cuda.Event()
        step.done.record(self._stream)
        step.recycle = self._recycle
        return step

    def _recycle(self, step: PendingStep) -> None:
        """A finished or aborted step's buffers and event, back to their pools (any
        thread: deque appends are atomic)."""
        for sample in step.samples:
            sample.release()
        if step.done is not None and len(self._events) < _EVENTS_KEPT:
            self._events.append(step.done)

    def _remember_last(self, sample: DeviceSample, slots: torch.Tensor,
                       rows: torch.Tensor | None = None, stored: bool = False) -> None:
        """Each sampled row's token (of ``rows``, where a sequence sampled several) becomes
        the last sampled token of the sequence in ``slots`` (device tensors, one slot per
        row); ``stored``: the sampler wrote them already (``_step``'s ``remember``), only
        the other ranks are told."""
        tokens = sample.tokens if rows is None else sample.tokens.index_select(0, rows)
        if not stored:
            self.last_tokens.index_copy_(0, slots, tokens)
        if self.channel is not None:  # the other ranks' decode prologues read it too
            self.channel.send_sampled(slots, tokens)

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
                self._last_sampled.discard(sid)
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
        parent = self.kv.get(parent_id)
        if parent is None:
            raise SequenceNotFound([parent_id], ["parent_seq_id"])
        violations = []
        if child_id in self.kv:
            violations.append(FieldViolation(
                "child_seq_id", f"sequence {child_id!r} already exists; a fork needs a new "
                "id (release it first to reuse the id)"))
        length = parent.length if prefix_len is None else prefix_len
        if not 0 <= length <= parent.length:
            violations.append(FieldViolation(
                "prefix_len", f"must be in [0, {parent.length}] (sequence {parent_id!r} "
                f"holds {parent.length} tokens), got {length}"))
        if violations:
            raise InvalidRequest(violations)
        child = self.kv.fork(parent_id, child_id, length)
        inherits = length == parent.length and parent_id in self._last_sampled
        if inherits:
            self.last_tokens[child.slot] = self.last_tokens[parent.slot]  # on the device
            self._last_sampled.add(child_id)
        if self.channel is not None:  # the other ranks' tables and last tokens too
            self.channel.send(ForkHeader(parent.slot, child.slot, length, inherits))
        return ForkResult(length, length, inherits)

    def truncate(self, seq_id: str, length: int) -> TruncateResult:
        """Keep the first ``length`` tokens of ``seq_id`` and free the KV past them (roll back
        a rejected draft, or rewind a conversation); Prefill and Decode then continue from
        ``length``. A shorter sequence has no last sampled token to continue from: its next
        decode gives its token. Atomic: an unknown sequence (NOT_FOUND) or a length outside
        ``[0, current length]`` (INVALID_ARGUMENT) changes nothing."""
        state = self.kv.get(seq_id)
        if state is None:
            raise SequenceNotFound([seq_id], ["seq_id"])
        if not 0 <= length <= state.length:
            raise InvalidRequest([FieldViolation(
                "length", f"must be in [0, {state.length}] (sequence {seq_id!r} holds "
                f"{state.length} tokens), got {length}")])
        freed = self.kv.truncate(seq_id, length)
        if freed:
            self._last_sampled.discard(seq_id)
        return TruncateResult(length, freed)

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

    def build_batch(self, phase: Phase, token_ids: list[int], alloc: Allocation,
                    logits_rows: list[int], bucket: int | None = None,
                    every_position: frozenset[int] = frozenset(),
                    before_transfer: BeforeTransfer | None = None) -> ForwardBatch:
        """Pack a batch for ``alloc`` and publish its new KV locations to the device
        request-slot table (part of the same transfer). ``logits_rows`` index the
        sequences whose last new token needs logits. With the captured ``bucket`` it will
        replay, the batch is packed for that bucket's graphs, and the replay publishes
        its locations (``GraphRunner.layout``). ``before_transfer``: see
        ``ForwardBatch.build`` (``_announcer``'s)."""
        runner = self.runners.get(phase) if bucket is not None else None
        layout = runner.layout(bucket) if runner is not None and bucket is not None else None
        batch = ForwardBatch.build(phase, token_ids, alloc, logits_rows, self.device,
                                   self.table.max_context, self.staging, layout,
                                   every_position, before_transfer)
        if layout is None:
            self.table.write_device(batch.table_index, batch.out_cache_loc)
        return batch

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
        return ExecutorStatus(self.model_info, self.kv.stats(), graphs)

    # ------------------------------------------------------------------------------------
    # Internals
    # ------------------------------------------------------------------------------------
    def _decide(self, phase: Phase, size: int) -> Decision:
        """Graph bucket or eager, for a step of ``size`` rows (decode) or tokens."""
        runner = self.runners.get(phase)
        if runner is not None:
            state = runner.state()
        else:
            state = RunnerState(cuda=self.device.type == "cuda",
                                enabled=self._graph_modes[phase] != "disabled",
                                buckets=(), captured=frozenset(), failed=frozenset())
        return decide(GraphKey(phase, size), state)

    @torch.inference_mode()
    def _step(self, batch: ForwardBatch, decision: Decision, params: list[SamplingParams],
              positions: Sequence[int], targets: list[int] | None = None,
              remember: torch.Tensor | None = None) -> tuple[DeviceSample | None, StepInfo]:
        """Run the forward (graph, compiled pieces or eager) and sample on the device;
        with ``remember`` (a slot per sampled row), the samples also become those slots'
        last sampled tokens (``Sampler.sample``)."""
        start = time.perf_counter()
        padded = 0 if decision.bucket is None else decision.bucket - (
            batch.batch_size if batch.phase == "decode" else batch.num_tokens)
        mode = self._mode(batch.phase, decision, params)
        # (the other ranks got the step from ``_announcer`` while it was packed)
        logits = self._forward(batch, mode, decision.bucket)
        ranks = None
        if self.channel is not None:  # every rank launched the step (after our own launch)
            ranks = self.channel.confirm(time.monotonic_ns())
        sample = self.sampler.sample(
            logits, params, positions, targets,
            None if remember is None else (self.last_tokens, remember)) \
            if logits is not None and params else None
        elapsed_ms = (time.perf_counter() - start) * 1e3
        reason = decision.reason.value if decision.reason is not None else ""
        path: Path = "graph" if decision.use_graph else "eager"
        return sample, StepInfo(batch.phase, path, reason, batch.num_tokens, padded, elapsed_ms,
                                ranks=ranks)

    def _mode(self, phase: Phase, decision: Decision, params: list[SamplingParams]) -> Mode:
        """How a step's forward runs (every rank runs it the same way)."""
        if decision.bucket is not None:
            return Mode.GRAPH
        runner = self.runners.get(phase)
        if runner is not None and runner.runs_uncaptured:
            return Mode.UNCAPTURED
        return Mode.LOGITS if params else Mode.KV_ONLY

    def _announcer(self, phase: Phase, decision: Decision, params: list[SamplingParams],
                   targets: list[int] | None) -> BeforeTransfer | None:
        """Rank 0 of a tensor-parallel group: sends a step to the other ranks as soon as it
        is packed, before its own device copy, so that they start unpacking it while this
        rank copies and launches (their forwards' first all-reduce waits for the last
        rank to arrive). None without other ranks."""
        channel = self.channel
        if channel is None:
            return None
        mode = self._mode(phase, decision, params)
        # Sequences sampled for: one row each, except an every_position item's many rows,
        # of which only the last (the one target -1) keeps its token.
        sampled = 0 if mode is Mode.KV_ONLY or not params else \
            len(params) if targets is None else targets.count(-1)

        def send(packed: torch.Tensor, sizes: PackedSizes) -> None:
            channel.send(StepHeader(phase, mode, decision.bucket, sizes, sampled), packed)

        return send

    def _forward(self, batch: ForwardBatch, mode: Mode, bucket: int | None
                 ) -> torch.Tensor | None:
        """The forward as ``mode`` says; logits of the sampled rows in the activation
        dtype (the sampler widens what it computes in float32), or None."""
        with self.switches:
            if mode is Mode.GRAPH:
                assert bucket is not None
                # Graph logits are valid until the next replay: sampled right after.
                return self.runners[batch.phase].replay(batch, bucket)
            if mode is Mode.UNCAPTURED:
                # Compiled pieces without graphs: still faster than the plain eager model.
                return self.runners[batch.phase].run_uncaptured(batch)
            if mode is Mode.LOGITS:
                return self.forward_logits(batch)
            self._forward_only(batch)  # fills the KV cache; no logits wanted
            return None

    @torch.inference_mode()
    def follow(self, header: StepHeader, packed: torch.Tensor) -> None:
        """Run the step rank 0 sent (a rank other than 0): the same batch at the same KV
        locations, the same forward; then take rank 0's sampled tokens."""
        runner = self.runners.get(header.phase) if header.bucket is not None else None
        layout = runner.layout(header.bucket) if runner is not None and \
            header.bucket is not None else None
        batch = ForwardBatch.from_packed(header.phase, packed, header.sizes, self.device,
                                         self.staging, layout)
        if layout is None:
            self.table.write_device(batch.table_index, batch.out_cache_loc)
        self._forward(batch, header.mode, header.bucket)
        if self.channel is not None:
            self.channel.launched()  # rank 0's confirmation, with our launch time
        if header.sampled and self.channel is not None:
            sampled = self.channel.receive_sampled(header.sampled)  # (2, sequences)
            self.last_tokens.index_copy_(0, sampled[0], sampled[1])

    def follow_fork(self, header: ForkHeader) -> None:
        """A rank other than 0: rank 0 forked a sequence; copy its table row prefix (and
        last sampled token) the same way."""
        self.table.copy_prefix(header.parent, header.child, header.length)
        if header.inherit:
            self.last_tokens[header.child] = self.last_tokens[header.parent]

    def close(self) -> None:
        """Rank 0: tell the other ranks to leave their loop (nothing else to free)."""
        if self.channel is not None and self.tp.leads:
            try:
                self.channel.send(ShutdownHeader())
            finally:
                self.channel.close()

    def _forward_only(self, batch: ForwardBatch) -> None:
        """Fill the KV cache without computing logits (a prefill chunk that samples nothing)."""
        meta = self.attn.build_metadata(batch)
        self.model(batch.input_ids, batch.positions, self.attn, meta)

    def _resolve_last_sampled(self, batch: ForwardBatch) -> ForwardBatch:
        """An eager decode batch with its ``USE_LAST_SAMPLED`` tokens read from the device
        (a graph's prologue does the same inside the graph)."""
        if batch.phase != "decode":
            return batch
        ids = torch.where(batch.input_ids >= 0, batch.input_ids,
                          self.last_tokens[batch.req_pool_indices])
        return dataclasses.replace(batch, input_ids=ids)

    @torch.inference_mode()
    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Eager forward returning logits of ``batch.logits_indices`` in the activation
        dtype, as ``compute_logits`` gives them (for tests and benchmarks; it does not
        sample)."""
        batch = self._resolve_last_sampled(batch)
        meta = self.attn.build_metadata(batch)
        hidden = self.model(batch.input_ids, batch.positions, self.attn, meta)
        return self.model.compute_logits(hidden[batch.logits_indices])



@dataclasses.dataclass(frozen=True)
class _SamplePlan:
    """A prefill's sampled rows: one per sampling item, or one per new token of an
    ``every_position`` item (its last row samples exactly as a plain item would)."""

    params: list[SamplingParams]  # per row
    positions: list[int]  # per row: the sampled token's index in its sequence
    targets: list[int] | None  # per row: the item's next given token (-1: none)
    item_rows: tuple[int | None, ...]  # per item: its last row, or None
    position_rows: tuple[tuple[int, int] | None, ...]  # per item: (first row, count)
    last_rows: list[int]  # per sampling item, in order: its last row

    @staticmethod
    def of(items: Sequence[PrefillItem], alloc: Allocation, rows: list[int],
           every: frozenset[int]) -> _SamplePlan:
        exts = alloc.extensions
        if not every:  # the common case: a row per sampling item
            by_item: dict[int, int] = {i: r for r, i in enumerate(rows)}
            return _SamplePlan([items[i].sampling for i in rows],
                               [exts[i].seq_len for i in rows], None,
                               tuple(by_item.get(i) for i in range(len(items))), (),
                               list(range(len(rows))))
        params: list[SamplingParams] = []
        positions: list[int] = []
        targets: list[int] = []
        item_rows: list[int | None] = [None] * len(items)
        spans: list[tuple[int, int] | None] = [None] * len(items)
        for i in rows:
            it, e = items[i], exts[i]
            n = e.new_len if i in every else 1
            if i in every:
                spans[i] = (len(params), n)
                targets += [*it.token_ids[1:], -1]
            else:
                targets.append(-1)
            params += [it.sampling] * n
            positions += range(e.seq_len - n + 1, e.seq_len + 1)
            item_rows[i] = len(params) - 1
        last = [r for r in item_rows if r is not None]
        return _SamplePlan(params, positions, targets, tuple(item_rows), tuple(spans), last)


_NO_STOPS: frozenset[int] = frozenset()


@dataclasses.dataclass(slots=True)
class _DecodeMemo:
    """What a decode launch leaves for the next one when every item continued from its
    last sample: a pipelined scheduler sends the same items step after step
    (``use_last_sampled``), and their validation, columns and flags then stand as they
    were, provided the KV cache changed in nothing but this launch's own tokens."""

    items: tuple[DecodeItem, ...]
    num_steps: int
    kv_version: int  # ``KVCacheManager.version`` right after the launch
    max_len: int  # the longest of its sequences after the launch
    #: (seq_ids, tokens, sampling, stop sets, had_last), or None when an item gave its
    #: token (the next step's items would then differ from what it validated).
    columns: tuple[Any, ...] | None

    def repeats(self, items: Sequence[DecodeItem], num_steps: int, kv_version: int,
                servable_context: int) -> bool:
        """Whether ``items`` (the same objects, in order) continue this launch with
        nothing else changed, and every sequence still has room for ``num_steps``."""
        return (self.columns is not None and kv_version == self.kv_version
                and num_steps == self.num_steps and len(items) == len(self.items)
                and all(map(operator.is_, items, self.items))
                and self.max_len <= servable_context - num_steps)


def _decode_step(alloc: Allocation, num_steps: int, step: int) -> Allocation:
    """Decode step ``step`` of a multi-step allocation (``num_steps`` tokens per sequence,
    each sequence's locations contiguous): one token per sequence."""
    c = alloc.columns
    b = len(c.slots)
    locs = alloc.out_cache_loc.view(b, num_steps)[:, step]
    return Allocation.of_columns(
        Columns(c.seq_ids, c.slots, [p + step for p in c.prefix_lens], [1] * b,
                [is_new and step == 0 for is_new in c.is_new]), locs.contiguous())
