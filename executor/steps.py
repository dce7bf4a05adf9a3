"""A launched step: what it leaves between its launch and its completion.

``Executor.launch_prefill`` / ``launch_decode`` validate, allocate, pack, run the forward
(graph replay or eager) and sample on the device, then start the samples' copy to pinned
host memory; nothing waits for the device. The step is *applied* from then on (its KV
allocation and sequence lengths count), unless ``Executor.abort`` rolls it back.
``Executor.complete`` waits for the copy and builds the outputs. Between the two the
executor may launch further steps, which read this step's sampled tokens on the device.
``StepPools`` lends each launched step the pinned buffers and the event it needs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from typing import TypeVar

import torch

from executor.api import (
    BatchNeeds,
    ItemOutput,
    Phase,
    SampledToken,
    SamplingParams,
    StepInfo,
    StepResult,
    named_rows,
)
from executor.kv.manager import Allocation
from executor.sampling import DeviceSample, PinnedPool, SampleOutput

_T = TypeVar("_T")


@dataclass
class PendingStep:
    phase: Phase
    seq_ids: tuple[str, ...]
    alloc: Allocation
    seq_lens: tuple[int, ...]  # per item, after the step
    rows: tuple[int | None, ...]  # per item: its sampled row, or None
    params: tuple[SamplingParams, ...]  # per sampled row
    stops: tuple[frozenset[int], ...]  # per sampled row: stop token ids
    samples: list[DeviceSample]  # per decode step (one unless num_steps > 1)
    info: StepInfo  # forward_ms: completion fills it in, from the launch's start
    started: float = field(default_factory=time.perf_counter)  # when the launch began
    #: Sequences that had a last sampled token before this step, for ``abort``.
    had_last: dict[str, bool] = field(default_factory=dict)
    done: torch.cuda.Event | None = None  # recorded after the step's device work
    finished: bool = False
    #: Per item of an ``every_position`` prefill: (first row, rows), or None; empty when
    #: no item asked.
    position_rows: tuple[tuple[int, int] | None, ...] = ()
    #: Called once the step's device work is done and its host buffers are read (after
    #: ``finish`` builds the outputs, or after an abort): the launcher takes back the
    #: step's event and staging buffers for later steps.
    recycle: Callable[[PendingStep], None] | None = field(default=None, repr=False)
    #: The weight version its forward ran with.
    weight_version: str = ""
    #: Grammar rows (``grammar_flow.py``): called with the host samples before the
    #: outputs are built; device steps of it applied so far; per row, the device step
    #: whose token completed its grammar, and the last device step before one whose mask
    #: the row's own mask emptied (its output ends there).
    on_sampled: Callable[[PendingStep, list[SampleOutput]], None] | None = field(
        default=None, repr=False)
    grammar_applied: int = 0
    grammar_done: dict[int, int] = field(default_factory=dict)
    grammar_dead_ends: dict[int, int] = field(default_factory=dict)
    #: ``BatchNeeds.of(params)`` when the launcher had it (else ``outputs`` asks the rows).
    needs: BatchNeeds | None = None

    def finish(self) -> StepResult:
        """Wait for the step's device work and build its result. Touches only the step, so
        any thread may call it (``Executor.complete`` is this)."""
        if self.finished:
            raise ValueError("the step was completed or aborted already")
        sampled = self.wait()
        if self.on_sampled is not None:
            self.on_sampled(self, sampled)
        self.finished = True
        elapsed_ms = (time.perf_counter() - self.started) * 1e3
        self.recycled()
        return StepResult(self.outputs(sampled), self.info.timed(elapsed_ms,
                                                                 self.weight_version))

    def recycled(self) -> None:
        """Hand the step's event and buffers back to its launcher (once; the device work
        must be done and nothing may read them after this)."""
        recycle, self.recycle = self.recycle, None
        if recycle is not None:
            recycle(self)

    def wait(self) -> list[SampleOutput]:
        """Host values of every step's samples (waits for the device)."""
        if self.done is not None:
            self.done.synchronize()
        return [s.to_output(self.params) for s in self.samples]

    def outputs(self, sampled: list[SampleOutput]) -> tuple[ItemOutput, ...]:
        if self.position_rows:
            return self._position_outputs(sampled[0])
        done = self.grammar_done
        if len(sampled) == 1 and not any(self.stops) and not done:  # no per-token lists
            s = sampled[0]
            if len(self.rows) >= 16 and self.rows == tuple(range(len(self.rows))) and (
                    self.needs or BatchNeeds.of(self.params)).plain:
                # Every item sampled row i, no log-probabilities (a plain decode step): the
                # outputs made column-wise, without a conditional per item.
                n = len(self.rows)
                return tuple(named_rows(ItemOutput, self.seq_ids, s.token_ids, repeat(None, n),
                                        repeat((), n), self.seq_lens, repeat((), n),
                                        repeat(False, n), repeat((), n), repeat((), n),
                                        repeat((), n), repeat(False, n)))
            return tuple(
                ItemOutput(seq_id, None, None, (), seq_len) if row is None else
                ItemOutput(seq_id, s.token_ids[row],
                           s.logprobs[row] if self.params[row].logprobs else None,
                           s.top_logprobs[row], seq_len,
                           candidate_logprobs=_at(s.candidate_logprobs, row),
                           hidden_state=_at(s.hidden_states, row))
                for seq_id, seq_len, row in zip(self.seq_ids, self.seq_lens, self.rows,
                                                strict=True))
        multi = len(sampled) > 1
        out = []
        for seq_id, seq_len, row in zip(self.seq_ids, self.seq_lens, self.rows, strict=True):
            if row is None:
                out.append(ItemOutput(seq_id, None, None, (), seq_len))
                continue
            want_logprob = self.params[row].logprobs
            tokens: list[SampledToken] = []
            stopped = False
            for s in sampled:
                tok = s.token_ids[row]
                tokens.append(SampledToken(tok, s.logprobs[row] if want_logprob else None,
                                           s.top_logprobs[row], None,
                                           _at(s.candidate_logprobs, row),
                                           _at(s.hidden_states, row)))
                if tok in self.stops[row]:
                    stopped = True
                    break
                if done.get(row) == len(tokens) - 1 or \
                        self.grammar_dead_ends.get(row) == len(tokens) - 1:
                    break
            last = tokens[-1]
            out.append(ItemOutput(seq_id, last.token_id, last.logprob, last.top_logprobs,
                                  seq_len, tuple(tokens) if multi else (), stopped,
                                  candidate_logprobs=last.candidate_logprobs,
                                  hidden_state=last.hidden_state,
                                  grammar_completed=done.get(row) == len(tokens) - 1))
        return tuple(out)

    def _position_outputs(self, s: SampleOutput) -> tuple[ItemOutput, ...]:
        """A prefill with ``every_position`` items: each lists a token per position."""
        out = []
        for seq_id, seq_len, row, span in zip(self.seq_ids, self.seq_lens, self.rows,
                                              self.position_rows, strict=True):
            if row is None:
                out.append(ItemOutput(seq_id, None, None, (), seq_len))
                continue
            want_logprob = self.params[row].logprobs
            positions = () if span is None else tuple(
                SampledToken(s.token_ids[r], s.logprobs[r] if want_logprob else None,
                             s.top_logprobs[r], s.target_logprobs[r],
                             _at(s.candidate_logprobs, r), _at(s.hidden_states, r))
                for r in range(span[0], span[0] + span[1]))
            out.append(ItemOutput(seq_id, s.token_ids[row],
                                  s.logprobs[row] if want_logprob else None,
                                  s.top_logprobs[row], seq_len, positions=positions,
                                  candidate_logprobs=_at(s.candidate_logprobs, row),
                                  hidden_state=_at(s.hidden_states, row)))
        return tuple(out)


