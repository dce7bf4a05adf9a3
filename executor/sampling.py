"""Sampling on the device with per-sequence parameters in one batch.

Order of operations (as in HF ``generate``): temperature, top-k, top-p, min-p, then a draw.
Greedy rows (temperature 0, or below ``GREEDY_BELOW_TEMPERATURE`` = 1e-5) take the argmax of
the raw logits. NOTE: float32 logits divided by a temperature under about 3e-38 overflow to
inf, the softmax turns them into NaN and the draw returned token 0; long before that the
scaled distribution is one-hot anyway (at 1e-5 a logit gap of 1e-3 is a factor e^100), so
tiny temperatures are greedy by definition rather than by accident. Log-probabilities returned
to the caller are those of the raw distribution (the logits after any token mask and logit
bias, ``logit_controls.py``), or with ``logprobs_mode`` processed those of the distribution
the token is drawn from (``docs/sampling.md``).

The draw is an exponential race: ``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)`` picks ``i``
with probability ``p_i``. The ``E_i`` come from a counter-based hash of (seed, position,
token id), so a seeded sequence is reproducible whatever else shares its batch, with no
per-row generator objects and no host sync.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from executor.api import BatchNeeds, SamplingParams, distinct_params
from executor.model.layers import triton_available

_MASK31 = 0x7FFFFFFF
_HAS_TRITON = triton_available()  # looked up once: argmax_rows runs every step
#: Whether ``argmax_rows`` of CUDA rows (2-D, unit column stride) is the split kernel,
#: the one path that takes ``padding``.
SPLIT_ARGMAX = _HAS_TRITON
# Odd 31-bit multipliers for the integer mixer (products stay below 2**62: no overflow).
_MIX_MULTIPLIERS = (0x2C1B3C6D, 0x297A2D39, 0x5BD1E995 & _MASK31)


@dataclass(frozen=True)
class SampleOutput:
    """Per row: the token, its raw log-probability (0.0 when no row asked for logprobs)
    and the requested top log-probabilities."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[tuple[tuple[int, float], ...]]
    #: Per row, the raw log-probability of the row's target token (``Sampler.sample``'s
    #: ``targets``), None where it has none; empty when no targets were given.
    target_logprobs: list[float | None] = field(default_factory=list)
    #: Per row, (id, log-probability) of each of its candidate tokens; empty when no row
    #: asked.
    candidate_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    #: Per row, its final-norm hidden state (float32) if it asked; empty when none did.
    hidden_states: list[tuple[float, ...]] = field(default_factory=list)


