"""A synthetic tokenizer for grammars on random-weight models (which ship none).

Token 0 is the stop token; then every printable ASCII character, JSON fragments and
digit pairs, then pseudo-random 2-4 letter pieces up to the model's vocabulary: enough for
xgrammar to compile JSON schemas, regexes and EBNF against, with masks as dense as a real
BPE vocabulary's.
"""

from __future__ import annotations

import random
import string
from typing import Any

STOP = 0
FRAGMENTS = ['{"', '"}', '":', '": ', '", "', ', "', "true", "false", "null", "[", "]",
             '["', '"]', "},", "{}", "[]", "\n", "  "]


def synthetic_vocab(vocab: int, seed: int = 0) -> list[str]:
    pieces = ["</s>", *string.printable[:95], *FRAGMENTS,
              *(f"{a}{b}" for a in string.digits for b in string.digits)]
    rng = random.Random(seed)
    seen = set(pieces)
    while len(pieces) < vocab:
        piece = "".join(rng.choice(string.ascii_lowercase + " ")
                        for _ in range(rng.randint(2, 4)))
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
    return pieces[:vocab]


def synthetic_tokenizer_info(vocab: int) -> Any:
    """``xgrammar.TokenizerInfo`` over ``synthetic_vocab(vocab)`` (stop token 0)."""
    import xgrammar as xgr

    return xgr.TokenizerInfo(synthetic_vocab(vocab), xgr.VocabType.RAW, vocab_size=vocab,
                             stop_token_ids=[STOP])


def use_synthetic_tokenizer(executor: Any) -> None:
    """Grammars on ``executor`` (an ``Executor``) compile against the synthetic vocabulary."""
    from executor.grammar import GrammarBook

    vocab = executor.limits.vocab_size
    executor.grammars.book = GrammarBook(lambda: synthetic_tokenizer_info(vocab), vocab)
