"""``Forward``: a step's forward pass, from its allocation to its samples on the device.

It decides graph or eager (``graphs/dispatch.py``), packs the batch, tells the other
tensor-parallel ranks (rank 0's announcer), runs the forward as the ``Mode`` says (graph
replay, compiled pieces without graphs, or eager) with the kernel switches held, and
samples. Rank 0's ``Executor`` and the other ranks' follower (``follower.py``) both run
their forwards through it, so every rank runs a step the same way.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from executor.api import (
    BatchNeeds,
    Path,
    Phase,
    RankTiming,
    SamplingParams,
    StepInfo,
)
from executor.attention.base import AttentionBackend
from executor.distributed.channel import StepChannel
from executor.distributed.protocol import Mode, StepHeader
from executor.forward_batch import BeforeTransfer, ForwardBatch, PinnedStaging
from executor.graphs.dispatch import Decision, GraphKey, RunnerState, decide
from executor.graphs.graph_runner import GraphRunner
from executor.kernels.switches import KernelSwitches
from executor.kv import Allocation, ReqToTokenTable
from executor.last_sampled import LastSampled
from executor.late_masks import LateMaskRing
from executor.logit_controls import SlotControls
from executor.mask_worker import MaskWorker
from executor.model.base import CausalModel
from executor.packing import USE_LAST_SAMPLED, PackedSizes
from executor.sampling import DeviceSample, Sampler, device_tensor
from executor.step_plan import SamplePlan, decode_step

#: The host values of a device step's tokens (waits for their copy, started right after
#: that step's sampling: not for anything queued later).
HostTokens = Callable[[], list[int]]
#: Grammar masks of a step's rows: ``(device step, the previous device step's tokens or
#: None, host rows to fill) -> which rows have a mask`` (``GrammarFlow``; row r of the
#: (rows, words) int32 tensor gets row r's mask, all ones without one).
LateMasks = Callable[[int, HostTokens | None, torch.Tensor], np.ndarray]


def host_tokens(sample: DeviceSample) -> HostTokens:
    """Start copying ``sample``'s tokens to pinned host memory now (on CUDA, with an event
    after the copy); the returned function waits for that copy only."""
    if not sample.tokens.is_cuda:
        return sample.tokens.tolist
    host = torch.empty(sample.tokens.shape, dtype=sample.tokens.dtype, pin_memory=True)
    host.copy_(sample.tokens, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> list[int]:
        copied.synchronize()
        return host.tolist()
    return read


class Forward:
    def __init__(self, model: CausalModel, attn: AttentionBackend,
                 runners: dict[Phase, GraphRunner], graph_modes: dict[Phase, str],
                 table: ReqToTokenTable, device: torch.device, staging: PinnedStaging | None,
                 sampler: Sampler, last: LastSampled, switches: KernelSwitches,
                 channel: StepChannel | None, controls: SlotControls) -> None:
        self.model, self.attn, self.runners, self.graph_modes = model, attn, runners, graph_modes
        self.table, self.device, self.staging = table, device, staging
        self.sampler, self.last, self.switches, self.channel = sampler, last, switches, channel
        self.controls = controls  # each slot's token mask and logit bias
        # Grammar masks: made by the worker once the forward is launched (``LateMasks``),
        # applied eagerly before sampling, on top of ``controls``.
        self.mask_worker = MaskWorker(device)
        self.late_masks = LateMaskRing(controls.active.shape[0], controls.vocab, device)

    # -- decisions ------------------------------------------------------------------
    def decide(self, phase: Phase, size: int) -> Decision:
        """Graph bucket or eager, for a step of ``size`` rows (decode) or tokens."""
        runner = self.runners.get(phase)
        if runner is not None:
            state = runner.state()
        else:
            state = RunnerState(cuda=self.device.type == "cuda",
                                enabled=self.graph_modes[phase] != "disabled",
                                buckets=(), captured=frozenset(), failed=frozenset())
        return decide(GraphKey(phase, size), state)

    def mode(self, phase: Phase, decision: Decision, params: list[SamplingParams]) -> Mode:
        """How a step's forward runs (every rank runs it the same way)."""
        if decision.bucket is not None:
            return Mode.GRAPH
        runner = self.runners.get(phase)
        if runner is not None and runner.runs_compiled:
            return Mode.COMPILED
        return Mode.LOGITS if params else Mode.KV_ONLY

    def announcer(self, phase: Phase, decision: Decision, params: list[SamplingParams],
                  targets: list[int] | None) -> BeforeTransfer | None:
        """Rank 0 of a tensor-parallel group: sends a step to the other ranks as soon as it
        is packed, before its own device copy, so that they start unpacking it while this
        rank copies and launches (their forwards' first all-reduce waits for the last
        rank to arrive). None without other ranks."""
        channel = self.channel
        if channel is None:
            return None
        mode = self.mode(phase, decision, params)
        # Sequences sampled for: one row each, except an every_position item's many rows,
        # of which only the last (the one target -1) keeps its token.
        sampled = 0 if mode is Mode.KV_ONLY or not params else \
            len(params) if targets is None else targets.count(-1)

        def send(packed: torch.Tensor, sizes: PackedSizes) -> None:
            channel.send(StepHeader(phase, mode, decision.bucket, sizes, sampled), packed)

        return send

    # -- batches --------------------------------------------------------------------
    def build_batch(self, phase: Phase, token_ids: list[int], alloc: Allocation,
                    logits_rows: list[int], bucket: int | None = None,
                    every_position: frozenset[int] = frozenset(),
                    before_transfer: BeforeTransfer | None = None) -> ForwardBatch:
        """Pack a batch for ``alloc`` and publish its new KV locations to the device
        request-slot table (part of the same transfer). ``logits_rows`` index the
        sequences whose last new token needs logits. With the captured ``bucket`` it will
        replay, the batch is packed for that bucket's graphs, and the replay publishes
        its locations (``GraphRunner.layout``). ``before_transfer``: see
        ``ForwardBatch.build`` (``announcer``'s)."""
        runner = self.runners.get(phase) if bucket is not None else None
        layout = runner.layout(bucket) if runner is not None and bucket is not None else None
        batch = ForwardBatch.build(phase, token_ids, alloc, logits_rows, self.device,
                                   self.table.max_context, self.staging, layout,
                                   every_position, before_transfer)
        if layout is None:
            self.table.write_device(batch.table_index, batch.out_cache_loc)
        return batch

    def unpack(self, header: StepHeader, packed: torch.Tensor) -> ForwardBatch:
        """A rank other than 0: the batch rank 0 packed, at the same KV locations."""
        runner = self.runners.get(header.phase) if header.bucket is not None else None
        layout = runner.layout(header.bucket) if runner is not None and \
            header.bucket is not None else None
        batch = ForwardBatch.from_packed(header.phase, packed, header.sizes, self.device,
                                         self.staging, layout)
        if layout is None:
            self.table.write_device(batch.table_index, batch.out_cache_loc)
        return batch

    # -- steps ----------------------------------------------------------------------
    def prefill(self, tokens: list[int], alloc: Allocation, rows: list[int],
                every: frozenset[int], plan: SamplePlan,
                late: LateMasks | None = None) -> tuple[DeviceSample | None, StepInfo]:
        """A prefill's forward and samples; the samples of each sampling item's last row
        become its sequence's last sampled token. ``late(0, None, rows)``: the sampled
        rows' grammar masks, asked once the forward is launched."""
        decision = self.decide("prefill", len(tokens))
        batch = self.build_batch("prefill", tokens, alloc, rows, decision.bucket, every,
                                 self.announcer("prefill", decision, plan.params,
                                                plan.targets))
        # Each sampled row's slot (an every_position item's rows all take its own).
        row_slots = [alloc.extensions[i].slot for i in rows
                     for _ in range(plan.position_rows[i][1] if i in every else 1)]  # type: ignore[index]
        needs = BatchNeeds.of(plan.params)
        controlled = self.stage_controls(row_slots, plan.params, needs)
        sample, info = self.step(batch, decision, plan.params, plan.positions, plan.targets,
                                 controlled=controlled,
                                 late=None if late is None else (lambda out: late(0, None, out)),
                                 want_hidden=needs.hidden,
                                 needs=needs)
        if sample is not None:
            slots = device_tensor([alloc.extensions[i].slot for i in rows], torch.int64,
                                  self.device)
            # (an every_position item's last row is the one a plain item would sample)
            sampled = sample.tokens if not every else sample.tokens.index_select(
                0, device_tensor(plan.last_rows, torch.int64, self.device))
            self.last.remember(slots, sampled)
        return sample, info

    def decode(self, alloc: Allocation, tokens: Sequence[int | None],
               params: list[SamplingParams], num_steps: int,
               late: LateMasks | None = None, needs: BatchNeeds | None = None
               ) -> tuple[list[DeviceSample], tuple[int, ...], StepInfo]:
        """``num_steps`` decode steps over ``alloc`` (``num_steps`` tokens per sequence),
        each reading the previous one's samples on the device (one graph replay per step,
        no host round trip). A None token continues from its sequence's last sample.
        Returns the samples per step, the sequences' lengths after the last step and its
        info (over all the steps). ``late(k, tokens of step k - 1)``: step k's grammar
        masks per row (as ``prefill``'s), asked once step k's forward is launched (it may
        wait for step k - 1's samples on the host while the device runs that forward)."""
        n = len(tokens)
        rows = list(range(n))
        samples: list[DeviceSample] = []
        ranks: RankTiming | None = None  # the worst over the steps
        decision = self.decide("decode", n)
        first = [USE_LAST_SAMPLED] * n if tokens.count(None) == n else \
            [USE_LAST_SAMPLED if t is None else t for t in tokens]
        announce = self.announcer("decode", decision, params, None)
        slots = alloc.columns.slots
        needs = needs or BatchNeeds.of(params)
        controlled = self.stage_controls(slots, params, needs)
        for step in range(num_steps):
            previous = None if late is None or not samples else host_tokens(samples[-1])
            sub = alloc if num_steps == 1 else decode_step(alloc, num_steps, step)
            batch = self.build_batch("decode", first if step == 0 else
                                     [USE_LAST_SAMPLED] * n, sub, rows, decision.bucket,
                                     before_transfer=announce)
            # each sequence's length after this step: the index of its new token + 1
            sample, info = self.step(batch, decision, params, batch.seq_lens_host,
                                     remember=batch.slots,
                                     controlled=batch.slots if controlled is not None else None,
                                     late=None if late is None else (
                                         lambda out: late(step, previous, out)),  # noqa: B023
                                     want_hidden=needs.hidden,
                                     needs=needs, fresh_tokens=num_steps > 1)
            assert sample is not None
            self.last.remember(batch.slots, sample.tokens, stored=True)
            samples.append(sample)
            if info.ranks is not None:
                ranks = info.ranks if ranks is None else ranks.worst(info.ranks)
        if num_steps != 1:
            info = dataclasses.replace(info, num_tokens=info.num_tokens * num_steps,
                                       padded_tokens=info.padded_tokens * num_steps,
                                       num_steps=num_steps, ranks=ranks)
        return samples, batch.seq_lens_host, info

    def stage_controls(self, slots: Sequence[int], params: Sequence[SamplingParams],
                       needs: BatchNeeds) -> torch.Tensor | None:
        """Put the rows' token masks and logit biases in their slots' tables; the rows'
        slots on the device when any row has one (the step applies them), else None."""
        if not self.controls.stage(slots, params, any_controls=needs.controls):
            return None
        return device_tensor(list(slots), torch.int64, self.device)

    @torch.inference_mode()
    def step(self, batch: ForwardBatch, decision: Decision, params: list[SamplingParams],
             positions: Sequence[int], targets: list[int] | None = None,
             remember: torch.Tensor | None = None, controlled: torch.Tensor | None = None,
             late: Callable[[torch.Tensor], np.ndarray] | None = None,
             want_hidden: bool = False, needs: BatchNeeds | None = None, fresh_tokens: bool = False
             ) -> tuple[DeviceSample | None, StepInfo]:
        """Run the forward (graph, compiled pieces or eager) and sample on the device;
        with ``remember`` (a slot per sampled row), the sampler also writes the samples
        to those slots' last sampled tokens (``LastSampled.sampler_target``). With
        ``controlled`` (a slot per sampled row), the rows' token masks and logit biases
        are applied first (a decode graph applies them itself). ``late``: grammar masks
        per row, made by the mask worker once the forward is launched and applied on top
        before sampling (``LateMaskRing``). ``want_hidden``: a row returns its hidden state.
        ``needs``: ``BatchNeeds.of(params)``, if the caller has it. A decode graph's own
        argmax of the rows (``GraphRunner.greedy``) stands for the sampler's where the
        logits are the graph's as they are (no late masks); ``fresh_tokens``: the tokens
        must outlive the next replay (a multi-step decode stages them after its last)."""
        start = time.perf_counter()
        padded = 0 if decision.bucket is None else decision.bucket - (
            batch.batch_size if batch.phase == "decode" else batch.num_tokens)
        mode = self.mode(batch.phase, decision, params)
        # NOTE: the switches stay held through sampling: its kernels launch as the
        # forward's do (with PDL, the first overlaps the graph's tail).
        with self.switches:
            # (the other ranks got the step from ``announcer`` while it was packed)
            logits, hidden = self.run(batch, mode, decision.bucket, want_hidden)
            ranks = None
            if self.channel is not None:  # every rank launched the step (after our launch)
                ranks = self.channel.confirm(time.monotonic_ns())
            if controlled is not None and logits is not None and not (
                    mode is Mode.GRAPH and self.runners[batch.phase].controls_in_graph):
                self.controls.apply(logits, controlled)
            # (grammar masks: made by the worker while the device runs the forward)
            if late is not None and logits is not None:
                self.late_masks.apply(logits, late, self.mask_worker)
            greedy, stored = None, False
            if mode is Mode.GRAPH and late is None and batch.phase == "decode":
                runner = self.runners[batch.phase]
                if controlled is None or runner.controls_in_graph:
                    greedy = runner.greedy(batch.batch_size)
                    stored = greedy is not None and runner.stores_greedy
                    if greedy is not None and fresh_tokens:
                        greedy = greedy.clone()
            sample = self.sampler.sample(
                logits, params, positions, targets,
                None if remember is None else self.last.sampler_target(remember), hidden,
                needs, greedy, greedy_stored=stored) \
                if logits is not None and params else None
        elapsed_ms = (time.perf_counter() - start) * 1e3
        reason = decision.reason.value if decision.reason is not None else ""
        path: Path = "graph" if decision.use_graph else "eager"
        return sample, StepInfo(batch.phase, path, reason, batch.num_tokens, padded, elapsed_ms,
                                ranks=ranks)

    # -- forwards -------------------------------------------------------------------
    def run(self, batch: ForwardBatch, mode: Mode, bucket: int | None,
            want_hidden: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The forward as ``mode`` says, with the kernel switches held; logits of the
        sampled rows in the activation dtype (the sampler widens what it computes in
        float32), or None; with ``want_hidden`` also those rows' final-norm hidden
        states (else None)."""
        with self.switches:
            if mode is Mode.GRAPH:
                assert bucket is not None
                # Graph logits are valid until the next replay: sampled right after.
                return self.runners[batch.phase].replay(batch, bucket, want_hidden)
            if mode is Mode.COMPILED:
                # Compiled pieces without graphs: still faster than the plain eager model.
                return self.runners[batch.phase].run_compiled(batch, want_hidden)
            if mode is Mode.LOGITS:
                if not want_hidden:  # (``forward_logits``: what a stand-in device replaces)
                    return self.forward_logits(batch), None
                hidden, logits = self.forward_rows(batch)
                return logits, hidden
            self.forward_only(batch)  # fills the KV cache; no logits wanted
            return None, None

    def forward_only(self, batch: ForwardBatch) -> None:
        """Fill the KV cache without computing logits (a prefill chunk that samples nothing)."""
        meta = self.attn.build_metadata(batch)
        self.model(batch.input_ids, batch.positions, self.attn, meta)

    def resolve_last_sampled(self, batch: ForwardBatch) -> ForwardBatch:
        """An eager decode batch with its ``USE_LAST_SAMPLED`` tokens read from the device
        (a graph's prologue does the same inside the graph)."""
        if batch.phase != "decode":
            return batch
        return dataclasses.replace(batch, input_ids=self.last.resolve(batch.input_ids,
                                                                      batch.slots))

    @torch.inference_mode()
    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Eager forward returning logits of ``batch.logits_indices`` in the activation
        dtype, as ``compute_logits`` gives them (for tests and benchmarks; it does not
        sample)."""
        return self.forward_rows(batch)[1]

    @torch.inference_mode()
    def forward_rows(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Eager forward: the final-norm hidden states and the logits of
        ``batch.logits_indices``."""
        batch = self.resolve_last_sampled(batch)
        meta = self.attn.build_metadata(batch)
        hidden = self.model(batch.input_ids, batch.positions, self.attn, meta)
        rows = hidden[batch.logits_indices]
        return rows, self.model.compute_logits(rows)
