"""Request validation: pure functions over the items and the sequence table.

Everything is checked before anything is allocated, and every violation is reported
(not only the first) with the field path a client sent, e.g. ``items[2].token_ids[7]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from executor.api import (
    GREEDY_BELOW_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    DecodeItem,
    PrefillItem,
    SamplingParams,
)
from executor.control_validation import control_violations, uses_controls
from executor.errors import ContextLengthExceeded, FieldViolation, InvalidRequest, SequenceNotFound

#: From this many items, decode validation first tries one pass over the batch's columns
#: (its fixed cost is more than the item loop's below it).
_BATCH_PASS_MIN_ITEMS = 16
#: Most decode steps one call may run (``num_steps``).
MAX_DECODE_STEPS = 256
#: Most positions one prefill call may sample at with ``every_position``: their float32
#: logits are held at once (1024 rows of a 128k vocabulary: 0.5 GB).
MAX_POSITION_ROWS = 1024
#: Most top log-probabilities one prefill call may return over its positions.
MAX_POSITION_TOP_LOGPROBS = 8192


@dataclass(frozen=True)
class Limits:
    """What a call may ask for. ``kv_tokens`` is the KV pool's size (None: unbounded): a
    sequence longer than the pool, or a call needing more tokens than the pool holds, can
    never fit, so it is INVALID_ARGUMENT (do not retry), not RESOURCE_EXHAUSTED (retry)."""

    vocab_size: int
    max_context: int
    max_prefill_tokens: int
    max_decode_batch: int
    kv_tokens: int | None = None

    @property
    def servable_context(self) -> int:
        """The longest sequence that can ever be served: max_context, or the pool if less."""
        if self.kv_tokens is None:
            return self.max_context
        return min(self.max_context, self.kv_tokens)

    def context_limit_text(self) -> str:
        """The limit as Health reports it (``model.max_context`` is the servable context)."""
        if self.servable_context == self.max_context:
            return f"max_context is {self.max_context}"
        return (f"max_context is {self.servable_context}: the KV pool holds "
                f"{self.kv_tokens} tokens in all")


def sampling_violations(p: SamplingParams, field: str) -> list[FieldViolation]:
    out = []

    def bad(name: str, why: str) -> None:
        out.append(FieldViolation(f"{field}.{name}", why))

    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        bad("temperature", f"must be a finite number >= 0 (0, or under "
            f"{GREEDY_BELOW_TEMPERATURE:g}, = greedy), got {p.temperature}")
    if p.top_k < 0:
        bad("top_k", f"must be >= 0 (0 = off), got {p.top_k}")
    if not (0.0 < p.top_p <= 1.0):
        bad("top_p", f"must be in (0, 1] (1 or unset = off), got {p.top_p}")
    if not (0.0 <= p.min_p <= 1.0):
        bad("min_p", f"must be in [0, 1] (0 = off), got {p.min_p}")
    if not (0 <= p.top_logprobs <= MAX_TOP_LOGPROBS):
        bad("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs}")
    if p.seed is not None and not (0 <= p.seed < 2**64):
        bad("seed", f"must be in [0, 2**64), got {p.seed}")
    return out


def _common(seq_ids: Sequence[str], what: str) -> list[FieldViolation]:
    out: list[FieldViolation] = []
    if not seq_ids:
        out.append(FieldViolation("items", f"must contain at least one {what} item"))
    first: dict[str, int] = {}
    for i, sid in enumerate(seq_ids):
        if not sid:
            out.append(FieldViolation(f"items[{i}].seq_id", "must be a non-empty string"))
        elif sid in first:
            out.append(FieldViolation(
                f"items[{i}].seq_id",
                f"{sid!r} appears more than once in one call (also items[{first[sid]}])"))
        else:
            first[sid] = i
    return out


def _outside(token: int, vocab: int) -> str:
    return f"token id {token} is outside the vocabulary [0, {vocab})"


def _token_violation(token: int, field: str, vocab: int) -> FieldViolation | None:
    if 0 <= token < vocab:
        return None
    return FieldViolation(field, _outside(token, vocab))


def validate_prefill(items: Sequence[PrefillItem], seq_len: Callable[[str], int | None],
                     limits: Limits) -> None:
    """Raise InvalidRequest / ContextLengthExceeded; ``seq_len`` gives a known id's length."""
    out = _common([it.seq_id for it in items], "prefill")
    total = 0
    too_long: list[FieldViolation] = []
    for i, it in enumerate(items):
        n = len(it.token_ids)
        total += n
        if n == 0:
            out.append(FieldViolation(f"items[{i}].token_ids", "must contain at least one token"))
        # min/max run in C; the per-token loop runs only to name the first bad token
        # (a Python loop over every token of a long prompt costs more than the check).
        if n and not (min(it.token_ids) >= 0 and max(it.token_ids) < limits.vocab_size):
            for k, tok in enumerate(it.token_ids):
                v = _token_violation(tok, f"items[{i}].token_ids[{k}]", limits.vocab_size)
                if v is not None:
                    out.append(v)
                    break  # one per item is enough to act on
        out.extend(sampling_violations(it.sampling, f"items[{i}].sampling"))
        if uses_controls(it.sampling):
            out.extend(control_violations(it.sampling, f"items[{i}]", limits.vocab_size))
        cached = seq_len(it.seq_id) or 0
        if cached + n > limits.servable_context:
            too_long.append(FieldViolation(
                f"items[{i}].token_ids",
                f"sequence {it.seq_id!r} would reach {cached + n} tokens ({cached} cached + "
                f"{n} new); {limits.context_limit_text()}"))
    out.extend(_every_position_violations(items))
    if total > limits.max_prefill_tokens:
        out.append(FieldViolation(
            "items", f"{total} tokens in one call; at most {limits.max_prefill_tokens} "
            "(split the prompt into chunks)"))
    elif limits.kv_tokens is not None and total > limits.kv_tokens and not too_long:
        too_long.append(FieldViolation(
            "items", f"{total} tokens in one call; the KV pool holds {limits.kv_tokens} in "
            "all, so the call can never fit (send fewer sequences per call)"))
    if out:
        raise InvalidRequest(out + too_long)
    if too_long:
        raise ContextLengthExceeded(too_long)


