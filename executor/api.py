"""The executor's public request and result types (plain, frozen dataclasses).

These mirror the gRPC messages one-to-one so the servicer stays a thin translation layer,
but they know nothing about protobuf. Validation lives in ``executor/validation.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import Any, Literal, NamedTuple, TypeVar

Phase = Literal["prefill", "decode"]
Path = Literal["graph", "eager"]
#: What Sleep can release (``executor/sleep.py``), in the order Health lists them.
SleepTag = Literal["weights", "kv_cache"]
SLEEP_TAGS: tuple[SleepTag, ...] = ("weights", "kv_cache")

MAX_TOP_LOGPROBS = 20
#: Most ``candidate_token_ids`` one item may ask for.
MAX_CANDIDATE_TOKENS = 256
#: Most ``logit_bias`` entries one item may give (OpenAI's limit).
MAX_LOGIT_BIAS = 300
# Temperatures below this are greedy (see executor/sampling.py for why).
GREEDY_BELOW_TEMPERATURE = 1e-5


_Row = TypeVar("_Row", bound=tuple[Any, ...])


def named_rows(cls: type[_Row], *columns: Iterable[Any]) -> list[_Row]:
    """Named tuples of ``cls`` from one column per field, in field order: made as its own
    ``__new__`` makes them (``tuple.__new__``), without that Python call per row (a third
    of the time for a batch's items or outputs)."""
    fields = cls._fields  # type: ignore[attr-defined]
    if len(columns) != len(fields):
        raise TypeError(f"{cls.__name__} has {len(fields)} fields, got {len(columns)} columns")
    return list(map(partial(tuple.__new__, cls), zip(*columns, strict=True)))


LogprobsMode = Literal["raw", "processed"]


@dataclass(frozen=True)
class Grammar:
    """A grammar the sampled tokens must follow (``executor/grammar.py`` compiles it)."""

    kind: Literal["json_schema", "regex", "ebnf"]
    text: str


class FallbackReason(str, Enum):
    """Why a step ran eagerly instead of replaying a graph (``StepInfo.fallback_reason``
    and the ``reason`` label of ``model_executor_eager_fallbacks_total``)."""

    NO_CUDA = "no_cuda"
    DISABLED = "graphs_disabled"
    TOO_LARGE = "exceeds_largest_bucket"
    NOT_CAPTURED = "bucket_not_captured"
    CAPTURE_FAILED = "capture_failed"
    PADDING = "padding_too_large"


@dataclass(frozen=True)
class SamplingParams:
    """Per-sequence sampling parameters. The defaults mean "off" (greedy, no filtering).

    temperature: 0 (or below ``GREEDY_BELOW_TEMPERATURE``) means greedy (argmax); higher
        values scale the logits before sampling.
    top_k: keep the k most likely tokens; 0 = off.
    top_p: keep the smallest set whose probability reaches p; 1.0 = off.
    min_p: drop tokens whose probability is below ``min_p * max_prob``; 0.0 = off.
    seed: makes sampling reproducible: the same seed, tokens and position give the same
        token. ``None`` draws a fresh seed for every step.
    logprobs: return the sampled token's log-probability.
    top_logprobs: also return the ``n`` most likely tokens with their log-probabilities
        (0..20). Log-probabilities are of the model's raw distribution (before temperature
        and filtering), as vLLM and OpenAI report them, unless ``logprobs_mode`` says
        ``processed``.
    allowed_token_bitmask: xgrammar's layout, little-endian int32 words (ceil(vocab / 32)),
        bit j of word i allows token 32 i + j; None = every token.
    logit_bias: (token id, bias) pairs added to the logits (OpenAI semantics).
    grammar: the sampled tokens must follow it (a mask per step, from its matcher).
    logprobs_mode: ``raw`` (the logits after mask and bias only) or ``processed`` (the
        distribution the token is drawn from: after temperature and the filters too).
    candidate_token_ids, return_hidden_state: outputs asked for by the item (on the wire
        they are the item's fields; the executor carries them with its sampling).

    See ``docs/sampling.md``.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    allowed_token_bitmask: bytes | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: Grammar | None = None
    logprobs_mode: LogprobsMode = "raw"
    candidate_token_ids: tuple[int, ...] = ()
    return_hidden_state: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def has_controls(self) -> bool:
        """Whether the logits need the item's own mask or bias before sampling (a
        grammar's masks come from its matcher, step by step)."""
        return self.allowed_token_bitmask is not None or bool(self.logit_bias)

    @property
    def wants_extras(self) -> bool:
        """Whether the sampler computes more than the token and raw log-probabilities."""
        return (self.logprobs_mode == "processed" or bool(self.candidate_token_ids)
                or self.return_hidden_state)


GREEDY = SamplingParams()


@dataclass(frozen=True)
class BatchNeeds:
    """What a step's rows ask beyond plain sampling, found once per batch."""

    controls: bool = False  # a row has its own mask or bias
    grammar: bool = False  # a row has a grammar
    hidden: bool = False  # a row returns its hidden state
    drawn: bool = False  # a row is not greedy (the sampler draws it)
    logprobs: bool = False  # a row asks for its token's or the top log-probabilities
    extras: bool = False  # a row asks for more (``SamplingParams.wants_extras``)

    @staticmethod
    def of(params: Sequence[SamplingParams]) -> BatchNeeds:
        distinct = list(distinct_params(params))
        if all(p is GREEDY for p in distinct):
            return NO_NEEDS
        return BatchNeeds(any(p.has_controls for p in distinct),
                          any(p.grammar is not None for p in distinct),
                          any(p.return_hidden_state for p in distinct),
                          not all(p.is_greedy for p in distinct),
                          any(p.logprobs or p.top_logprobs for p in distinct),
                          any(p.wants_extras for p in distinct))

    @property
    def plain(self) -> bool:
        """Every row gets its token only: no log-probabilities, no extras."""
        return not (self.logprobs or self.extras)


NO_NEEDS = BatchNeeds()


def distinct_params(params: Sequence[SamplingParams]) -> Iterable[SamplingParams]:
    """The distinct parameter objects of a batch (by identity: its rows usually share a
    few), for checks asked once per object; a small batch as it is."""
    if len(params) < 16:
        return params
    return dict(zip(map(id, params), params, strict=True)).values()


@dataclass(frozen=True)
class PrefillItem:
    """Admit a new sequence (unknown ``seq_id``) or extend a known one with ``token_ids``.

    ``sample=False`` only fills the KV cache (a non-final chunk of a chunked prefill).
    ``every_position`` (needs ``sample``) samples at each of ``token_ids``' positions as
    the last one (speculative verification, prompt log-likelihoods)."""

    seq_id: str
    token_ids: Sequence[int]
    sample: bool = True
    sampling: SamplingParams = GREEDY
    #: Sample at every new position, not only the last (``ItemOutput.positions``).
    every_position: bool = False


class DecodeItem(NamedTuple):
    """Append ``token_id`` to a known sequence and sample the next token.

    ``token_id=None`` appends the token this sequence sampled last, read on the device
    (so a step may be launched before the previous step's tokens reach the host); the
    sequence's last step must have sampled. ``stop_token_ids`` end a multi-step decode's
    output for this sequence at the first of them (``Executor.launch_decode``). (A named
    tuple: a decode request makes one per item every step.)"""

    seq_id: str
    token_id: int | None
    sampling: SamplingParams = GREEDY
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SampledToken:
    """One sampled token with its raw log-probability and top log-probabilities (when
    asked for)."""

    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...]
    #: At a prefill position (``every_position``): the raw log-probability of the item's
    #: next given token there; None at its last position.
    next_token_logprob: float | None = None
    #: (token id, log-probability) of each ``candidate_token_ids`` entry, in its order.
    candidate_logprobs: tuple[tuple[int, float], ...] = ()
    #: The final-norm hidden state at this position (``return_hidden_state``), float32.
    hidden_state: tuple[float, ...] = ()


