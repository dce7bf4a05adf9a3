from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_PREFILL: _ClassVar[Phase]
    PHASE_DECODE: _ClassVar[Phase]

class Path(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PATH_UNSPECIFIED: _ClassVar[Path]
    PATH_GRAPH: _ClassVar[Path]
    PATH_EAGER: _ClassVar[Path]

class ServerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVER_STATE_UNSPECIFIED: _ClassVar[ServerState]
    SERVER_STATE_STARTING: _ClassVar[ServerState]
    SERVER_STATE_CAPTURING: _ClassVar[ServerState]
    SERVER_STATE_READY: _ClassVar[ServerState]
    SERVER_STATE_DRAINING: _ClassVar[ServerState]
    SERVER_STATE_UNHEALTHY: _ClassVar[ServerState]
    SERVER_STATE_SLEEPING: _ClassVar[ServerState]

class LogprobsMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGPROBS_MODE_UNSPECIFIED: _ClassVar[LogprobsMode]
    LOGPROBS_MODE_RAW: _ClassVar[LogprobsMode]
    LOGPROBS_MODE_PROCESSED: _ClassVar[LogprobsMode]
PHASE_UNSPECIFIED: Phase
PHASE_PREFILL: Phase
PHASE_DECODE: Phase
PATH_UNSPECIFIED: Path
PATH_GRAPH: Path
PATH_EAGER: Path
SERVER_STATE_UNSPECIFIED: ServerState
SERVER_STATE_STARTING: ServerState
SERVER_STATE_CAPTURING: ServerState
SERVER_STATE_READY: ServerState
SERVER_STATE_DRAINING: ServerState
SERVER_STATE_UNHEALTHY: ServerState
SERVER_STATE_SLEEPING: ServerState
LOGPROBS_MODE_UNSPECIFIED: LogprobsMode
LOGPROBS_MODE_RAW: LogprobsMode
LOGPROBS_MODE_PROCESSED: LogprobsMode

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "logprobs", "top_logprobs", "allowed_token_bitmask", "logit_bias", "grammar", "logprobs_mode")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_BITMASK_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    logprobs: bool
    top_logprobs: int
    allowed_token_bitmask: bytes
    logit_bias: _containers.ScalarMap[int, float]
    grammar: Grammar
    logprobs_mode: LogprobsMode
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., logprobs: bool = ..., top_logprobs: _Optional[int] = ..., allowed_token_bitmask: _Optional[bytes] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., logprobs_mode: _Optional[_Union[LogprobsMode, str]] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("json_schema", "regex", "ebnf")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    ebnf: str
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., ebnf: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "items")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    items: _containers.RepeatedCompositeFieldContainer[PrefillItem]
    def __init__(self, request_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[PrefillItem, _Mapping]]] = ...) -> None: ...

class PrefillItem(_message.Message):
    __slots__ = ("seq_id", "token_ids", "sample", "sampling", "every_position", "candidate_token_ids", "return_hidden_state")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EVERY_POSITION_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RETURN_HIDDEN_STATE_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    sampling: SamplingParams
    every_position: bool
    candidate_token_ids: _containers.RepeatedScalarFieldContainer[int]
    return_hidden_state: bool
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sample: bool = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., every_position: bool = ..., candidate_token_ids: _Optional[_Iterable[int]] = ..., return_hidden_state: bool = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "items", "num_steps", "packed_outputs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    PACKED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    items: _containers.RepeatedCompositeFieldContainer[DecodeItem]
    num_steps: int
    packed_outputs: bool
    def __init__(self, request_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[DecodeItem, _Mapping]]] = ..., num_steps: _Optional[int] = ..., packed_outputs: bool = ...) -> None: ...

