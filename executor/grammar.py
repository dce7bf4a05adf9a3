"""Grammars (JSON schema, regex, EBNF) enforced with xgrammar: ``GrammarBook``.

Compiled against the served model's tokenizer (found next to its weights: a
``tokenizer.json`` directory), cached by (kind, text) in a bounded LRU. Each sequence
with a grammar holds a matcher and ``origin``, the position its first output token takes:
the matcher has accepted the sequence's tokens from ``origin`` on, including the last
sampled one, which enters the cache only with the next decode.

A step's mask is the matcher's next-token bitmask (the item's own mask and bias apply
too, from their own tables: ``logit_controls.py``), filled for a batch at once. The
matcher must have accepted the previous step's token first: the mask worker's job reads a
launched step's tokens (waiting for its copy to the host) when a later launch needs its
grammar rows, else ``PendingStep.finish`` does; each step is applied once
(``grammar_flow.py``). See ``docs/sampling.md``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from executor.api import Grammar
from executor.errors import GrammarUnavailable

#: Compiled grammars kept (by kind and text).
CACHE_SIZE = 64


class GrammarError(ValueError):
    """A grammar that does not compile (its message names xgrammar's error)."""


@dataclass
class SeqGrammar:
    grammar: Grammar
    matcher: Any  # xgrammar.GrammarMatcher
    origin: int  # the position of the first output token
    accepted: int = 0  # output tokens the matcher has accepted
    completed: bool = False
    #: The matcher's stop tokens: only accepting one of them can terminate it.
    stops: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not self.stops:
            self.stops = frozenset(self.matcher.stop_token_ids)


def _batch_accept(matchers: list[Any], tokens: list[int]) -> list[bool]:
    """xgrammar's batch accept, its result read whole. (Its Python wrapper reads the result
    one element at a time, two foreign calls each, each releasing and retaking the GIL:
    slower than the accepts, and a convoy with the launching thread. One membership test
    answers the usual case, every token accepted.)"""
    try:
        from xgrammar.base import _core

        result = _core.BatchGrammarMatcher.batch_accept_token(
            [m._handle for m in matchers], tokens, False)
    except (ImportError, AttributeError):  # (another xgrammar layout: its public call)
        import xgrammar as xgr

        return list(xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens))
    if 0 not in result:
        return [True] * len(matchers)
    return [bool(v) for v in result]