class ItemOutput(NamedTuple):
    """Result for one item, in request order. ``token_id`` is None when nothing was sampled.

    A multi-step decode lists every token it returns in ``steps`` (in order, ending at a
    stop token if one came) and reports the last of them in ``token_id``, ``logprob`` and
    ``top_logprobs``; ``stopped`` says a stop token ended it. ``seq_len`` counts every
    token whose K/V the sequence holds. (A named tuple: every step makes one per item, in
    a third of a frozen dataclass's time.)"""

    seq_id: str
    token_id: int | None
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...]
    seq_len: int
    steps: tuple[SampledToken, ...] = ()
    stopped: bool = False
    #: ``every_position`` prefill: one entry per new token, in order; the last one is
    #: what ``token_id``, ``logprob`` and ``top_logprobs`` report.
    positions: tuple[SampledToken, ...] = ()
    #: As ``SampledToken``'s, of the last sampled token.
    candidate_logprobs: tuple[tuple[int, float], ...] = ()
    hidden_state: tuple[float, ...] = ()
    #: The item's grammar reached its end with the last token (``steps`` end there).
    grammar_completed: bool = False


@dataclass(frozen=True)
class StepInfo:
    """How a step ran: graph or eager (and why eager), tokens and padding, forward time."""

    phase: Phase
    path: Path
    fallback_reason: str  # "" when path == "graph"
    num_tokens: int
    padded_tokens: int
    forward_ms: float
    #: Decode steps run (``num_steps``; 1 for every other step).
    num_steps: int = 1
    #: Tensor parallelism with the ranks on rank 0's host: when the other ranks had the
    #: step and launched its forward (the largest over ``num_steps``); None otherwise.
    ranks: RankTiming | None = None
    #: The weight version the forward ran with.
    weight_version: str = ""

    def timed(self, forward_ms: float, weight_version: str = "") -> StepInfo:
        """This info with ``forward_ms`` and the weight version (once per step: cheaper
        than ``dataclasses.replace``, which looks the fields up each call)."""
        return StepInfo(self.phase, self.path, self.fallback_reason, self.num_tokens,
                        self.padded_tokens, forward_ms, self.num_steps, self.ranks,
                        weight_version or self.weight_version)