def _every_position_violations(items: Sequence[PrefillItem]) -> list[FieldViolation]:
    """``every_position`` needs ``sample``, and a call's positions and their top
    log-probabilities are bounded."""
    out: list[FieldViolation] = []
    rows = tops = 0
    for i, it in enumerate(items):
        if not it.every_position:
            continue
        if not it.sample:
            out.append(FieldViolation(f"items[{i}].every_position",
                                      "needs sample: it samples at every new position"))
        rows += len(it.token_ids)
        tops += len(it.token_ids) * it.sampling.top_logprobs
    if rows > MAX_POSITION_ROWS:
        out.append(FieldViolation(
            "items", f"{rows} every_position tokens in one call; at most "
            f"{MAX_POSITION_ROWS} (send the rest in the next call)"))
    if tops > MAX_POSITION_TOP_LOGPROBS:
        out.append(FieldViolation(
            "items", f"every_position items ask for {tops} top log-probabilities in all "
            f"(tokens x top_logprobs); at most {MAX_POSITION_TOP_LOGPROBS}"))
    return out


def validate_decode(items: Sequence[DecodeItem], seq_len: Callable[[str], int | None],
                    limits: Limits, num_steps: int = 1,
                    has_last_sample: Callable[[str], bool] = lambda _: False) -> None:
    """Raise InvalidRequest / ContextLengthExceeded / SequenceNotFound. ``num_steps``
    decode steps append that many tokens per sequence; an item without a token needs
    ``has_last_sample`` of its sequence."""
    if len(items) >= _BATCH_PASS_MIN_ITEMS and _plainly_valid_decode(
            items, seq_len, limits, num_steps, has_last_sample):
        return
    out = _common([it.seq_id for it in items], "decode")
    if len(items) > limits.max_decode_batch:
        out.append(FieldViolation(
            "items", f"{len(items)} sequences in one call; at most {limits.max_decode_batch}"))
    if not 1 <= num_steps <= MAX_DECODE_STEPS:
        out.append(FieldViolation(
            "num_steps", f"must be in [1, {MAX_DECODE_STEPS}] (0 or unset = 1), got {num_steps}"))
    unknown: list[tuple[str, str]] = []
    too_long: list[FieldViolation] = []
    # Checked once per distinct parameter object: a batch usually shares a few of them
    # (keyed by identity: hashing a frozen dataclass per item costs more than the check).
    sampling_ok: dict[int, bool] = {}
    vocab, room = limits.vocab_size, limits.servable_context - num_steps
    for i, it in enumerate(items):
        cached = seq_len(it.seq_id)
        token = it.token_id
        if token is not None:
            if not 0 <= token < vocab:  # checked inline: this loop runs per decode step
                out.append(FieldViolation(f"items[{i}].token_id", _outside(token, vocab)))
        elif cached is not None and not has_last_sample(it.seq_id):
            out.append(FieldViolation(
                f"items[{i}].use_last_sampled",
                f"sequence {it.seq_id!r} has no sampled token to continue from (its last step "
                "did not sample, or was rolled back); give its token_id"))
        if it.stop_token_ids:
            for k, tok in enumerate(it.stop_token_ids):
                v = _token_violation(tok, f"items[{i}].stop_token_ids[{k}]", vocab)
                if v is not None:
                    out.append(v)
        ok = sampling_ok.get(id(it.sampling))
        if ok is None:
            ok = sampling_ok[id(it.sampling)] = not sampling_violations(it.sampling, "")
        if not ok:
            out.extend(sampling_violations(it.sampling, f"items[{i}].sampling"))
        if uses_controls(it.sampling):
            out.extend(control_violations(it.sampling, f"items[{i}]", vocab))
        if cached is None:
            if it.seq_id:
                unknown.append((it.seq_id, f"items[{i}].seq_id"))
        elif cached > room:
            # The field to change: num_steps when one step would still fit, else the item.
            field = ("num_steps" if cached < limits.servable_context and num_steps > 1 else
                     f"items[{i}].token_id" if token is not None else
                     f"items[{i}].use_last_sampled")
            too_long.append(FieldViolation(
                field,
                f"sequence {it.seq_id!r} already holds {cached} tokens; "
                f"{limits.context_limit_text()}" + (f" ({num_steps} decode steps asked)"
                                                    if num_steps > 1 else "")))
    if out:
        raise InvalidRequest(out + too_long)
    if unknown:
        raise SequenceNotFound([s for s, _ in unknown], [f for _, f in unknown])
    if too_long:
        raise ContextLengthExceeded(too_long)


