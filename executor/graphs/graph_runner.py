"""``GraphRunner``: one phase's CUDA graphs, one per bucket, over a capture backend.

The runner owns the buckets, the static inputs and output, and the capture loop; the
capture backend (composition, chosen by the graph mode) owns the graphs, the prologue
(``prologue.py``) takes each step's packed batch into them, and ``accounting.py`` measures
their memory and time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from executor.api import BucketCapture, Phase, PhaseCapture
from executor.attention.base import SCOPED, AttentionBackend, AttentionMetadata
from executor.forward_batch import ForwardBatch, dummy_batch
from executor.graphs.accounting import CaptureMemory, ReplayTimer
from executor.graphs.backends import BatchScope, CaptureBackend, FullGraphBackend
from executor.graphs.dispatch import RunnerState
from executor.graphs.prologue import GraphInputs, Prologue
from executor.kv.pool import ReqToTokenTable
from executor.logit_controls import SlotControls
from executor.model.base import CausalModel
from executor.packing import GraphLayout
from executor.sampling import SPLIT_ARGMAX, argmax_rows

log = logging.getLogger(__name__)


class GraphRunner:
    """One phase's graphs. Two things vary, each decided once at construction, never per
    step:

    | phase   | logits                         | attention (from the capture backend)       |
    |---------|--------------------------------|--------------------------------------------|
    | decode  | in the graph, every padded row | ``full``: inside the graph, static metadata |
    | prefill | after the graph, sampled rows  | ``breakable``: eager between segments;     |
    |         |                                | ``fixed_grid``: inside, static metadata    |

    Inside-graph attention uses the attention backend's graph hooks (static buffers, dummy
    metadata at capture, a refresh before replay: captured in the prologue where the backend
    allows it). Eager attention gets the real batch's metadata through a ``BatchScope`` bound
    around the replay.

    Context tiers (full decode graphs): where the attention backend launches a decode of a
    bucket's size differently for short sequences (``AttentionBackend.decode_context_tiers``:
    Triton's split count follows a bound on the lengths, and the max context's bound leaves
    most splits idle at a few hundred tokens), the bucket also gets a twin graph per tier,
    captured in the same pool and fed by the same prologue (which does not depend on the
    tier). A replay takes the smallest tier that holds the batch's longest sequence, else the
    general graph; the batch's lengths are on the host, so the choice costs no sync.
    """

    def __init__(self, phase: Phase, model: CausalModel, attn: AttentionBackend,
                 backend: CaptureBackend, buckets: tuple[int, ...], max_context: int,
                 table: ReqToTokenTable, device: torch.device,
                 last_tokens: torch.Tensor | None = None,
                 controls: SlotControls | None = None) -> None:
        self.phase, self.model, self.attn, self.backend = phase, model, attn, backend
        self.buckets, self.max_context, self.device = buckets, max_context, device
        self.logits_in_graph = phase == "decode"
        self.attention_in_graph = backend.attention_in_graph
        self.inputs = GraphInputs.allocate(max(buckets), device)
        self.prologue = Prologue(phase, buckets, self.inputs, table, device, last_tokens)
        self.scope = BatchScope()
        self.model_attn = backend.wrap_attention(attn, self.scope, max(buckets))
        self._forward = backend.prepare_forward(self._model_forward)
        self._meta: dict[int, AttentionMetadata] = {}  # static metadata per bucket
        # Context tiers (full decode graphs only): each tier's twin graphs, in the main
        # backend's pool, and per bucket the tiers captured for it, ascending.
        self._tier_backends: dict[int, CaptureBackend] = {}
        if self.logits_in_graph and isinstance(backend, FullGraphBackend):
            self._tier_backends = {tier: backend.sibling() for tier in attn.decode_context_tiers}
        self._tiers: dict[int, tuple[int, ...]] = {}
        self._static_meta_ready = False
        # Every bucket's graph writes its result (decode: logits; prefill: hidden states,
        # both in the activation dtype) into rows of this one buffer, so each graph's own
        # output goes back to the shared pool after capture instead of staying alive per
        # bucket (the float32 decode logits of 35 buckets up to batch 256 alone held
        # 1.5 GiB). Allocated at the first capture, for backends whose captured callable
        # is the runner's forward.
        self._out: torch.Tensor | None = None
        # Decode graphs: the final-norm hidden states of every row (activation dtype),
        # copied there by the graph, for rows that ask for them.
        self._hidden: torch.Tensor | None = None
        # Decode graphs: every row's argmax (int64), computed by the graph after the
        # logits (and their masks and biases), so that a greedy step launches no argmax
        # of its own (``greedy``).
        self._greedy: torch.Tensor | None = None
        # Decode graphs capturing the runner's forward apply each row's token mask and
        # logit bias inside the graph, by its slot (``SlotControls``): the slots are
        # the prologue's, the tables static.
        self.controls = controls if self.logits_in_graph and \
            backend.captures_runner_forward else None
        self.controls_in_graph = self.controls is not None
        self.failed: dict[int, str] = {}
        self._state: RunnerState | None = None
        self.memory = CaptureMemory(device)
        self.timer = ReplayTimer(device)
        # Test hook: called with each bucket before it is captured (fault injection).
        self.before_capture: Callable[[int], None] | None = None
        # Tensor parallelism: True only if every rank captured the bucket (a collective;
        # every rank captures the same buckets in the same order). None: one process.
        self.agree: Callable[[bool], bool] | None = None

    def state(self) -> RunnerState:
        """Snapshot for the graph-or-eager decision (``graphs/dispatch.py``)."""
        # Asked at every step; it changes only when capturing or releasing.
        if self._state is None:
            self._state = RunnerState(cuda=True, enabled=True, buckets=self.buckets,
                                      captured=frozenset(self.backend.captured()),
                                      failed=frozenset(self.failed))
        return self._state

    # -- capture -------------------------------------------------------------------------
    def capture_all(self, force: bool = False, progress: bool = True) -> PhaseCapture:
        """Capture every bucket not yet captured, largest first. A failing bucket is
        reported and skipped; the others stay usable."""
        from tqdm import tqdm

        if self.agree is not None and not force:
            force = ranks_differ([self.backend.has(b) for b in self.buckets], self.agree)
        if force:
            self.release()
        self.failed.clear()
        self._state = None
        start = time.perf_counter()
        # Largest first: the shared pool is sized by the biggest bucket, and each smaller
        # one is captured into blocks the pool already holds instead of growing it.
        todo = [b for b in sorted(self.buckets, reverse=True) if not self.backend.has(b)]
        bar = tqdm(todo, desc=f"capture {self.phase} ({self.backend.name})", unit="bucket",
                   disable=not progress)
        with self.memory.session(), torch.inference_mode():
            static_bytes = self.memory.allocated_by(self._allocate_static_buffers)
            results = []
            for bucket in bar:
                result = self._capture_one(bucket)
                if self.agree is not None and not self.agree(result.ok) and result.ok:
                    # Replaying it here alone would hang the ranks that have no graph.
                    self.failed[bucket] = "capture failed on another tensor-parallel rank"
                    result = BucketCapture(bucket, result.capture_ms, False,
                                           self.failed[bucket], result.memory_bytes)
                if result.ok:  # (the same on every rank by now)
                    result = self._capture_tiers(result)
                results.append(result)
                free = torch.cuda.mem_get_info(self.device)[0]
                bar.set_postfix(size=bucket, free_gib=f"{free / 2**30:.1f}")
        bar.close()
        self._state = None
        if self._tiers:
            log.info("%s graphs: context-tier twins (bucket: tokens) %s", self.phase,
                     ", ".join(f"{b}: {'/'.join(map(str, t))}" for b, t in
                               sorted(self._tiers.items())))
        used = static_bytes + sum(r.memory_bytes for r in results)
        return PhaseCapture(self.phase, self.backend.name,
                            tuple(sorted(results, key=lambda r: r.size)),
                            (time.perf_counter() - start) * 1e3, used)

    def _capture_one(self, bucket: int) -> BucketCapture:
        """Warm up, then capture while measuring, then capture the prologue."""
        t0 = time.perf_counter()
        try:
            if self.before_capture is not None:
                self.before_capture(bucket)
            self.inputs.input_ids[:bucket].zero_()
            self.inputs.positions[:bucket].zero_()
            with self._capture_forward(bucket) as fn:
                self.backend.warm_up(bucket, fn)
                used = self.memory.held_by(lambda: self.backend.capture(bucket, fn))
            rows = self.attn.static_decode_rows(self._meta[bucket]) \
                if self.attention_in_graph else None
            self.prologue.capture(bucket, rows)
        except Exception as exc:  # one bucket failing must not stop the others
            self.failed[bucket] = f"{type(exc).__name__}: {exc}"
            torch.cuda.synchronize(self.device)
            return BucketCapture(bucket, (time.perf_counter() - t0) * 1e3, False,
                                 self.failed[bucket])
        return BucketCapture(bucket, (time.perf_counter() - t0) * 1e3, True, "", used)

    def _capture_tiers(self, result: BucketCapture) -> BucketCapture:
        """Capture ``result``'s bucket's twin graph for each context tier at which its
        attention launches leaner (none for most buckets), as ``agreed_tiers`` decides
        with the other tensor-parallel ranks. A twin that fails is only logged: the
        general graph serves those batches."""
        bucket = result.size
        took_ms, held = result.capture_ms, result.memory_bytes

        def capture(tier: int) -> bool:
            nonlocal took_ms, held
            t0 = time.perf_counter()
            try:
                held += self._capture_twin(self._tier_backends[tier], bucket, tier)
                return True
            except Exception as exc:  # the general graph still serves this bucket
                log.warning("decode bucket %d: the twin graph for sequences of up to %d "
                            "tokens failed to capture (%s: %s); the general graph serves them",
                            bucket, tier, type(exc).__name__, exc)
                torch.cuda.synchronize(self.device)
                return False
            finally:
                took_ms += (time.perf_counter() - t0) * 1e3

        tiers = agreed_tiers(tuple(self._tier_backends),
                             lambda tier: self.attn.tier_helps(bucket, tier), capture,
                             self.agree)
        if tiers:
            self._tiers[bucket] = tiers
        return BucketCapture(bucket, took_ms, True, "", held)

    def _capture_twin(self, backend: CaptureBackend, bucket: int, tier: int) -> int:
        """Warm up and capture ``bucket``'s twin for ``tier`` into ``backend``; returns the
        memory its capture took."""
        with self._capture_forward(bucket, tier) as fn:
            backend.warm_up(bucket, fn)
            return self.memory.held_by(lambda: backend.capture(bucket, fn))

    def context_tiers(self) -> dict[int, tuple[int, ...]]:
        """Per bucket, the context tiers (tokens) it has twin graphs for."""
        return dict(self._tiers)

    @contextmanager
    def _capture_forward(self, bucket: int, tier: int | None = None
                         ) -> Iterator[Callable[[], torch.Tensor]]:
        """The forward to warm up and capture for ``bucket`` (``tier``: a context tier's
        twin), with its attention inputs: static metadata (the general graph's kept for
        replay once captured: every tier's shares its rows) or a dummy batch bound to the
        scope (attention reads the scope, not an argument: the forward gets ``SCOPED``,
        so one compiled function serves every bucket)."""
        ids, pos = self.inputs.input_ids[:bucket], self.inputs.positions[:bucket]
        # The packed batch the warm-up's argmax reads its slots from (``stores_greedy``):
        # padding only, so that it stores no token (the buffer may still hold a live
        # batch's slots, when graphs are captured again between steps).
        self.prologue.layouts[bucket].fill_padding()
        if self.attention_in_graph:
            meta = self.attn.capture_metadata(self.phase, bucket, bucket, tier)
            yield lambda: self._forward(ids, pos, meta)
            if tier is None:
                self._meta[bucket] = meta
        else:
            dummy = dummy_batch(self.phase, bucket, self.max_context, self.device)
            with self.scope.bind(self.attn.build_metadata(dummy), bucket):
                yield lambda: self._forward(ids, pos, SCOPED)

    def _allocate_static_buffers(self) -> None:
        """Buffers every bucket's graphs share, made at the first capture: attention's
        static metadata (when captured inside the graphs) and the shared output."""
        largest = max(self.buckets)
        if self.attention_in_graph and not self._static_meta_ready:
            self.attn.init_graph_buffers(largest, largest, self.phase)
            self._static_meta_ready = True
        if self.backend.captures_runner_forward and self._out is None:
            width = self.model.spec.vocab_size if self.logits_in_graph \
                else self.model.spec.hidden_size
            # Logits too stay in the activation dtype (``compute_logits``): half the
            # bytes of float32, and no cast kernel in every decode step.
            self._out = torch.empty(largest, width, dtype=self.model.hidden_dtype,
                                    device=self.device)
            if self.logits_in_graph:
                self._hidden = torch.empty(largest, self.model.spec.hidden_size,
                                           dtype=self.model.hidden_dtype, device=self.device)
                self._greedy = torch.zeros(largest, dtype=torch.int64, device=self.device)

    def _model_forward(self, ids: torch.Tensor, pos: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(ids, pos, self.model_attn, meta)  # (T, hidden)
        if self.logits_in_graph:
            logits = self.model.compute_logits(hidden, out=self._out)
            if self._hidden is not None:
                self._hidden[: hidden.shape[0]].copy_(hidden)
            if self.controls is not None:  # the rows' slots, where the prologue reads them
                slots = self.prologue.layouts[ids.shape[0]].field("slots")
                self.controls.apply(logits, slots)
            if self._greedy is not None:  # the sampler's argmax, of the same logits,
                # also stored as the rows' last sampled tokens (``stores_greedy``)
                store, padding = self.prologue.last_token_store(ids.shape[0]) \
                    if self.stores_greedy else (None, None)
                argmax_rows(logits, out=self._greedy[: logits.shape[0]], store=store,
                            padding=padding)
            return logits
        if self._out is None:
            return hidden
        dst = self._out[: hidden.shape[0]]
        dst.copy_(hidden)
        return dst

    # -- replay --------------------------------------------------------------------------
    def layout(self, bucket: int) -> GraphLayout:
        """How to pack a batch that will replay ``bucket`` (a captured one), so that the
        replay finds it in place; such a batch publishes its table entries itself."""
        return self.prologue.layouts[bucket]

    def replay(self, batch: ForwardBatch, bucket: int, want_hidden: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``batch``, packed for ``bucket`` (``layout``); logits of
        ``batch.logits_indices`` in the activation dtype (``compute_logits``), and with
        ``want_hidden`` those rows' final-norm hidden states (else None), valid until the
        next replay of this runner."""
        timed = self.timer.start()  # (no context manager: it costs host time per step)
        rows_refreshed = self.prologue.replay(batch, bucket)
        if not self.attention_in_graph:
            with self.scope.bind(self.attn.build_metadata(batch), batch.num_tokens):
                out = self.backend.replay(bucket)
        else:
            if not rows_refreshed:
                self.attn.refresh_metadata(self._meta[bucket], batch)
            out = self._graphs_for(batch, bucket).replay(bucket)
        self.timer.stop(timed)
        if self.logits_in_graph:  # decode: logits_indices are rows 0..B-1
            hidden = self._hidden[: batch.batch_size] if want_hidden and \
                self._hidden is not None else None
            return out[: batch.batch_size], hidden
        rows = out[batch.logits_indices]
        return self.model.compute_logits(rows), rows if want_hidden else None

    def greedy(self, batch_size: int) -> torch.Tensor | None:
        """The argmax of each of the last replay's ``batch_size`` rows of logits, as the
        sampler would find it (a view, valid until the next replay), or None where the
        graphs do not compute it (prefill; a backend that does not capture the runner's
        forward)."""
        return None if self._greedy is None else self._greedy[:batch_size]

    @property
    def stores_greedy(self) -> bool:
        """Whether a replay also wrote ``greedy``'s tokens to its rows' slots of the last
        sampled tokens (the prologue's table; padded rows write nothing), so that an
        all-greedy step has nothing left to store. A step whose samples differ (drawn
        rows, masks applied after the graph) stores its own over them afterwards."""
        return self._greedy is not None and self.prologue.last_tokens is not None \
            and self.device.type == "cuda" and SPLIT_ARGMAX

    def _graphs_for(self, batch: ForwardBatch, bucket: int) -> CaptureBackend:
        """The twin of the smallest context tier that holds ``batch``'s longest sequence,
        else the general graphs."""
        tiers = self._tiers.get(bucket)
        if tiers:
            longest = max(batch.seq_lens_host)
            for tier in tiers:
                if longest <= tier:
                    return self._tier_backends[tier]
        return self.backend

    @property
    def runs_compiled(self) -> bool:
        """Whether ``run_compiled`` beats the plain eager model (compiled pieces)."""
        return self.backend.serves_compiled_shapes

    def run_compiled(self, batch: ForwardBatch, want_hidden: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A batch that fits no captured bucket, without graphs: logits (and hidden
        states) as ``replay`` gives them (new tensors)."""
        with self.scope.bind(self.attn.build_metadata(batch), batch.num_tokens):
            hidden = self._forward(batch.input_ids, batch.positions, SCOPED)
        rows = hidden[batch.logits_indices]
        return self.model.compute_logits(rows), rows if want_hidden else None

    def captured_sizes(self) -> tuple[int, ...]:
        return self.backend.captured()

    def drain_replay_seconds(self) -> list[float]:
        """Durations of finished replays since the last call (no host sync)."""
        return self.timer.drain()

    def release(self) -> None:
        self.backend.release()
        for twins in self._tier_backends.values():
            twins.release()
        self._tiers.clear()
        self.prologue.release()
        self._meta.clear()
        self._state = None


def ranks_differ(captured: list[bool], agree: Callable[[bool], bool]) -> bool:
    """True, on every rank, if some bucket is captured on some ranks only (one failed
    there earlier): then all ranks must start over together, or their captures (and the
    collectives inside) would no longer pair up. ``captured``: this rank's, per bucket;
    ``agree``: the all-ranks AND (a collective). NOTE: every rank makes the same number of
    ``agree`` calls (a list, never a short-circuit)."""
    everywhere = [agree(c) for c in captured]
    return not agree(captured == everywhere)


def agreed_tiers(candidates: tuple[int, ...], helps: Callable[[int], bool],
                 capture: Callable[[int], bool], agree: Callable[[bool], bool] | None
                 ) -> tuple[int, ...]:
    """The context tiers a bucket keeps twins for: each candidate that ``helps`` on every
    rank is captured (``capture``: whether it succeeded here) and kept if it succeeded on
    every rank. ``agree``: the all-ranks AND (a collective), None in one process.

    A twin's warm-up runs the forward, collectives included, so a rank may start one only
    where every rank does; and a twin is replayed only where every rank has it, so that
    all ranks replay graphs captured in the same order. NOTE: every rank makes the same
    ``agree`` calls: one per candidate, one more per candidate tried."""
    kept = []
    for tier in candidates:
        wanted = helps(tier)
        if agree is not None:
            wanted = agree(wanted)
        if not wanted:
            continue
        ok = capture(tier)
        if agree is not None:
            ok = agree(ok)
        if ok:
            kept.append(tier)
    return tuple(kept)
