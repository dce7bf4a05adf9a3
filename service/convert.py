"""Proto <-> executor types. Requests are checked here for what the proto allows but the
executor's types do not: item counts and sizes, string lengths, sampling-parameter ranges,
enum values. Every violation is collected (with the field path the client sent, e.g.
``items[3].sampling.top_p``) and raised together as ``InvalidRequest``. Token ids,
duplicate and unknown seq_ids and context lengths are the executor's to check.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import repeat
from operator import attrgetter
from typing import Any

from executor.api import (
    GREEDY,
    DecodeItem,
    ExecutorStatus,
    ForkResult,
    ItemOutput,
    Phase,
    PhaseCapture,
    PrefillItem,
    ReleaseResult,
    SamplingParams,
    StepResult,
    TruncateResult,
    named_rows,
)
from executor.errors import FieldViolation, InvalidRequest
from service.config import RequestLimits
from service.convert_sampling import has_sampling, sampling_of
from service.gen.model_executor.v1 import executor_pb2 as pb

PHASE_TO_PB: dict[Phase, pb.Phase] = {"prefill": pb.PHASE_PREFILL, "decode": pb.PHASE_DECODE}
PHASE_FROM_PB: dict[int, Phase] = {v: k for k, v in PHASE_TO_PB.items()}
PATH_TO_PB: dict[str, pb.Path] = {"graph": pb.PATH_GRAPH, "eager": pb.PATH_EAGER}
PATH_NAMES: dict[int, str] = {v: k for k, v in PATH_TO_PB.items()}
ALL_PHASES: tuple[Phase, ...] = ("decode", "prefill")


class _Violations:
    def __init__(self) -> None:
        self.items: list[FieldViolation] = []

    def add(self, field: str, description: str) -> None:
        self.items.append(FieldViolation(field, description))

    def raise_any(self) -> None:
        if self.items:
            raise InvalidRequest(self.items)


# ---------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------

def _check_request_id(request_id: str, limits: RequestLimits, out: _Violations) -> None:
    if len(request_id) > limits.max_request_id_chars:
        out.add("request_id", f"at most {limits.max_request_id_chars} characters, got "
                f"{len(request_id)}")


def _check_seq_id(seq_id: str, field: str, limits: RequestLimits, out: _Violations) -> None:
    size = len(seq_id.encode())
    if size > limits.max_seq_id_bytes:
        out.add(field, f"at most {limits.max_seq_id_bytes} bytes, got {size}")


def _check_count(n: int, limit: int, what: str, field: str, out: _Violations) -> bool:
    if n > limit:
        out.add(field, f"{n} {what} in one call; at most {limit}")
        return False
    return True


def prefill_items(request: pb.PrefillRequest, limits: RequestLimits) -> list[PrefillItem]:
    out = _Violations()
    _check_request_id(request.request_id, limits, out)
    if not _check_count(len(request.items), limits.max_prefill_items, "items", "items", out):
        out.raise_any()
    total = sum(len(item.token_ids) for item in request.items)
    if total > limits.max_prefill_tokens:
        out.add("items", f"{total} tokens in one call; at most {limits.max_prefill_tokens} "
                "(split long prompts into chunks)")
    items = []
    for i, item in enumerate(request.items):
        _check_seq_id(item.seq_id, f"items[{i}].seq_id", limits, out)
        sampling = sampling_of(item, f"items[{i}]", out)
        items.append(PrefillItem(item.seq_id, list(item.token_ids), item.sample, sampling,
                                 item.every_position))
    out.raise_any()
    return items


#: From this many items, a decode request's items are made column by column.
_COLUMNS_MIN_ITEMS = 16
# A decode item's fields, read by C-level passes over a request's items.
_SEQ_ID = attrgetter("seq_id")
_STOP_TOKEN_IDS = attrgetter("stop_token_ids")
_USE_LAST_SAMPLED = attrgetter("use_last_sampled")
_HAS_FIELD = pb.DecodeItem.HasField
_CANDIDATES = attrgetter("candidate_token_ids")
_RETURN_HIDDEN = attrgetter("return_hidden_state")


def decode_items(request: pb.DecodeRequest, limits: RequestLimits) -> list[DecodeItem]:
    out = _Violations()
    if request.packed_outputs:
        for i, item in enumerate(request.items):
            if item.sampling.top_logprobs:
                out.add(f"items[{i}].sampling.top_logprobs", "packed_outputs carries no top "
                        "log-probabilities: unset one of them")
            for name in ("candidate_token_ids", "return_hidden_state"):
                if getattr(item, name):
                    out.add(f"items[{i}].{name}", f"packed_outputs carries no {name}: unset "
                            "one of them")
    _check_request_id(request.request_id, limits, out)
    if not _check_count(len(request.items), limits.max_decode_items, "items", "items", out):
        out.raise_any()
    # This runs once per decode step over every item (64 at batch 64): field paths are
    # only formatted for a violation, an item without sampling is GREEDY, and the items
    # are made column by column, each column in one pass.
    msgs = list(request.items)  # each pass over the repeated field itself costs more
    seq_ids = list(map(_SEQ_ID, msgs))
    short_ids = limits.max_seq_id_bytes // 4  # UTF-8 takes at most 4 bytes a character
    if len(seq_ids) < _COLUMNS_MIN_ITEMS or max(map(len, seq_ids)) > short_ids:
        # A few items (the passes cost more), or an id possibly too long: checked with the
        # sampling item by item, so that violations are listed in item order.
        items = []
        for i, item in enumerate(msgs):
            if len(item.seq_id) > short_ids:
                _check_seq_id(item.seq_id, f"items[{i}].seq_id", limits, out)
            stop = item.stop_token_ids
            items.append(DecodeItem(item.seq_id, None if item.use_last_sampled else
                                    item.token_id, sampling_of(item, f"items[{i}]", out)
                                    if has_sampling(item) else GREEDY,
                                    tuple(stop) if stop else ()))
        out.raise_any()
        return items
    n = len(seq_ids)
    sampling: Iterable[SamplingParams] = repeat(GREEDY, n)
    if any(map(_HAS_FIELD, msgs, repeat("sampling", n))) or any(
            map(_CANDIDATES, msgs)) or any(map(_RETURN_HIDDEN, msgs)):
        sampling = [sampling_of(item, f"items[{i}]", out) if has_sampling(item)
                    else GREEDY for i, item in enumerate(msgs)]
    stop_lists = list(map(_STOP_TOKEN_IDS, msgs))
    stops: Iterable[tuple[int, ...]] = repeat((), n)
    if any(stop_lists):
        stops = [tuple(s) if s else () for s in stop_lists]
    tokens: Iterable[int | None] = repeat(None, n)
    if not all(map(_USE_LAST_SAMPLED, msgs)):
        tokens = [None if item.use_last_sampled else item.token_id for item in msgs]
    out.raise_any()
    return named_rows(DecodeItem, seq_ids, tokens, sampling, stops)


def decode_steps(request: pb.DecodeRequest) -> int:
    """``num_steps`` (0 or unset: one step); the executor checks its range."""
    return request.num_steps or 1


def truncate_args(request: pb.TruncateRequest, limits: RequestLimits) -> tuple[str, int]:
    """(seq_id, length); the executor checks the length against the sequence."""
    out = _Violations()
    if not request.seq_id:
        out.add("seq_id", "must be a non-empty string")
    _check_seq_id(request.seq_id, "seq_id", limits, out)
    if request.length < 0:
        out.add("length", f"must be >= 0, got {request.length}")
    out.raise_any()
    return request.seq_id, request.length


def truncate_response(result: TruncateResult) -> pb.TruncateResponse:
    return pb.TruncateResponse(seq_len=result.seq_len, freed_tokens=result.freed_tokens)


def fork_args(request: pb.ForkRequest, limits: RequestLimits) -> tuple[str, str, int | None]:
    """(parent, child, prefix_len or None for all); the executor checks them against the
    sequence table."""
    out = _Violations()
    _check_request_id(request.request_id, limits, out)
    for name in ("parent_seq_id", "child_seq_id"):
        value = getattr(request, name)
        if not value:
            out.add(name, "must be a non-empty string")
        _check_seq_id(value, name, limits, out)
    prefix = request.prefix_len if request.HasField("prefix_len") else None
    if prefix is not None and prefix < 0:
        out.add("prefix_len", f"must be >= 0 (or unset: the whole parent), got {prefix}")
    out.raise_any()
    return request.parent_seq_id, request.child_seq_id, prefix


def fork_response(result: ForkResult) -> pb.ForkResponse:
    return pb.ForkResponse(seq_len=result.seq_len, shared_tokens=result.shared_tokens,
                           has_last_sampled=result.has_last_sampled)


def release_ids(request: pb.ReleaseRequest, limits: RequestLimits) -> list[str]:
    out = _Violations()
    _check_request_id(request.request_id, limits, out)
    if not request.seq_ids:
        out.add("seq_ids", "must contain at least one seq_id")
    _check_count(len(request.seq_ids), limits.max_release_ids, "seq_ids", "seq_ids", out)
    first: dict[str, int] = {}
    for i, seq_id in enumerate(request.seq_ids):
        # The same rules as Prefill and Decode items: non-empty, each id at most once.
        if not seq_id:
            out.add(f"seq_ids[{i}]", "must be a non-empty string")
        elif seq_id in first:
            out.add(f"seq_ids[{i}]", f"{seq_id!r} appears more than once in one call (also "
                    f"seq_ids[{first[seq_id]}])")
        else:
            first[seq_id] = i
        _check_seq_id(seq_id, f"seq_ids[{i}]", limits, out)
    out.raise_any()
    return list(request.seq_ids)


def capture_phases(request: pb.CaptureRequest) -> tuple[Phase, ...]:
    """The phases to capture; an empty list means all of them."""
    out = _Violations()
    phases: list[Phase] = []
    for i, value in enumerate(request.phases):
        phase = PHASE_FROM_PB.get(value)
        if phase is None:
            out.add(f"phases[{i}]", "must be PHASE_PREFILL or PHASE_DECODE")
        elif phase in phases:
            out.add(f"phases[{i}]", f"{pb.Phase.Name(value)} appears more than once")
        else:
            phases.append(phase)
    out.raise_any()
    return tuple(phases) or ALL_PHASES


# ---------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------

def _top(pairs: Sequence[tuple[int, float]]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=token, logprob=logprob) for token, logprob in pairs]


def _add_outputs(outputs: Any, items: Sequence[ItemOutput]) -> None:
    """Append one ``pb.ItemOutput`` per item to the repeated field ``outputs``, each made in
    place by ``add`` (building standalone messages and copying them in took 1.7x as long
    at batch 64)."""
    add = outputs.add
    if len(items) >= _COLUMNS_MIN_ITEMS:
        ids, tokens, logprobs, tops, lens, steps, stopped, positions, cands, hidden, done = \
            zip(*items, strict=True)
        if None not in tokens and logprobs.count(None) == len(items) and not (
                any(tops) or any(steps) or any(stopped) or any(positions) or any(cands)
                or any(hidden) or any(done)):
            # Each item one sampled token, no log-probabilities (a plain decode step):
            # every message made by the same call, no test per item.
            for seq_id, seq_len, token_id in zip(ids, lens, tokens, strict=True):
                add(seq_id=seq_id, seq_len=seq_len, token_id=token_id)
            return
    for item in items:
        if not (item.top_logprobs or item.steps or item.positions or item.stopped
                or item.candidate_logprobs or item.hidden_state or item.grammar_completed):
            # One sampled token (or none): the common decode answer, in one call with only
            # the fields it sets.
            if item.token_id is None:
                add(seq_id=item.seq_id, seq_len=item.seq_len)
            elif item.logprob is None:
                add(seq_id=item.seq_id, seq_len=item.seq_len, token_id=item.token_id)
            else:
                add(seq_id=item.seq_id, seq_len=item.seq_len, token_id=item.token_id,
                    logprob=item.logprob)
            continue
        msg = add(seq_id=item.seq_id, seq_len=item.seq_len,
                  top_logprobs=_top(item.top_logprobs), stopped=item.stopped,
                  candidate_logprobs=_top(item.candidate_logprobs),
                  hidden_state=item.hidden_state, grammar_completed=item.grammar_completed)
        if item.token_id is not None:
            msg.token_id = item.token_id
        if item.logprob is not None:
            msg.logprob = item.logprob
        for s in item.steps:
            token = msg.steps.add(token_id=s.token_id, top_logprobs=_top(s.top_logprobs),
                                  candidate_logprobs=_top(s.candidate_logprobs),
                                  hidden_state=s.hidden_state)
            if s.logprob is not None:
                token.logprob = s.logprob
        for s in item.positions:
            token = msg.positions.add(token_id=s.token_id, top_logprobs=_top(s.top_logprobs),
                                      candidate_logprobs=_top(s.candidate_logprobs),
                                      hidden_state=s.hidden_state)
            if s.logprob is not None:
                token.logprob = s.logprob
            if s.next_token_logprob is not None:
                token.next_token_logprob = s.next_token_logprob


# Prefill and Decode answer with distinct messages of the same fields (executor.proto).
StepResponse = pb.PrefillResponse | pb.DecodeResponse
#: What the retry cache keeps: a step's response, or a Fork's.
CachedResponse = StepResponse | pb.ForkResponse | pb.UpdateWeightsResponse
StepResponseType = type[pb.PrefillResponse] | type[pb.DecodeResponse]


def _packed(outputs: Sequence[ItemOutput]) -> pb.PackedOutputs:
    """Flat arrays of a decode's outputs (no message per item: a fifth of the time at
    batch 64)."""
    tokens: list[int] = []
    logprobs: list[float] = []
    counts, want_logprobs = [], any(o.logprob is not None for o in outputs)
    for o in outputs:
        if o.steps:
            tokens += [s.token_id for s in o.steps]
            if want_logprobs:
                logprobs += [math.nan if s.logprob is None else s.logprob for s in o.steps]
            counts.append(len(o.steps))
        else:
            tokens.append(o.token_id if o.token_id is not None else -1)
            if want_logprobs:
                logprobs.append(math.nan if o.logprob is None else o.logprob)
            counts.append(1)
    return pb.PackedOutputs(token_ids=tokens, num_tokens=counts,
                            seq_lens=[o.seq_len for o in outputs], logprobs=logprobs,
                            stopped_items=[i for i, o in enumerate(outputs)
                                           if o.stopped or o.grammar_completed])


def step_response(result: StepResult, queue_ms: float, execute_ms: float,
                  message: StepResponseType = pb.PrefillResponse,
                  packed: bool = False) -> StepResponse:
    response = message()
    fill_step_response(response, result, queue_ms, execute_ms, packed)
    return response


def fill_step_response(response: StepResponse, result: StepResult, queue_ms: float,
                       execute_ms: float, packed: bool = False) -> None:
    """``step_response``, made in the empty message ``response``: a Session builds it in
    place inside its ``SessionResponse`` (no message made apart and copied in)."""
    step, info = result.step, response.step
    # Set in place: no StepInfo made apart and copied in.
    (info.phase, info.path, info.fallback_reason, info.num_tokens, info.padded_tokens,
     info.forward_ms, info.num_steps, info.weight_version) = (
        PHASE_TO_PB[step.phase], PATH_TO_PB[step.path], step.fallback_reason,
        step.num_tokens, step.padded_tokens, step.forward_ms, step.num_steps,
        step.weight_version)
    response.queue_ms, response.execute_ms = queue_ms, execute_ms
    if packed:
        assert isinstance(response, pb.DecodeResponse)
        response.packed.CopyFrom(_packed(result.outputs))
        return
    _add_outputs(response.outputs, result.outputs)


def release_response(result: ReleaseResult) -> pb.ReleaseResponse:
    return pb.ReleaseResponse(released=result.released,
                              unknown_seq_ids=list(result.unknown_seq_ids),
                              freed_tokens=result.freed_tokens)


def capture_response(phases: Sequence[PhaseCapture]) -> pb.CaptureResponse:
    return pb.CaptureResponse(phases=[
        pb.PhaseCapture(
            phase=PHASE_TO_PB[p.phase], backend=p.backend, total_ms=p.total_ms,
            memory_bytes=p.memory_bytes,
            buckets=[pb.BucketCapture(size=b.size, capture_ms=b.capture_ms, ok=b.ok,
                                      error=b.error, memory_bytes=b.memory_bytes)
                     for b in p.buckets])
        for p in phases
    ])


def health_response(state: int, status: ExecutorStatus | None, version: str,
                    uptime_s: float, pending_calls: int) -> pb.HealthResponse:
    msg = pb.HealthResponse(state=state, version=version, uptime_s=uptime_s,  # type: ignore[arg-type]
                            pending_calls=pending_calls)
    if status is None:
        return msg
    m, kv = status.model, status.kv
    # What can actually be served: a sequence never outgrows the KV pool.
    max_context = min(m.max_context, kv.total_tokens) if kv.total_tokens > 0 else m.max_context
    msg.model.CopyFrom(pb.ModelInfo(
        name=m.name, architecture=m.architecture, dtype=m.dtype, device=m.device,
        vocab_size=m.vocab_size, max_context=max_context,
        attention_backend=m.attention_backend, tensor_parallel_size=m.tensor_parallel_size,
        rank_memory_bytes=m.rank_memory_bytes, kernel_features=m.kernel_features,
        load_format=m.load_format, tp_all_reduce=m.tp_all_reduce,
        num_experts=m.num_experts, num_experts_per_token=m.num_experts_per_token,
        weight_version=m.weight_version, sleeping=m.sleeping,
        weights_discarded=m.weights_discarded,
        weight_format=m.weight_format, quantization=m.quantization,
        sliding_window=m.sliding_window, model_features=m.model_features))
    msg.kv.CopyFrom(pb.KVCacheStats(
        total_tokens=kv.total_tokens, free_tokens=kv.free_tokens, total_slots=kv.total_slots,
        free_slots=kv.free_slots, active_sequences=kv.active_sequences,
        shared_tokens=kv.shared_tokens, forked_sequences=kv.forked_sequences))
    msg.graphs.extend(pb.GraphStatus(phase=PHASE_TO_PB[g.phase], mode=g.mode,
                                     captured_sizes=sorted(g.captured_sizes))
                      for g in status.graphs)
    return msg