def _plainly_valid_decode(items: Sequence[DecodeItem], seq_len: Callable[[str], int | None],
                          limits: Limits, num_steps: int,
                          has_last_sample: Callable[[str], bool]) -> bool:
    """Whether ``validate_decode`` would find nothing wrong, decided over the batch's
    columns with C-level passes (no per-item Python for the common step: known, distinct
    ids continuing from their last samples, shared sampling parameters). False means only
    "look item by item": the full pass then names every violation, or finds none."""
    n = len(items)
    if not 1 <= n <= limits.max_decode_batch or not 1 <= num_steps <= MAX_DECODE_STEPS:
        return False
    seq_ids, tokens, samplings, stops = zip(*items, strict=True)
    distinct = dict(zip(map(id, samplings), samplings, strict=True)).values()
    if any(map(uses_controls, distinct)):
        return False
    if not all(seq_ids) or len(set(seq_ids)) != n:  # empty or repeated ids
        return False
    lengths = list(map(seq_len, seq_ids))
    if None in lengths or max(cast("list[int]", lengths)) > limits.servable_context - num_steps:
        return False
    vocab = limits.vocab_size
    if tokens.count(None) == n:  # every item continues from its last sample
        if not all(map(has_last_sample, seq_ids)):
            return False
    else:
        if not all(has_last_sample(sid) for sid, t in zip(seq_ids, tokens, strict=True)
                   if t is None):
            return False
        given = [t for t in tokens if t is not None]
        if min(given) < 0 or max(given) >= vocab:
            return False
    if any(stops) and not all(not s or (min(s) >= 0 and max(s) < vocab) for s in stops):
        return False
    # Each distinct parameter object once (by identity, as the full pass).
    return not any(sampling_violations(p, "") for p in distinct)


def validate_fork(parent_id: str, child_id: str, prefix_len: int | None,
                  seq_len: Callable[[str], int | None]) -> int:
    """The length a fork of ``parent_id`` into ``child_id`` shares (``prefix_len``, by
    default all of the parent). Raises ``SequenceNotFound`` for an unknown parent and
    ``InvalidRequest`` for a child id in use or a prefix outside ``[0, parent length]``."""
    parent_len = seq_len(parent_id)
    if parent_len is None:
        raise SequenceNotFound([parent_id], ["parent_seq_id"])
    violations = []
    if seq_len(child_id) is not None:
        violations.append(FieldViolation(
            "child_seq_id", f"sequence {child_id!r} already exists; a fork needs a new "
            "id (release it first to reuse the id)"))
    length = parent_len if prefix_len is None else prefix_len
    if not 0 <= length <= parent_len:
        violations.append(FieldViolation(
            "prefix_len", f"must be in [0, {parent_len}] (sequence {parent_id!r} "
            f"holds {parent_len} tokens), got {length}"))
    if violations:
        raise InvalidRequest(violations)
    return length


def validate_truncate(seq_id: str, length: int, seq_len: Callable[[str], int | None]) -> None:
    """Raises ``SequenceNotFound`` for an unknown sequence and ``InvalidRequest`` for a
    ``length`` outside ``[0, current length]``."""
    current = seq_len(seq_id)
    if current is None:
        raise SequenceNotFound([seq_id], ["seq_id"])
    if not 0 <= length <= current:
        raise InvalidRequest([FieldViolation(
            "length", f"must be in [0, {current}] (sequence {seq_id!r} holds "
            f"{current} tokens), got {length}")])
