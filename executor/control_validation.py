"""Validation of the sampling controls and extra outputs (``docs/sampling.md``).

Pure functions over one item's ``SamplingParams``; ``validation.py`` calls them for items
that use any of these fields, before anything is allocated.
"""

from __future__ import annotations

import math

from executor.api import MAX_CANDIDATE_TOKENS, MAX_LOGIT_BIAS, SamplingParams
from executor.errors import FieldViolation
from executor.logit_controls import bitmask_allows_any, mask_words


def control_violations(p: SamplingParams, item: str, vocab: int) -> list[FieldViolation]:
    """Everything wrong with ``p``'s mask, bias, mode and extra outputs; ``item`` is the
    item's field path (``items[3]``): the sampling fields are under ``item.sampling``,
    the outputs are the item's own fields."""
    out: list[FieldViolation] = []
    field = f"{item}.sampling"
    mask = p.allowed_token_bitmask
    if mask is not None:
        want = mask_words(vocab) * 4
        if len(mask) != want:
            out.append(FieldViolation(
                f"{field}.allowed_token_bitmask",
                f"must be {want} bytes (ceil({vocab} / 32) = {want // 4} little-endian int32 "
                f"words, bit j of word i allows token 32 i + j), got {len(mask)}"))
        elif not bitmask_allows_any(mask, vocab):
            out.append(FieldViolation(
                f"{field}.allowed_token_bitmask",
                f"allows no token of the vocabulary [0, {vocab}) (bits past token "
                f"{vocab - 1} are ignored)"))
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        out.append(FieldViolation(f"{field}.logit_bias",
                                  f"at most {MAX_LOGIT_BIAS} entries, got {len(p.logit_bias)}"))
    for tok, bias in p.logit_bias:
        if not 0 <= tok < vocab:
            out.append(FieldViolation(f"{field}.logit_bias[{tok}]",
                                      f"token id {tok} is outside the vocabulary [0, {vocab})"))
        elif not math.isfinite(bias):
            out.append(FieldViolation(f"{field}.logit_bias[{tok}]",
                                      f"must be a finite number, got {bias}"))
    if p.logprobs_mode not in ("raw", "processed"):
        out.append(FieldViolation(f"{field}.logprobs_mode",
                                  f"must be raw or processed, got {p.logprobs_mode!r}"))
    cands = p.candidate_token_ids
    if len(cands) > MAX_CANDIDATE_TOKENS:
        out.append(FieldViolation(f"{item}.candidate_token_ids",
                                  f"at most {MAX_CANDIDATE_TOKENS} ids, got {len(cands)}"))
    for k, tok in enumerate(cands):
        if not 0 <= tok < vocab:
            out.append(FieldViolation(f"{item}.candidate_token_ids[{k}]",
                                      f"token id {tok} is outside the vocabulary [0, {vocab})"))
            break
    return out


def uses_controls(p: SamplingParams) -> bool:
    """Whether ``control_violations`` has anything to check."""
    return p.has_controls or p.wants_extras