class DecodeItem(_message.Message):
    __slots__ = ("seq_id", "token_id", "sampling", "use_last_sampled", "stop_token_ids", "candidate_token_ids", "return_hidden_state")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    USE_LAST_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RETURN_HIDDEN_STATE_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_id: int
    sampling: SamplingParams
    use_last_sampled: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    candidate_token_ids: _containers.RepeatedScalarFieldContainer[int]
    return_hidden_state: bool
    def __init__(self, seq_id: _Optional[str] = ..., token_id: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., use_last_sampled: bool = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., candidate_token_ids: _Optional[_Iterable[int]] = ..., return_hidden_state: bool = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class ItemOutput(_message.Message):
    __slots__ = ("seq_id", "token_id", "logprob", "top_logprobs", "seq_len", "steps", "stopped", "positions", "candidate_logprobs", "hidden_state", "grammar_completed")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    seq_len: int
    steps: _containers.RepeatedCompositeFieldContainer[SampledToken]
    stopped: bool
    positions: _containers.RepeatedCompositeFieldContainer[SampledToken]
    candidate_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    hidden_state: _containers.RepeatedScalarFieldContainer[float]
    grammar_completed: bool
    def __init__(self, seq_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., seq_len: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., stopped: bool = ..., positions: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., candidate_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., hidden_state: _Optional[_Iterable[float]] = ..., grammar_completed: bool = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs", "next_token_logprob", "candidate_logprobs", "hidden_state")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATE_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    next_token_logprob: float
    candidate_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    hidden_state: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., next_token_logprob: _Optional[float] = ..., candidate_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., hidden_state: _Optional[_Iterable[float]] = ...) -> None: ...

class StepInfo(_message.Message):
    __slots__ = ("phase", "path", "fallback_reason", "num_tokens", "padded_tokens", "forward_ms", "num_steps", "weight_version")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PADDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    phase: Phase
    path: Path
    fallback_reason: str
    num_tokens: int
    padded_tokens: int
    forward_ms: float
    num_steps: int
    weight_version: str
    def __init__(self, phase: _Optional[_Union[Phase, str]] = ..., path: _Optional[_Union[Path, str]] = ..., fallback_reason: _Optional[str] = ..., num_tokens: _Optional[int] = ..., padded_tokens: _Optional[int] = ..., forward_ms: _Optional[float] = ..., num_steps: _Optional[int] = ..., weight_version: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("outputs", "step", "queue_ms", "execute_ms")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_MS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[ItemOutput]
    step: StepInfo
    queue_ms: float
    execute_ms: float
    def __init__(self, outputs: _Optional[_Iterable[_Union[ItemOutput, _Mapping]]] = ..., step: _Optional[_Union[StepInfo, _Mapping]] = ..., queue_ms: _Optional[float] = ..., execute_ms: _Optional[float] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("outputs", "step", "queue_ms", "execute_ms", "packed")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_MS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[ItemOutput]
    step: StepInfo
    queue_ms: float
    execute_ms: float
    packed: PackedOutputs
    def __init__(self, outputs: _Optional[_Iterable[_Union[ItemOutput, _Mapping]]] = ..., step: _Optional[_Union[StepInfo, _Mapping]] = ..., queue_ms: _Optional[float] = ..., execute_ms: _Optional[float] = ..., packed: _Optional[_Union[PackedOutputs, _Mapping]] = ...) -> None: ...

class PackedOutputs(_message.Message):
    __slots__ = ("token_ids", "num_tokens", "seq_lens", "logprobs", "stopped_items")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOPPED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    seq_lens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    stopped_items: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., seq_lens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., stopped_items: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "seq_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released", "unknown_seq_ids", "freed_tokens")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    FREED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    released: int
    unknown_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    freed_tokens: int
    def __init__(self, released: _Optional[int] = ..., unknown_seq_ids: _Optional[_Iterable[str]] = ..., freed_tokens: _Optional[int] = ...) -> None: ...

class TruncateRequest(_message.Message):
    __slots__ = ("seq_id", "length")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    length: int
    def __init__(self, seq_id: _Optional[str] = ..., length: _Optional[int] = ...) -> None: ...

class TruncateResponse(_message.Message):
    __slots__ = ("seq_len", "freed_tokens")
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    FREED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_len: int
    freed_tokens: int
    def __init__(self, seq_len: _Optional[int] = ..., freed_tokens: _Optional[int] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("request_id", "parent_seq_id", "child_seq_id", "prefix_len")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    parent_seq_id: str
    child_seq_id: str
    prefix_len: int
    def __init__(self, request_id: _Optional[str] = ..., parent_seq_id: _Optional[str] = ..., child_seq_id: _Optional[str] = ..., prefix_len: _Optional[int] = ...) -> None: ...

class ForkResponse(_message.Message):
    __slots__ = ("seq_len", "shared_tokens", "has_last_sampled")
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    SHARED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HAS_LAST_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    seq_len: int
    shared_tokens: int
    has_last_sampled: bool
    def __init__(self, seq_len: _Optional[int] = ..., shared_tokens: _Optional[int] = ..., has_last_sampled: bool = ...) -> None: ...

class CaptureRequest(_message.Message):
    __slots__ = ("phases", "force")
    PHASES_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    phases: _containers.RepeatedScalarFieldContainer[Phase]
    force: bool
    def __init__(self, phases: _Optional[_Iterable[_Union[Phase, str]]] = ..., force: bool = ...) -> None: ...

class CaptureResponse(_message.Message):
    __slots__ = ("phases",)
    PHASES_FIELD_NUMBER: _ClassVar[int]
    phases: _containers.RepeatedCompositeFieldContainer[PhaseCapture]
    def __init__(self, phases: _Optional[_Iterable[_Union[PhaseCapture, _Mapping]]] = ...) -> None: ...

class PhaseCapture(_message.Message):
    __slots__ = ("phase", "backend", "buckets", "total_ms", "memory_bytes")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    phase: Phase
    backend: str
    buckets: _containers.RepeatedCompositeFieldContainer[BucketCapture]
    total_ms: float
    memory_bytes: int
    def __init__(self, phase: _Optional[_Union[Phase, str]] = ..., backend: _Optional[str] = ..., buckets: _Optional[_Iterable[_Union[BucketCapture, _Mapping]]] = ..., total_ms: _Optional[float] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class BucketCapture(_message.Message):
    __slots__ = ("size", "capture_ms", "ok", "error", "memory_bytes")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_MS_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    size: int
    capture_ms: float
    ok: bool
    error: str
    memory_bytes: int
    def __init__(self, size: _Optional[int] = ..., capture_ms: _Optional[float] = ..., ok: bool = ..., error: _Optional[str] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("state", "model", "kv", "graphs", "version", "uptime_s", "pending_calls")
    STATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    PENDING_CALLS_FIELD_NUMBER: _ClassVar[int]
    state: ServerState
    model: ModelInfo
    kv: KVCacheStats
    graphs: _containers.RepeatedCompositeFieldContainer[GraphStatus]
    version: str
    uptime_s: float
    pending_calls: int
    def __init__(self, state: _Optional[_Union[ServerState, str]] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., kv: _Optional[_Union[KVCacheStats, _Mapping]] = ..., graphs: _Optional[_Iterable[_Union[GraphStatus, _Mapping]]] = ..., version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., pending_calls: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "architecture", "dtype", "device", "vocab_size", "max_context", "attention_backend", "tensor_parallel_size", "rank_memory_bytes", "kernel_features", "load_format", "tp_all_reduce", "num_experts", "num_experts_per_token", "weight_version", "sleeping", "weights_discarded", "weight_format", "quantization", "sliding_window", "model_features")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FEATURES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TP_ALL_REDUCE_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SLEEPING_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DISCARDED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    MODEL_FEATURES_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    dtype: str
    device: str
    vocab_size: int
    max_context: int
    attention_backend: str
    tensor_parallel_size: int
    rank_memory_bytes: _containers.RepeatedScalarFieldContainer[int]
    kernel_features: _containers.RepeatedScalarFieldContainer[str]
    load_format: str
    tp_all_reduce: str
    num_experts: int
    num_experts_per_token: int
    weight_version: str
    sleeping: _containers.RepeatedScalarFieldContainer[str]
    weights_discarded: bool
    weight_format: str
    quantization: str
    sliding_window: int
    model_features: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., attention_backend: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., rank_memory_bytes: _Optional[_Iterable[int]] = ..., kernel_features: _Optional[_Iterable[str]] = ..., load_format: _Optional[str] = ..., tp_all_reduce: _Optional[str] = ..., num_experts: _Optional[int] = ..., num_experts_per_token: _Optional[int] = ..., weight_version: _Optional[str] = ..., sleeping: _Optional[_Iterable[str]] = ..., weights_discarded: bool = ..., weight_format: _Optional[str] = ..., quantization: _Optional[str] = ..., sliding_window: _Optional[int] = ..., model_features: _Optional[_Iterable[str]] = ...) -> None: ...

class KVCacheStats(_message.Message):
    __slots__ = ("total_tokens", "free_tokens", "total_slots", "free_slots", "active_sequences", "shared_tokens", "forked_sequences")
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SHARED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORKED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    total_tokens: int
    free_tokens: int
    total_slots: int
    free_slots: int
    active_sequences: int
    shared_tokens: int
    forked_sequences: int
    def __init__(self, total_tokens: _Optional[int] = ..., free_tokens: _Optional[int] = ..., total_slots: _Optional[int] = ..., free_slots: _Optional[int] = ..., active_sequences: _Optional[int] = ..., shared_tokens: _Optional[int] = ..., forked_sequences: _Optional[int] = ...) -> None: ...

class GraphStatus(_message.Message):
    __slots__ = ("phase", "mode", "captured_sizes")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CAPTURED_SIZES_FIELD_NUMBER: _ClassVar[int]
    phase: Phase
    mode: str
    captured_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, phase: _Optional[_Union[Phase, str]] = ..., mode: _Optional[str] = ..., captured_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("step", "prefill", "decode", "release", "truncate", "fork", "update_weights", "ack_failed_step")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    UPDATE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ACK_FAILED_STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    prefill: PrefillRequest
    decode: DecodeRequest
    release: ReleaseRequest
    truncate: TruncateRequest
    fork: ForkRequest
    update_weights: UpdateWeightsRequest
    ack_failed_step: int
    def __init__(self, step: _Optional[int] = ..., prefill: _Optional[_Union[PrefillRequest, _Mapping]] = ..., decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., release: _Optional[_Union[ReleaseRequest, _Mapping]] = ..., truncate: _Optional[_Union[TruncateRequest, _Mapping]] = ..., fork: _Optional[_Union[ForkRequest, _Mapping]] = ..., update_weights: _Optional[_Union[UpdateWeightsRequest, _Mapping]] = ..., ack_failed_step: _Optional[int] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("step", "prefill", "decode", "release", "truncate", "fork", "update_weights", "error")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    UPDATE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    step: int
    prefill: PrefillResponse
    decode: DecodeResponse
    release: ReleaseResponse
    truncate: TruncateResponse
    fork: ForkResponse
    update_weights: UpdateWeightsResponse
    error: StepError
    def __init__(self, step: _Optional[int] = ..., prefill: _Optional[_Union[PrefillResponse, _Mapping]] = ..., decode: _Optional[_Union[DecodeResponse, _Mapping]] = ..., release: _Optional[_Union[ReleaseResponse, _Mapping]] = ..., truncate: _Optional[_Union[TruncateResponse, _Mapping]] = ..., fork: _Optional[_Union[ForkResponse, _Mapping]] = ..., update_weights: _Optional[_Union[UpdateWeightsResponse, _Mapping]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "code_name", "message", "status")
    CODE_FIELD_NUMBER: _ClassVar[int]
    CODE_NAME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    code: int
    code_name: str
    message: str
    status: bytes
    def __init__(self, code: _Optional[int] = ..., code_name: _Optional[str] = ..., message: _Optional[str] = ..., status: _Optional[bytes] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("request_id", "weight_version", "path", "distributed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    weight_version: str
    path: str
    distributed: DistributedSource
    def __init__(self, request_id: _Optional[str] = ..., weight_version: _Optional[str] = ..., path: _Optional[str] = ..., distributed: _Optional[_Union[DistributedSource, _Mapping]] = ...) -> None: ...

class DistributedSource(_message.Message):
    __slots__ = ("tensors", "bucket_bytes")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    bucket_bytes: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., bucket_bytes: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("weight_version", "tensors_updated", "bytes_updated", "update_ms", "check_ms")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_UPDATED_FIELD_NUMBER: _ClassVar[int]
    BYTES_UPDATED_FIELD_NUMBER: _ClassVar[int]
    UPDATE_MS_FIELD_NUMBER: _ClassVar[int]
    CHECK_MS_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    tensors_updated: int
    bytes_updated: int
    update_ms: float
    check_ms: float
    def __init__(self, weight_version: _Optional[str] = ..., tensors_updated: _Optional[int] = ..., bytes_updated: _Optional[int] = ..., update_ms: _Optional[float] = ..., check_ms: _Optional[float] = ...) -> None: ...

class InitWeightTransferRequest(_message.Message):
    __slots__ = ("master_address", "master_port", "world_size", "rank_offset", "backend", "group_name", "timeout_s")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int
    backend: str
    group_name: str
    timeout_s: float
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank_offset: _Optional[int] = ..., backend: _Optional[str] = ..., group_name: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class InitWeightTransferResponse(_message.Message):
    __slots__ = ("ranks", "init_ms")
    RANKS_FIELD_NUMBER: _ClassVar[int]
    INIT_MS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    init_ms: float
    def __init__(self, ranks: _Optional[_Iterable[int]] = ..., init_ms: _Optional[float] = ...) -> None: ...

class DestroyWeightTransferRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DestroyWeightTransferResponse(_message.Message):
    __slots__ = ("destroyed",)
    DESTROYED_FIELD_NUMBER: _ClassVar[int]
    destroyed: bool
    def __init__(self, destroyed: bool = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("tags", "discard_weights", "drop_sequences")
    TAGS_FIELD_NUMBER: _ClassVar[int]
    DISCARD_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    DROP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    discard_weights: bool
    drop_sequences: bool
    def __init__(self, tags: _Optional[_Iterable[str]] = ..., discard_weights: bool = ..., drop_sequences: bool = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ("sleeping", "freed_bytes", "dropped_seq_ids", "sleep_ms")
    SLEEPING_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SLEEP_MS_FIELD_NUMBER: _ClassVar[int]
    sleeping: _containers.RepeatedScalarFieldContainer[str]
    freed_bytes: int
    dropped_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    sleep_ms: float
    def __init__(self, sleeping: _Optional[_Iterable[str]] = ..., freed_bytes: _Optional[int] = ..., dropped_seq_ids: _Optional[_Iterable[str]] = ..., sleep_ms: _Optional[float] = ...) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ("sleeping", "restore_ms", "recapture_ms", "weights_discarded")
    SLEEPING_FIELD_NUMBER: _ClassVar[int]
    RESTORE_MS_FIELD_NUMBER: _ClassVar[int]
    RECAPTURE_MS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DISCARDED_FIELD_NUMBER: _ClassVar[int]
    sleeping: _containers.RepeatedScalarFieldContainer[str]
    restore_ms: float
    recapture_ms: float
    weights_discarded: bool
    def __init__(self, sleeping: _Optional[_Iterable[str]] = ..., restore_ms: _Optional[float] = ..., recapture_ms: _Optional[float] = ..., weights_discarded: bool = ...) -> None: ...
