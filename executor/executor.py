"""``Executor``: owns the model, the KV pools, the sequence table and the graph runners.

Start-up reads top to bottom as a boot sequence:

    1. resolve device and dtype
    2. read the config, settle the attention backend (before anything big is allocated),
       load weights                     (HF directory -> our modules)
    3. size and allocate the KV cache   (pools + request-slot table)
    4. attention backend and sampler
    5. graph runners                    (capture happens on ``capture``)

Every public call validates completely, then allocates atomically, then runs; if the
forward pass fails after allocation, the allocation is rolled back, so a call applies to
all of its items or to none. The executor is not thread-safe: one thread drives it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from pathlib import Path as FsPath

import torch

from executor.api import (
    DecodeItem,
    ExecutorStatus,
    GraphStatus,
    ItemOutput,
    KVStats,
    ModelInfo,
    Path,
    Phase,
    PhaseCapture,
    PrefillItem,
    ReleaseResult,
    SamplingParams,
    StepInfo,
    StepResult,
)
from executor.attention import AttentionShape, create_backend, resolve_backend_name
from executor.config import TINY_MODEL, ExecutorConfig
from executor.errors import ConfigError, GraphsUnavailable
from executor.forward_batch import ForwardBatch, PinnedStaging
from executor.graphs.buckets import (
    default_decode_buckets,
    default_prefill_buckets,
    normalize_buckets,
)
from executor.graphs.dispatch import Decision, GraphKey, RunnerState, decide
from executor.graphs.graph_runner import GraphRunner
from executor.graphs.registry import make_capture_backend
from executor.graphs.runner import PhaseRunner
from executor.kv import Allocation, KVCacheManager, KVPool, ReqToTokenTable
from executor.model.loader import load_hf_config, load_model
from executor.model.tiny import ensure_tiny_model
from executor.sampling import SampleOutput, Sampler
from executor.validation import Limits, validate_decode, validate_prefill

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_TOKENS = 32768


class Executor:
    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        # -- 1. device and dtype -------------------------------------------------------
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {config.device!r} requested but CUDA is not available")
        dtype_name = config.model.dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        self.dtype = _DTYPES[dtype_name]

        # -- 2. weights ----------------------------------------------------------------
        source = config.model.source
        model_dir = ensure_tiny_model() if source == TINY_MODEL else FsPath(source)
        spec = load_hf_config(model_dir)
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
                                           spec)
        self.model_info = ModelInfo(
            name=source if source == TINY_MODEL else model_dir.name,
            architecture=spec.architecture,
            dtype=dtype_name,
            device=str(self.device),
            vocab_size=spec.vocab_size,
            max_context=max_context,
            attention_backend=backend_name,
        )
        self.boot_seconds["weights"] = time.perf_counter() - started

        # -- 3. KV cache ---------------------------------------------------------------
        num_tokens = self._kv_tokens(max_context)
        self.pool = KVPool(spec.num_layers, num_tokens, spec.num_kv_heads, spec.head_dim,
                           self.dtype, self.device)
        self.table = ReqToTokenTable(config.cache.max_sequences, max_context, self.device)
        self.kv = KVCacheManager(self.table, num_tokens)

        # -- 4. attention and sampling -------------------------------------------------
        self.attn = create_backend(backend_name, shape, self.pool, self.table)
        self.sampler = Sampler()
        # Every batch's metadata goes to the device through one reused pinned buffer.
        self.staging = PinnedStaging(self.device) if self.device.type == "cuda" else None
        self.limits = Limits(spec.vocab_size, max_context, config.max_prefill_tokens,
                             config.decode_batch_limit, kv_tokens=num_tokens)

        # -- 5. graph runners (captured by ``capture``, at start-up by the service) ------
        self._graph_modes: dict[Phase, str] = {"decode": config.graphs.decode_mode,
                                               "prefill": config.graphs.prefill_mode}
        self.runners: dict[Phase, PhaseRunner] = {}
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
        return GraphRunner(phase, self.model, self.attn, backend, normalize_buckets(buckets),
                           self.limits.max_context, self.device)

    def _model_key(self) -> str:
        """What a compiled forward depends on besides our code: layout, dtype, context
        (the RoPE table is a graph input) and the kernel choice."""
        raw = f"{self.spec!r}|{self.dtype}|{self.limits.max_context}|{self.model.kernels}"
        return hashlib.sha256(raw.encode()).hexdigest()[:16]

    # ------------------------------------------------------------------------------------
    # Public API
    # ------------------------------------------------------------------------------------
    def prefill(self, items: Sequence[PrefillItem]) -> StepResult:
        """Admit unknown sequences / extend known ones; sample where ``item.sample``."""
        validate_prefill(items, self._seq_len, self.limits)
        alloc = self.kv.allocate([(it.seq_id, len(it.token_ids)) for it in items])
        try:
            rows = [i for i, it in enumerate(items) if it.sample]
            tokens = [t for it in items for t in it.token_ids]
            decision = self._decide("prefill", len(tokens))
            batch = self.build_batch("prefill", tokens, alloc, rows, decision.bucket)
            params = [items[i].sampling for i in rows]
            positions = [alloc.extensions[i].seq_len for i in rows]
            sampled, step = self._step(batch, decision, params, positions)
        except BaseException:
            self.kv.rollback(alloc)
            raise
        by_row = dict(zip(rows, range(len(rows)), strict=True))
        outputs = tuple(
            _output(it.seq_id, ext.seq_len, it.sampling, sampled, by_row.get(i))
            for i, (it, ext) in enumerate(zip(items, alloc.extensions, strict=True))
        )
        return StepResult(outputs, step)

    def decode(self, items: Sequence[DecodeItem]) -> StepResult:
        """Append each item's token to its sequence and sample the next one."""
        validate_decode(items, self._seq_len, self.limits)
        alloc = self.kv.allocate([(it.seq_id, 1) for it in items])
        try:
            rows = list(range(len(items)))
            decision = self._decide("decode", len(items))
            batch = self.build_batch("decode", [it.token_id for it in items], alloc, rows,
                                     decision.bucket)
            positions = [ext.seq_len for ext in alloc.extensions]
            sampled, step = self._step(batch, decision, [it.sampling for it in items],
                                       positions)
        except BaseException:
            self.kv.rollback(alloc)
            raise
        outputs = tuple(_output(it.seq_id, ext.seq_len, it.sampling, sampled, i)
                        for i, (it, ext) in enumerate(zip(items, alloc.extensions, strict=True)))
        return StepResult(outputs, step)

    def release(self, seq_ids: Sequence[str]) -> ReleaseResult:
        """Free everything the sequences hold; unknown ids are reported, not an error."""
        released, unknown = 0, []
        for sid in dict.fromkeys(seq_ids):  # de-duplicated, order kept
            if self.kv.release(sid):
                released += 1
            else:
                unknown.append(sid)
        return ReleaseResult(released, tuple(unknown))

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
        return tuple(self.runners[p].capture_all(force=force, progress=progress)
                     for p in dict.fromkeys(phases))

    def drain_replay_seconds(self) -> dict[Phase, list[float]]:
        """Durations of graph replays finished since the last call (CUDA events that have
        completed; reading them adds no host sync)."""
        return {phase: r.drain_replay_seconds() for phase, r in self.runners.items()}

    def build_batch(self, phase: Phase, token_ids: list[int], alloc: Allocation,
                    logits_rows: list[int], bucket: int | None = None) -> ForwardBatch:
        """Pack a batch for ``alloc`` and publish its new KV locations to the device
        request-slot table (part of the same transfer). ``logits_rows`` index the
        sequences whose last new token needs logits. With the captured ``bucket`` it will
        replay, the batch is packed for that bucket's graphs, and the replay publishes
        its locations (``GraphRunner.layout``)."""
        runner = self.runners.get(phase) if bucket is not None else None
        layout = runner.layout(bucket) if runner is not None and bucket is not None else None
        batch = ForwardBatch.build(phase, token_ids, alloc, logits_rows, self.device,
                                   self.table.max_context, self.staging, layout)
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
    def _seq_len(self, seq_id: str) -> int | None:
        state = self.kv.get(seq_id)
        return None if state is None else state.length

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
              positions: list[int]) -> tuple[SampleOutput, StepInfo]:
        start = time.perf_counter()
        if decision.bucket is not None:
            # Graph logits are valid until the next replay: sampled right below.
            logits = self.runners[batch.phase].replay(batch, decision.bucket)
            padded = decision.bucket - (batch.batch_size if batch.phase == "decode"
                                        else batch.num_tokens)
        elif (runner := self.runners.get(batch.phase)) is not None and runner.runs_uncaptured:
            # Compiled pieces without graphs: still faster than the plain eager model.
            logits = runner.run_uncaptured(batch)
            padded = 0
        else:
            logits = self.forward_logits(batch) if params else self._forward_only(batch)
            padded = 0
        sampled = self.sampler(logits, params, positions) if params else SampleOutput([], [], [])
        if not params and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # KV written before we report success
        elapsed_ms = (time.perf_counter() - start) * 1e3
        reason = decision.reason.value if decision.reason is not None else ""
        path: Path = "graph" if decision.use_graph else "eager"
        step = StepInfo(batch.phase, path, reason, batch.num_tokens, padded, elapsed_ms)
        return sampled, step

    def _forward_only(self, batch: ForwardBatch) -> torch.Tensor:
        """Fill the KV cache without computing logits (a prefill chunk that samples nothing)."""
        meta = self.attn.build_metadata(batch)
        return self.model(batch.input_ids, batch.positions, self.attn, meta)

    @torch.inference_mode()
    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Eager forward returning float32 logits of ``batch.logits_indices`` (for tests
        and benchmarks; it does not sample)."""
        meta = self.attn.build_metadata(batch)
        hidden = self.model(batch.input_ids, batch.positions, self.attn, meta)
        return self.model.compute_logits(hidden[batch.logits_indices])


def _output(seq_id: str, seq_len: int, params: SamplingParams, sampled: SampleOutput,
            row: int | None) -> ItemOutput:
    if row is None:
        return ItemOutput(seq_id, None, None, (), seq_len)
    return ItemOutput(
        seq_id,
        sampled.token_ids[row],
        sampled.logprobs[row] if params.logprobs else None,
        sampled.top_logprobs[row],
        seq_len,
    )