def _row_key(seed: int, position: int) -> int:
    """Mix (seed, position) into a 31-bit key on the host (splitmix64 finalizer)."""
    x = (seed * 0x9E3779B97F4A7C15 + position) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & _MASK31


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise ``(B, vocab)`` float32, a pure function of ``keys`` (B,) int64."""
    idx = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    x = (keys[:, None] + idx[None, :] * 0x9E3779B) & _MASK31
    for mult in _MIX_MULTIPLIERS:
        x = x ^ (x >> 15)
        x = (x * mult) & _MASK31
    x = x ^ (x >> 16)
    u = (x.to(torch.float64) + 0.5) / float(1 << 31)  # uniform in (0, 1)
    return (-torch.log(u)).to(torch.float32)


def apply_filters(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p; filtered-out entries become -inf. (B, V) float32."""
    device, vocab = logits.device, logits.shape[-1]
    # Greedy rows are never drawn from; 1.0 keeps their (unused) row finite.
    temps = device_tensor([1.0 if p.is_greedy else p.temperature for p in params],
                           torch.float32, device)
    x = logits / temps[:, None]
    if any(p.top_k > 0 for p in params):
        ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
        top = torch.topk(x, max(ks), dim=-1).values
        kth = top.gather(1, device_tensor(ks, torch.int64, device)[:, None] - 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = device_tensor([p.top_p for p in params], torch.float32, device)
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (keeps at least one).
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    if any(p.min_p > 0.0 for p in params):
        # p_i >= min_p * p_max, compared as scaled logits: x_i - x_max >= log(min_p). The
        # same test without a softmax, whose rounding makes every probability equal at a
        # huge temperature (and min_p 1 then kept every token, not the top one).
        log_min_p = device_tensor([p.min_p for p in params], torch.float32, device).log()
        x = x.masked_fill(x < x.max(-1, keepdim=True).values + log_min_p[:, None],
                          float("-inf"))
    return x


def argmax_rows(x: torch.Tensor, store: tuple[torch.Tensor, torch.Tensor] | None = None,
                out: torch.Tensor | None = None,
                padding: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of ``(B, V)`` scores, float32 or the activation dtype (the same
    index either way: widening to float32 is exact); on CUDA the vocabulary is split
    across the GPU (``executor.kernels.argmax``, which widens as it loads) instead of one
    thread block per row. With ``store = (table, slots)``, also ``table[slots] = tokens``
    (on CUDA inside the argmax's last launch). ``out``: a ``(B,)`` int64 tensor to write
    the tokens into (a decode graph's static buffer), else a new one. ``padding``: rows
    that store nothing (the kernel's; only where ``SPLIT_ARGMAX`` runs)."""
    if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1 and SPLIT_ARGMAX:
        from executor.kernels.argmax import argmax_rows as split_argmax

        return split_argmax(x, store=store, out=out, padding=padding)
    assert padding is None, "padded rows are skipped by the split argmax kernel only"
    tokens = x.argmax(dim=-1) if out is None else torch.argmax(x, dim=-1, out=out)
    if store is not None:
        store[0].index_copy_(0, store[1], tokens)
    return tokens


@dataclass
class DeviceSample:
    """One step's samples, still on the device (no host sync was needed to make them).

    ``tokens`` (B,) int64; ``logprobs`` (B,) float32 and ``top_ids``/``top_values`` (B, k)
    when a row asked for them. ``stage`` starts their asynchronous copy into pinned host
    memory; the caller records an event after it and waits for that event before
    ``to_output`` reads them (``executor/steps.py``), so it can launch more work first."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    #: (B,) float32 log-probabilities of given target tokens (NaN where a row has none).
    target_logprobs: torch.Tensor | None = None
    #: (B, C) float32 log-probabilities of the rows' candidate tokens (padded columns).
    candidates: torch.Tensor | None = None
    #: (B, hidden) float32 final-norm hidden states, when a row asked.
    hidden: torch.Tensor | None = None
    _pool: PinnedPool | None = field(default=None, repr=False)

    def _tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (self.logprobs, self.top_ids, self.top_values, self.target_logprobs,
                self.candidates, self.hidden)

    def stage(self, pool: PinnedPool) -> None:
        """Start the device-to-host copies (pinned, asynchronous) into buffers of
        ``pool`` (``release`` hands them back)."""
        if not self.tokens.is_cuda:
            return
        self._pool = pool
        self.tokens = _pinned_copy(self.tokens, pool)
        (self.logprobs, self.top_ids, self.top_values, self.target_logprobs, self.candidates,
         self.hidden) = (None if t is None else _pinned_copy(t, pool) for t in self._tensors())

    def release(self) -> None:
        """Give the staged buffers back to their pool: the copies into them have finished
        and nothing reads them any more (the step's outputs were built, or it was
        aborted after its device work). The sample is not used after this."""
        pool, self._pool = self._pool, None
        if pool is not None:
            for t in (self.tokens, *self._tensors()):
                if t is not None:
                    pool.give(t)

    def to_output(self, params: Sequence[SamplingParams]) -> SampleOutput:
        """The host values; a staged sample's copies must have finished (its event)."""
        n = len(params)
        tokens = self.tokens.tolist()
        targets: list[float | None] = [] if self.target_logprobs is None else [
            None if math.isnan(x) else x for x in self.target_logprobs.tolist()]
        cands, hidden = host_extras(self.candidates, self.hidden, params)
        if self.logprobs is None:
            return SampleOutput(tokens, [0.0] * n, [()] * n, targets, cands, hidden)
        top_ids: list[list[int]] = [[] for _ in params]
        top_vals: list[list[float]] = [[] for _ in params]
        if self.top_ids is not None and self.top_values is not None:
            top_ids, top_vals = self.top_ids.tolist(), self.top_values.tolist()
        tops = [tuple(zip(top_ids[i][: p.top_logprobs], top_vals[i][: p.top_logprobs],
                          strict=True)) for i, p in enumerate(params)]
        return SampleOutput(tokens, self.logprobs.tolist(), tops, targets, cands, hidden)


class PinnedPool:
    """Pinned host buffers for the samples' copies, reused from step to step instead of
    allocated per step (a pinned allocation and its release cost more host time than
    the copy's launch). Buffers are kept by shape and dtype, at most ``keep`` of each.
    ``take`` runs on the thread that launches steps and ``give`` on whichever completes
    them: deque appends and pops are atomic, so neither locks. ``pin_memory=False`` only
    for hosts without CUDA (tests)."""

    def __init__(self, keep: int = 16, pin_memory: bool = True) -> None:
        self.keep, self.pin_memory = keep, pin_memory
        self._free: dict[tuple[torch.dtype, tuple[int, ...]], deque[torch.Tensor]] = {}
        self.allocated = 0  # buffers made so far (for tests)

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A pinned buffer of ``like``'s shape and dtype (contents undefined)."""
        free = self._free.get((like.dtype, tuple(like.shape)))
        if free:  # only this thread pops, so a non-empty deque stays so until the pop
            return free.pop()
        self.allocated += 1
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pin_memory)

    def give(self, buf: torch.Tensor) -> None:
        free = self._free.setdefault((buf.dtype, tuple(buf.shape)), deque())
        if len(free) < self.keep:
            free.append(buf)


def _pinned_copy(t: torch.Tensor, pool: PinnedPool) -> torch.Tensor:
    host = pool.take(t)
    host.copy_(t, non_blocking=True)
    return host


def device_tensor(values: list[int] | list[float], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """Host values on ``device`` without waiting for the device's queued work (a plain
    ``torch.tensor(..., device=cuda)`` synchronizes the stream)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class Sampler:
    """Samples one token per row. Holds only a host RNG for unseeded rows."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 positions: Sequence[int]) -> SampleOutput:
        """``sample`` then ``to_output``: the host values of one step's samples."""
        return self.sample(logits, params, positions).to_output(params)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               positions: Sequence[int], targets: Sequence[int] | None = None,
               remember: tuple[torch.Tensor, torch.Tensor] | None = None,
               hidden: torch.Tensor | None = None,
               needs: BatchNeeds | None = None,
               greedy: torch.Tensor | None = None, greedy_stored: bool = False
               ) -> DeviceSample:
        """``logits`` (B, V), float32 or the model's activation dtype (bf16/fp16, as
        ``compute_logits`` returns them); ``positions[i]`` is the index the new token will
        have in its sequence (it keys the seeded noise). With ``targets`` (a token id per
        row, or -1), also the raw log-probability of each row's target (a prompt's next
        token: its log-likelihood). Everything stays on the device.

        Only what is computed in float32 is widened (exactly), and only when it runs: the
        sampled rows before the filters and the log-softmax; greedy rows read the logits
        as they are. So the same float32 values reach every float32 computation as when
        the logits came in float32: tokens and log-probabilities are bit-identical.

        With ``remember = (table, slots)`` (int64, a slot per row), the tokens are also
        written to ``table[slots]`` on the device: a step's samples become its sequences'
        last sampled tokens. An all-greedy step does it inside the argmax's launch (one
        ``index_copy_`` launch fewer per decode step).

        ``hidden`` (B, hidden): the rows' final-norm hidden states, for rows that ask for
        them (``return_hidden_state``). The logits carry any token mask and bias already
        (``SlotControls.apply``). ``needs``: ``BatchNeeds.of(params)`` if the caller has
        it (a decode step keeps it from launch to launch), else found here. ``greedy``:
        the argmax of every row of ``logits``, if the caller has it already (a decode
        graph computes it inside the replay): then no argmax runs here; ``greedy_stored``:
        it is in ``remember``'s table already (the graph stored it), so an all-greedy step
        writes nothing there."""
        if needs is None:
            needs = BatchNeeds.of(params)
        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy] \
            if needs.drawn else []
        want_logprobs, extras = needs.logprobs, needs.extras
        # Rows usually share a few parameter objects: each is asked once (by identity).
        distinct = distinct_params(params) if extras else params
        if greedy is None:
            tokens = argmax_rows(logits, store=None if sampled_rows else remember)
        else:
            tokens = greedy
            if remember is not None and not sampled_rows and not greedy_stored:
                remember[0].index_copy_(0, remember[1], tokens)  # (drawn rows: below)
        if sampled_rows:
            device = logits.device
            rows = device_tensor(sampled_rows, torch.int64, device)
            sub_params = [params[i] for i in sampled_rows]
            filtered = apply_filters(logits.index_select(0, rows).float(), sub_params)
            keys = device_tensor(
                [_row_key(p.seed if p.seed is not None else self._rng.getrandbits(63),
                          positions[i]) for i, p in zip(sampled_rows, sub_params, strict=True)],
                torch.int64, device)
            noise = exponential_noise(keys, logits.shape[-1])
            drawn = argmax_rows(filtered.softmax(-1) / noise)
            tokens = tokens.index_copy(0, rows, drawn)
            if remember is not None:
                remember[0].index_copy_(0, remember[1], tokens)
        if not want_logprobs and targets is None and not extras:
            return DeviceSample(tokens)
        # NOTE: .float(), not log_softmax(dtype=float32): with fp16 on CUDA that runs ATen's
        # fused half-to-float kernel instead of the float32 one that computed these so far
        # (not checked to round alike); with bf16 it casts first anyway.
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
        target_logprobs = None
        if targets is not None:
            ids = device_tensor(list(targets), torch.int64, logits.device)
            picked = raw_logprobs.gather(1, ids.clamp(min=0)[:, None]).squeeze(1)
            target_logprobs = torch.where(ids >= 0, picked, torch.nan)
        logprobs = raw_logprobs if not extras else \
            processed_logprobs(logits, params, distinct, raw_logprobs)
        out = DeviceSample(tokens, target_logprobs=target_logprobs)
        if extras:
            out.candidates = candidate_logprobs(logprobs, params)
            if hidden is not None and any(p.return_hidden_state for p in distinct):
                out.hidden = hidden.float()
        if not want_logprobs:
            return out
        out.logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)
        k = max(p.top_logprobs for p in params)
        if k:
            top = torch.topk(logprobs, k, dim=-1)
            out.top_ids, out.top_values = top.indices, top.values
        return out


def processed_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams],
                       distinct: Iterable[SamplingParams], raw: torch.Tensor) -> torch.Tensor:
    """(B, V) float32: per row, the log-probabilities its ``logprobs_mode`` reports. A
    processed row's are those of the distribution its token is drawn from: the masked
    and biased logits over its temperature, then top-k, top-p and min-p (filtered-out
    tokens -inf). A greedy row reads them at temperature 1 with its filters (vLLM's
    processed logprobs do the same); its token is the most likely one there."""
    if all(p.logprobs_mode == "raw" for p in distinct):
        return raw
    processed = torch.log_softmax(apply_filters(logits.float(), params), dim=-1)
    if all(p.logprobs_mode == "processed" for p in distinct):
        return processed
    rows = device_tensor([int(p.logprobs_mode == "processed") for p in params], torch.bool,
                         logits.device)
    return torch.where(rows[:, None], processed, raw)