@dataclass(frozen=True)
class RankTiming:
    """A tensor-parallel step's other ranks against rank 0 (ranks on one host, whose
    monotonic clock they share), ms: ``delivery_ms`` from rank 0 starting to send the step
    to the last rank having it; ``launch_lag_ms`` how much later than rank 0's the last
    rank's launch of the step's forward came (0 when every one launched first), which
    rank 0's device waits out at the forward's first collective."""

    delivery_ms: float
    launch_lag_ms: float

    def worst(self, other: RankTiming) -> RankTiming:
        return RankTiming(max(self.delivery_ms, other.delivery_ms),
                          max(self.launch_lag_ms, other.launch_lag_ms))


@dataclass(frozen=True)
class StepResult:
    outputs: tuple[ItemOutput, ...]
    step: StepInfo


@dataclass(frozen=True)
class ReleaseResult:
    """Sequences released, ids that were unknown, and the KV token locations that went
    back to the pool (a location a forked sequence still holds stays in use)."""

    released: int
    unknown_seq_ids: tuple[str, ...]
    freed_tokens: int = 0


@dataclass(frozen=True)
class ForkResult:
    """A forked sequence's length (its shared prefix) and the tokens it shares."""

    seq_len: int
    shared_tokens: int
    #: The child can decode from the parent's last sampled token (``token_id=None``).
    has_last_sampled: bool


@dataclass(frozen=True)
class TruncateResult:
    """A truncated sequence's length now, and the KV token locations that went back to the
    pool (locations past ``seq_len`` that another sequence still holds stay in use)."""

    seq_len: int
    freed_tokens: int


@dataclass(frozen=True)
class KVStats:
    """KV-cache accounting; ``free_tokens + used_tokens == total_tokens`` always, with a
    location that forked sequences share counted once (``shared_tokens`` of them)."""

    total_tokens: int
    free_tokens: int
    total_slots: int
    free_slots: int
    active_sequences: int
    shared_tokens: int = 0  # locations held by more than one sequence
    forked_sequences: int = 0  # live sequences created by Fork

    @property
    def used_tokens(self) -> int:
        return self.total_tokens - self.free_tokens

    @property
    def usage_ratio(self) -> float:
        return self.used_tokens / self.total_tokens if self.total_tokens else 0.0


@dataclass(frozen=True)
class BucketCapture:
    """One bucket's capture. ``memory_bytes``: the device memory its capture took (after
    its warm-up, so kernels loaded on first use and warm-up activations are not in it)."""

    size: int
    capture_ms: float
    ok: bool
    error: str = ""
    memory_bytes: int = 0


@dataclass(frozen=True)
class PhaseCapture:
    """One phase's capture. ``memory_bytes``: device memory the phase's graphs hold, i.e.
    the static buffers they share plus every bucket's ``memory_bytes``."""

    phase: Phase
    backend: str
    buckets: tuple[BucketCapture, ...] = ()
    total_ms: float = 0.0
    memory_bytes: int = 0


@dataclass(frozen=True)
class GraphStatus:
    phase: Phase
    mode: str
    captured_sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    dtype: str
    device: str
    vocab_size: int
    max_context: int
    attention_backend: str  # what --attention-backend (often ``auto``) resolved to
    tensor_parallel_size: int = 1  # ranks the model is split over
    # bytes of weights and KV cache each rank holds, in rank order (counted at start-up)
    rank_memory_bytes: tuple[int, ...] = ()
    # kernel switches in effect ("fused_decode_rope", "pdl", "skinny_row_kernel", "fp8_glu",
    # "moe_one_launch", "tp_projections_send"): what ``auto`` and the defaults resolved to
    kernel_features: tuple[str, ...] = ()
    # where the weights came from: "safetensors", or "random" (``--load-format random``)
    load_format: str = "safetensors"
    # what a tensor-parallel group's small all-reduces run as (``all_reduce_algorithm``);
    # "" for one process
    tp_all_reduce: str = ""
    # the weight version served now; what Sleep holds released; weights discarded by
    # Sleep and not refilled yet (``executor/weights/control.py``)
    weight_version: str = ""
    sleeping: tuple[str, ...] = ()
    weights_discarded: bool = False
    # experts per mixture-of-experts layer and experts routed per token; 0 for dense models
    num_experts: int = 0
    num_experts_per_token: int = 0
    # how the projections' weights are held: "fp8_e4m3", or the serving dtype (never
    # quantized, or dequantized at load where the device has no FP8)
    weight_format: str = ""
    # the checkpoint's or --quantization's FP8 scheme ("fp8_block_128x128",
    # "fp8_per_channel_dynamic", "fp8_per_tensor", "fp8_at_load"); "" for none
    quantization: str = ""
    # the smallest sliding window any layer uses (tokens), 0 when none does
    sliding_window: int = 0
    # what the model adds to a plain Llama decoder (``ModelSpec.model_features``)
    model_features: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExecutorStatus:
    """A snapshot for Health: model, KV accounting and graph state."""

    model: ModelInfo
    kv: KVStats
    graphs: tuple[GraphStatus, ...] = field(default_factory=tuple)