def _at(per_row: list[_T], row: int) -> _T | tuple[()]:
    """``per_row[row]``, or () when no row asked (an empty list)."""
    return per_row[row] if per_row else ()


#: Spare step events kept for reuse (more than the deepest pipeline needs).
_EVENTS_KEPT = 16


class StepPools:
    """The pinned host buffers and CUDA events launched steps borrow: ``pend`` lends a
    step its buffers and event, the step hands them back when it is done (``recycle``),
    so none is allocated per step. Without a CUDA device a step borrows nothing."""

    def __init__(self, device: torch.device) -> None:
        # NOTE: every step runs on the device's current stream at start-up; events record
        # on it without looking it up per step (that lookup costs more than the record).
        self._stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self._pinned = PinnedPool()
        self._events: deque[torch.cuda.Event] = deque()

    def pend(self, step: PendingStep) -> PendingStep:
        """Start the copies of the step's samples to the host; mark its end on the device."""
        if self._stream is None:
            return step
        for sample in step.samples:
            sample.stage(self._pinned)
        step.done = self._events.pop() if self._events else torch.cuda.Event()
        step.done.record(self._stream)
        step.recycle = self.recycle
        return step

    def recycle(self, step: PendingStep) -> None:
        """A finished or aborted step's buffers and event, back to their pools (any
        thread: deque appends are atomic)."""
        for sample in step.samples:
            sample.release()
        if step.done is not None and len(self._events) < _EVENTS_KEPT:
            self._events.append(step.done)