def candidate_logprobs(logprobs: torch.Tensor, params: Sequence[SamplingParams]
                       ) -> torch.Tensor | None:
    """(B, C) float32: each row's candidate tokens' log-probabilities, in order (C the
    most any row asks for; a shorter row's extra columns are padding), or None."""
    width = max(len(p.candidate_token_ids) for p in params)
    if width == 0:
        return None
    ids = [list(p.candidate_token_ids) + [0] * (width - len(p.candidate_token_ids))
           for p in params]
    index = device_tensor([t for row in ids for t in row], torch.int64, logprobs.device)
    return logprobs.gather(1, index.view(len(params), width))


def host_extras(candidates: torch.Tensor | None, hidden: torch.Tensor | None,
                params: Sequence[SamplingParams]
                ) -> tuple[list[tuple[tuple[int, float], ...]], list[tuple[float, ...]]]:
    """The candidates' and hidden states' host values per row (empty lists if none)."""
    cands: list[tuple[tuple[int, float], ...]] = []
    if candidates is not None:
        values = candidates.tolist()
        cands = [tuple(zip(p.candidate_token_ids, values[i][: len(p.candidate_token_ids)],
                           strict=True)) for i, p in enumerate(params)]
    states: list[tuple[float, ...]] = []
    if hidden is not None:
        rows = hidden.tolist()
        states = [tuple(rows[i]) if p.return_hidden_state else () for i, p in
                  enumerate(params)]
    return cands, states