class GrammarBook:
    """The compiler, its cache and every sequence's matcher (host state, rank 0)."""

    def __init__(self, tokenizer_info: Callable[[], Any], vocab: int) -> None:
        """``tokenizer_info``: makes the ``xgrammar.TokenizerInfo`` (vocabulary ``vocab``)
        at the first grammar, or raises ``GrammarUnavailable``."""
        self._tokenizer_info, self.vocab = tokenizer_info, vocab
        self._compiler: Any = None
        self._why_not = ""
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.seqs: dict[str, SeqGrammar] = {}
        # xgrammar.BatchGrammarMatcher, single-threaded (its threaded fill starts a new
        # pool of half the host's cores per call: far costlier than a batch's masks)
        self._batch: Any = None
        self._fill: Any = None  # the (rows, words) int32 buffer ``masks`` fills, grown
        self._stop_masks: dict[tuple[int, ...], np.ndarray] = {}
        self._compiling = threading.Lock()

    # -- compiling ---------------------------------------------------------------------
    def compiler(self) -> Any:
        """The xgrammar compiler (made at first use); raises ``GrammarUnavailable``."""
        if self._compiler is None and not self._why_not:
            import xgrammar as xgr

            try:
                info = self._tokenizer_info()
            except GrammarUnavailable as exc:
                self._why_not = str(exc)
            else:
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        if self._compiler is None:
            raise GrammarUnavailable(self._why_not)
        return self._compiler

    def compile(self, grammar: Grammar) -> Any:
        """The compiled grammar (cached); ``GrammarError`` if it does not compile. (The
        launching thread compiles, the mask worker looks up: one at a time.)"""
        with self._compiling:
            return self._compile(grammar)

    def _compile(self, grammar: Grammar) -> Any:
        key = (grammar.kind, grammar.text)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        compiler = self.compiler()
        try:
            if grammar.kind == "json_schema":
                # Compact JSON (fixed separators, no free whitespace): small models
                # otherwise loop on whitespace the grammar allows.
                compiled = compiler.compile_json_schema(grammar.text, any_whitespace=False)
            elif grammar.kind == "regex":
                compiled = compiler.compile_regex(grammar.text)
            else:
                compiled = compiler.compile_grammar(grammar.text)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the reason
            raise GrammarError(f"{grammar.kind} does not compile: {exc}") from exc
        self._cache[key] = compiled
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    # -- sequences -----------------------------------------------------------------------
    def start(self, seq_id: str, grammar: Grammar, origin: int,
              prompt: list[int] | None = None) -> None:
        """A prefill with ``grammar`` for ``seq_id`` whose output begins at ``origin``.
        The same grammar already running on the sequence goes on, accepting ``prompt``
        (tokens the scheduler put in the output); another grammar starts fresh."""
        import xgrammar as xgr

        state = self.seqs.get(seq_id)
        if state is not None and state.grammar == grammar:
            for tok in prompt or ():
                self._accept(state, tok)
            return
        self.seqs[seq_id] = SeqGrammar(grammar, xgr.GrammarMatcher(self.compile(grammar)),
                                       origin)

    def give(self, seq_id: str, token: int, position: int) -> None:
        """A decode gives ``token`` at ``position``: accepted unless it is the last
        sampled token, which the matcher has already."""
        state = self.seqs.get(seq_id)
        if state is not None and state.origin + state.accepted == position:
            self._accept(state, token)

    def advance(self, seq_id: str, token: int) -> bool:
        """The sequence sampled ``token``; returns whether that completed its grammar."""
        state = self.seqs.get(seq_id)
        if state is None or state.completed:
            return False
        self._accept(state, token)
        return state.completed

    def _accept(self, state: SeqGrammar, token: int) -> None:
        if state.completed:
            return
        if state.matcher.accept_token(token):
            state.accepted += 1
            if token in state.stops:  # (a matcher terminates only on a stop token)
                state.completed = bool(state.matcher.is_terminated())

    def advance_rows(self, seq_ids: Sequence[str], tokens: Sequence[int]) -> list[bool]:
        """``advance`` for each pair (distinct sequences) in one call of xgrammar's batch
        accept. Returns, per pair, whether its token completed the sequence's grammar."""
        live = [(i, st, tok) for i, (sid, tok) in enumerate(zip(seq_ids, tokens, strict=True))
                if (st := self.seqs.get(sid)) is not None and not st.completed]
        done = [False] * len(seq_ids)
        if not live:
            return done
        oks = _batch_accept([st.matcher for _, st, _ in live], [tok for _, _, tok in live])
        for (i, st, tok), ok in zip(live, oks, strict=True):
            if ok:
                st.accepted += 1
                if tok in st.stops:  # (a matcher terminates only on a stop token)
                    st.completed = done[i] = bool(st.matcher.is_terminated())
        return done

    def fill(self, seq_ids: Sequence[str | None], out: Any) -> np.ndarray:
        """The next token's mask of each sequence into row r of ``out`` (a host int32
        tensor (rows, words), the bitmask layout), the live matchers' in one batch call
        on this thread; a completed grammar allows only its stop tokens, and a None entry
        or a sequence without a grammar gets all ones. Returns which rows have a mask
        (bool per row). Reads the matchers only: callers keep them from changing."""
        import xgrammar as xgr

        words = (self.vocab + 31) // 32
        rows = out.numpy()
        has = np.zeros(len(seq_ids), dtype=bool)
        live, live_rows = [], []
        for r, seq_id in enumerate(seq_ids):
            st = None if seq_id is None else self.seqs.get(seq_id)
            if st is None:
                rows[r] = -1
            elif st.completed:
                rows[r] = self._stop_mask(tuple(st.matcher.stop_token_ids), words)
                has[r] = True
            else:
                live.append(st.matcher)
                live_rows.append(r)
                has[r] = True
        if live:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(max_threads=1)
            self._batch.batch_fill_next_token_bitmask(live, out, live_rows)
        return has

    def masks(self, seq_ids: Sequence[str | None]) -> list[np.ndarray | None]:
        """``fill``'s masks as (words,) int32 rows (None where a row has none), views of
        one buffer reused by the next call."""
        import xgrammar as xgr

        if self._fill is None or self._fill.shape[0] < len(seq_ids):
            self._fill = xgr.allocate_token_bitmask(max(len(seq_ids), 8), self.vocab)
        has = self.fill(seq_ids, self._fill[: len(seq_ids)])
        rows = self._fill.numpy()
        return [rows[r] if has[r] else None for r in range(len(seq_ids))]

    def _stop_mask(self, stop_ids: tuple[int, ...], words: int) -> np.ndarray:
        mask = self._stop_masks.get(stop_ids)
        if mask is None:
            bits = np.zeros(words * 32, dtype=np.uint8)
            bits[[t for t in stop_ids if t < self.vocab]] = 1
            mask = np.packbits(bits, bitorder="little").view("<i4")
            mask.flags.writeable = False
            self._stop_masks[stop_ids] = mask
        return mask

    def allowed_next(self, seq_id: str, grammar: Grammar, tokens: Sequence[int] = (),
                     fresh: bool = False) -> np.ndarray:
        """(vocab,) bool: what ``seq_id``'s matcher allows after accepting ``tokens``, or
        with ``fresh``, or without a matcher, ``grammar``'s start allows (only stop tokens
        once complete). Changes nothing: a matcher that would accept tokens is forked."""
        import xgrammar as xgr

        state = None if fresh else self.seqs.get(seq_id)
        if state is None:
            matcher, completed = xgr.GrammarMatcher(self.compile(grammar)), False
        else:
            matcher = state.matcher.fork() if tokens else state.matcher
            completed = state.completed
        for tok in tokens:
            if not completed and matcher.accept_token(tok):
                completed = bool(matcher.is_terminated())
        allowed = np.zeros(self.vocab, dtype=bool)
        if completed:
            allowed[[t for t in matcher.stop_token_ids if t < self.vocab]] = True
            return allowed
        buf = xgr.allocate_token_bitmask(1, self.vocab)
        matcher.fill_next_token_bitmask(buf)
        bits = np.unpackbits(buf.numpy()[0].astype("<i4").view(np.uint8), bitorder="little")
        return bits[: self.vocab].astype(bool)

    def fork(self, parent: str, child: str, length: int, inherits: bool) -> None:
        """The child shares the parent's first ``length`` tokens (and its last sample when
        ``inherits``): its matcher is the parent's, rolled back past them."""
        state = self.seqs.get(parent)
        if state is None:
            return
        keep = max(0, length - state.origin + (1 if inherits else 0))
        if keep == 0 and length < state.origin:
            return
        matcher = state.matcher.fork()
        copy = SeqGrammar(state.grammar, matcher, state.origin, state.accepted,
                          state.completed)
        self._rollback(copy, keep)
        self.seqs[child] = copy

    def truncate(self, seq_id: str, length: int) -> None:
        """The sequence keeps ``length`` tokens: its matcher forgets the outputs past
        them (all of its grammar when ``length`` is before its output began)."""
        state = self.seqs.get(seq_id)
        if state is None:
            return
        if length < state.origin:
            del self.seqs[seq_id]
            return
        self._rollback(state, length - state.origin)

    def _rollback(self, state: SeqGrammar, keep: int) -> None:
        drop = state.accepted - keep
        if drop > 0:
            state.matcher.rollback(drop)
            state.accepted = keep
            state.completed = bool(state.matcher.is_terminated())

    def release(self, seq_id: str) -> None:
        self.seqs.pop(seq_id, None)
