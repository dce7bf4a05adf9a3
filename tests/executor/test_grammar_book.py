"""``GrammarBook`` on a synthetic vocabulary: masks follow the matcher, completion at the
stop token, a completed grammar allows only stop tokens, Fork copies and Truncate rolls
back by positions, a given token is accepted once, ``allowed_next`` looks ahead without
changing a matcher, the compile cache is bounded, and a bad grammar names xgrammar's
error."""

from __future__ import annotations

import numpy as np
import pytest

from bench.common.grammar_vocab import STOP, synthetic_tokenizer_info, synthetic_vocab
from executor import grammar as grammar_module
from executor.api import Grammar
from executor.errors import GrammarUnavailable
from executor.grammar import GrammarBook, GrammarError
from executor.logit_controls import bitmask_allows

pytest.importorskip("xgrammar")
V = 400
VOCAB = synthetic_vocab(V)
G = Grammar("regex", "(ab|cd)x")


def book() -> GrammarBook:
    return GrammarBook(lambda: synthetic_tokenizer_info(V), V)


def allowed(b: GrammarBook, seq: str) -> set[str]:
    [mask] = b.masks([seq])
    assert mask is not None
    return {VOCAB[t] for t in np.flatnonzero(bitmask_allows(mask, V))}


def tok(piece: str) -> int:
    return VOCAB.index(piece)


def test_masks_follow_the_matcher_to_completion() -> None:
    b = book()
    b.start("s", G, origin=10)
    first = allowed(b, "s")
    assert {"a", "c"} <= first and "x" not in first and "</s>" not in first
    assert not b.advance("s", tok("a"))
    assert allowed(b, "s") == {"b"}
    b.advance("s", tok("b"))
    b.advance("s", tok("x"))
    assert allowed(b, "s") == {"</s>"}
    assert b.advance("s", STOP)  # the stop token completes it
    assert allowed(b, "s") == {"</s>"}  # completed: only stop tokens
    assert b.masks([None, "unknown"]) == [None, None]


def test_fork_and_truncate_by_position() -> None:
    b = book()
    b.start("p", G, origin=10)
    for piece in ("c", "d"):
        b.advance("p", tok(piece))
    # The child shares 11 tokens (positions 10: "c"), not the last sample at 11 ("d").
    b.fork("p", "kid", 11, inherits=False)
    assert allowed(b, "kid") == {"d"}
    b.fork("p", "twin", 12, inherits=True)  # all of it and the last sample
    assert allowed(b, "twin") == {"x"}
    assert allowed(b, "p") == {"x"}  # the parent is untouched
    b.truncate("p", 10)  # back to the origin: nothing of the output is kept
    assert {"a", "c"} <= allowed(b, "p")
    # A decode giving the token at position 10 feeds it; the same again does not.
    b.give("p", tok("a"), 10)
    b.give("p", tok("a"), 10)
    assert allowed(b, "p") == {"b"}
    b.truncate("p", 5)  # before the output began: the grammar is gone
    assert b.masks(["p"]) == [None]


def test_advance_rows_accepts_per_row_and_reports_completion() -> None:
    b = book()
    for s in ("p", "q", "r"):
        b.start(s, G, origin=0)
    b.advance("r", tok("a"))
    b.advance("r", tok("b"))
    b.advance("r", tok("x"))
    # "q" gets a token its grammar rejects: it stays where it was, the others move.
    assert b.advance_rows(["p", "q", "r"], [tok("c"), tok("x"), STOP]) == [False, False, True]
    assert [b.seqs[s].accepted for s in ("p", "q", "r")] == [1, 0, 4]
    assert allowed(b, "p") == {"d"} and {"a", "c"} <= allowed(b, "q")
    assert b.advance_rows(["p", "q"], [tok("d"), tok("a")]) == [False, False]
    assert [b.seqs[s].accepted for s in ("p", "q")] == [2, 1]


def test_prefill_continues_the_same_grammar_and_restarts_another() -> None:
    b = book()
    b.start("s", G, origin=3)
    b.start("s", G, origin=4, prompt=[tok("a")])  # the scheduler forced "a" into the output
    assert allowed(b, "s") == {"b"}
    b.start("s", Grammar("regex", "z+"), origin=9)
    assert allowed(b, "s") == {"z"} | {p for p in VOCAB if set(p) == {"z"}}


def test_allowed_next_looks_ahead_without_moving_the_matcher() -> None:
    b = book()

    def names(allowed: np.ndarray) -> set[str]:
        return {VOCAB[t] for t in np.flatnonzero(allowed)}

    assert {"a", "c"} <= names(b.allowed_next("new", G))  # no matcher: the start
    b.start("s", G, origin=0)
    b.advance("s", tok("a"))
    assert names(b.allowed_next("s", G)) == {"b"}
    assert names(b.allowed_next("s", G, [tok("b")])) == {"x"}
    assert names(b.allowed_next("s", G, [tok("b"), tok("x"), STOP])) == {"</s>"}
    assert {"a", "c"} <= names(b.allowed_next("s", G, fresh=True))
    assert allowed(b, "s") == {"b"}  # the matcher did not move
    assert b.seqs["s"].accepted == 1


def test_compile_errors_cache_and_no_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    b = book()
    with pytest.raises(GrammarError, match="regex does not compile"):
        b.compile(Grammar("regex", "(unclosed"))
    monkeypatch.setattr(grammar_module, "CACHE_SIZE", 2)
    for k in range(4):
        b.compile(Grammar("regex", f"a{{{k + 1}}}"))
    assert len(b._cache) == 2

    def missing() -> object:
        raise GrammarUnavailable("no tokenizer here")

    with pytest.raises(GrammarUnavailable, match="no tokenizer here"):
        GrammarBook(missing, V).compile(G)
