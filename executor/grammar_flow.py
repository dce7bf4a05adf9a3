"""``GrammarFlow``: grammar items through the executor's calls (``grammar.py`` holds the
matchers).

Validation compiles every grammar of a call (INVALID_ARGUMENT naming the item) before
anything is allocated. A launch's grammar masks are jobs of the mask worker
(``mask_worker.py``), made from matchers that have accepted every earlier token: a job
first applies the steps launched before it (``catch_up``: waits for their tokens), and a
multi-step decode's job for step k applies step k - 1's tokens. Each launched step's
tokens are applied exactly once, by a later job or by the step's completion, under one
lock (completion may run on another thread); the launching thread waits for the queued
jobs (``settle``) before it reads or changes matchers itself. An item's own mask must
leave a token its grammar allows: checked at admission for each call's first sampled step
(``check_own_masks``), and for a multi-step decode's later steps as their masks are made
(the item's output ends before such a step).

A job fills its masks outside that lock, so a step's completion waits for the job's
accepts only. Nothing changes the matchers meanwhile: the completion of a step whose
tokens were applied changes nothing, a later step's tokens need this job's masks first,
and the launching thread's own changes wait for the queued jobs (``settle``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from executor.api import BatchNeeds, DecodeItem, PrefillItem, SamplingParams
from executor.errors import FieldViolation, GrammarUnavailable, InvalidRequest
from executor.forward import HostTokens, LateMasks
from executor.grammar import GrammarBook, GrammarError
from executor.logit_controls import bitmask_allows
from executor.mask_worker import MaskWorker
from executor.sampling import SampleOutput
from executor.steps import PendingStep


def served_tokenizer(source: str, vocab: int) -> Callable[[], Any]:
    """The served model's tokenizer as xgrammar's ``TokenizerInfo``, found next to its
    weights at the first grammar (a directory with ``tokenizer.json``: HF checkpoints and
    the named models' conversions); ``GrammarUnavailable`` without one."""
    def make() -> Any:
        import xgrammar as xgr

        from executor.weights.catalog import resolve_model_source

        directory = Path(resolve_model_source(source))
        if not (directory / "tokenizer.json").is_file():
            raise GrammarUnavailable(
                f"the served model ({source}) has no tokenizer (tokenizer.json next to its "
                "weights) to compile grammars against")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    return make


class GrammarFlow:
    def __init__(self, book: GrammarBook, worker: MaskWorker) -> None:
        self.book = book
        self.worker = worker  # runs the masks' jobs (``LateMasks``) off this thread
        self._lock = threading.Lock()
        # Launched steps with grammar rows, numbered in launch order: a launch's masks
        # catch up only with the steps launched before it (the worker may run them after
        # later steps were tracked: waiting for one of those would never end).
        self._pending: deque[tuple[int, PendingStep]] = deque()
        self._tracked = 0

    # -- validation ----------------------------------------------------------------------
    def validate(self, items: Sequence[PrefillItem | DecodeItem]) -> None:
        """Compile the items' grammars (cached); ``InvalidRequest`` naming each that does
        not compile, ``GrammarUnavailable`` without a tokenizer."""
        out = []
        for i, it in enumerate(items):
            g = it.sampling.grammar
            if g is None:
                continue
            if isinstance(it, PrefillItem) and it.every_position:
                out.append(FieldViolation(f"items[{i}].sampling.grammar",
                                          "a grammar cannot be used with every_position"))
                continue
            try:
                self.book.compile(g)
            except GrammarError as exc:
                out.append(FieldViolation(f"items[{i}].sampling.grammar.{g.kind}", str(exc)))
        if out:
            raise InvalidRequest(out)

    def check_own_masks(self, items: Sequence[PrefillItem | DecodeItem],
                        length: Callable[[str], int | None]) -> None:
        """``InvalidRequest`` naming each sampled item whose own ``allowed_token_bitmask``
        allows none of the tokens its grammar allows at its first sampled position: a
        prefill's after its tokens (its grammar's start unless the same grammar runs on
        the sequence), a decode's after its given token. Applies launched steps' tokens
        first (a host wait) when such an item continues a matcher."""
        both = [(i, it) for i, it in enumerate(items) if it.sampling.grammar is not None
                and it.sampling.allowed_token_bitmask is not None
                and (not isinstance(it, PrefillItem) or it.sample)]
        if not both:
            return
        self.settle()
        out = []
        with self._lock:
            for i, it in both:
                g, own = it.sampling.grammar, it.sampling.allowed_token_bitmask
                assert g is not None and own is not None
                state = self.book.seqs.get(it.seq_id)
                if isinstance(it, PrefillItem):
                    fresh = state is None or state.grammar != g
                    allowed = self.book.allowed_next(it.seq_id, g, () if fresh else
                                                     it.token_ids, fresh)
                elif state is None:
                    continue  # (no matcher: the grammar masks nothing)
                else:  # a given token the matcher lacks goes first (as ``give`` does)
                    tok = it.token_id
                    ahead = () if tok is None or \
                        state.origin + state.accepted != length(it.seq_id) else (tok,)
                    allowed = self.book.allowed_next(it.seq_id, g, ahead)
                if not (allowed & bitmask_allows(own, self.book.vocab)).any():
                    ids = [int(t) for t in allowed.nonzero()[0][:5]]
                    out.append(FieldViolation(
                        f"items[{i}].sampling.allowed_token_bitmask",
                        f"allows none of the {int(allowed.sum())} tokens its grammar "
                        f"({g.kind}) allows next (token ids {ids}"
                        f"{', ...' if allowed.sum() > len(ids) else ''})"))
        if out:
            raise InvalidRequest(out)

    # -- launches --------------------------------------------------------------------------
    def prefill_masks(self, items: Sequence[PrefillItem], rows: list[int],
                      seq_lens: Sequence[int]) -> LateMasks | None:
        """The grammar masks of a prefill's sampled rows, as ``Forward.prefill`` asks for
        them (once its forward is launched): the items' matchers start, or go on, first."""
        if not any(items[i].sampling.grammar is not None for i in rows):
            return None
        before = self._tracked

        def masks(step: int, previous: HostTokens | None, out: torch.Tensor) -> np.ndarray:
            self.catch_up(before)  # (a prefill's own rows have no launched steps pending)
            with self._lock:
                for i in rows:
                    it = items[i]
                    if it.sampling.grammar is not None:
                        self.book.start(it.seq_id, it.sampling.grammar, seq_lens[i],
                                        list(it.token_ids))
            return self.book.fill([items[i].seq_id if items[i].sampling.grammar
                                   is not None else None for i in rows], out)
        return masks

    def decode_masks(self, seq_ids: Sequence[str], tokens: Sequence[int | None],
                     params: Sequence[SamplingParams], length: Callable[[str], int | None],
                     done: dict[int, int], dead_ends: dict[int, int], needs: BatchNeeds
                     ) -> LateMasks | None:
        """The grammar masks of a decode's device steps, as ``Forward.decode`` asks for
        them (None without grammar items). Step 0 first applies every launched step
        (``catch_up``) and a given token (unless it is the sampled one the matcher has);
        step k first applies step k - 1's samples (a host wait for them: the device runs
        step k's forward meanwhile). Completions go to ``done`` (row: device step); a row
        whose own mask leaves none of the tokens its grammar allows at step k (k > 0: step
        0 is checked at admission) goes to ``dead_ends`` (row: k - 1, its last valid
        step). Call it before the decode's allocation (the given tokens' positions)."""
        if not needs.grammar:
            return None
        positions = [length(s) or 0 for s in seq_ids]
        grammar_rows = [s if p.grammar is not None else None
                        for s, p in zip(seq_ids, params, strict=True)]
        grammar_row_ids = [row for row, s in enumerate(grammar_rows) if s is not None]
        vocab = self.book.vocab
        # Rows with both a grammar and their own mask: (row, the tokens the mask allows).
        own = [(row, bitmask_allows(p.allowed_token_bitmask, vocab))
               for row, p in enumerate(params) if p.grammar is not None
               and p.allowed_token_bitmask is not None] if needs.controls else []
        before = self._tracked

        def masks(step: int, previous: HostTokens | None, out: torch.Tensor) -> np.ndarray:
            if step == 0:
                self.catch_up(before)
            sampled = previous() if step and previous is not None else None
            with self._lock:
                if sampled is not None:  # (past its output's end, a matcher stays there)
                    rows_on = [row for row in grammar_row_ids
                               if dead_ends.get(row, step) >= step - 1]
                    ends = self.book.advance_rows([seq_ids[r] for r in rows_on],
                                                  [sampled[r] for r in rows_on])
                    for row, ended in zip(rows_on, ends, strict=True):
                        if ended and row not in done:
                            done[row] = step - 1
                else:
                    for row in grammar_row_ids:
                        if tokens[row] is not None:
                            self.book.give(seq_ids[row], tokens[row], positions[row])  # type: ignore[arg-type]
            has = self.book.fill(grammar_rows, out)  # (outside the lock: see the docstring)
            rows = out.numpy()
            for row, allows in own if step else ():
                if row in done or row in dead_ends or not has[row]:
                    continue
                if not (bitmask_allows(rows[row], vocab) & allows).any():
                    dead_ends[row] = step - 1
            return has
        return masks

    def track(self, step: PendingStep, applied: int) -> None:
        """A launched step with grammar rows whose first ``applied`` device steps were
        applied already (or are, by its own masks' jobs): the rest is applied by a later
        ``catch_up`` or at its completion."""
        step.grammar_applied = applied
        step.on_sampled = self.apply
        self._pending.append((self._tracked, step))
        self._tracked += 1

    def catch_up(self, before: int | None = None) -> None:
        """Apply the remaining tokens of every launched step (of those tracked before
        ``before``: numbers from ``_tracked``), waiting for their copies. Under the lock
        that the step's completion takes to apply them: a step is read here only while
        its completion has not applied it (nor handed its buffers back)."""
        while self._pending and (before is None or self._pending[0][0] < before):
            _, step = self._pending.popleft()
            with self._lock:
                if step.grammar_applied < len(step.samples):
                    self._advance(step, step.wait())

    def settle(self) -> None:
        """Every queued mask job done and every launched step applied: the matchers hold
        every sampled token (before the host reads or changes them)."""
        self.worker.drain()
        self.catch_up()

    def release(self, seq_id: str) -> None:
        self.worker.drain()  # (no queued job may find its matcher gone)
        self.book.release(seq_id)

    def apply(self, step: PendingStep, sampled: list[SampleOutput]) -> None:
        """Advance the matchers of ``step``'s grammar rows by its samples (once); raises
        the error of a mask job that failed (the step's masks may be missing)."""
        self.worker.raise_failure()
        if step.grammar_applied >= len(sampled):
            return  # (a mask job applied them: it sets the count after the matchers)
        with self._lock:
            self._advance(step, sampled)

    def _advance(self, step: PendingStep, sampled: list[SampleOutput]) -> None:
        ends = step.grammar_dead_ends
        rows = [(seq_id, row) for seq_id, row in zip(step.seq_ids, step.rows, strict=True)
                if row is not None and step.params[row].grammar is not None]
        for k in range(step.grammar_applied, len(sampled)):
            on = [(seq_id, row) for seq_id, row in rows if ends.get(row, k) >= k]
            completed = self.book.advance_rows([seq_id for seq_id, _ in on],
                                               [sampled[k].token_ids[row] for _, row in on])
            for (_, row), ended in zip(on, completed, strict=True):
                if ended and row not in step.grammar_done:
                    step.grammar_done[row] = k
        # (last: ``apply`` reads it without the lock)
        step.grammar_applied = max(step.grammar_applied, len(sampled))

    def forget(self, step: PendingStep) -> None:
        """An aborted step: nothing of it is applied later."""
        with self._lock:
            step.grammar_applied = len(step.samples)
