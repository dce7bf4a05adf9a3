"""Frozen configuration, one dataclass per concern, validated once in ``__post_init__``.

Nothing here reads the environment or touches a device: ``service/cli.py`` builds these
from flags, and ``resolve_graph_modes`` decides graph modes as a pure table lookup.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from executor.errors import ConfigError

DType = Literal["float32", "bfloat16", "float16"]
DecodeGraphMode = Literal["full", "breakable", "disabled"]
PrefillGraphMode = Literal["breakable", "tc_piecewise", "disabled"]
AttentionBackendName = Literal["auto", "torch_native", "triton", "flashinfer"]

TINY_MODEL = "tiny"


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to serve. ``source`` is a local HF directory or ``"tiny"`` (embedded)."""

    source: str = TINY_MODEL
    dtype: DType | None = None  # None: float32 on CPU, bfloat16 on CUDA
    seed: int = 0  # only for the embedded tiny model's random weights

    def __post_init__(self) -> None:
        _require(
            self.dtype is None or self.dtype in get_args(DType),
            f"dtype must be one of {list(get_args(DType))}, got {self.dtype!r}",
        )


@dataclass(frozen=True)
class CacheConfig:
    """KV-cache sizing. Pools are token-granular (page size 1).

    kv_tokens: token locations per layer; None sizes them from ``kv_memory_fraction`` of
        the device memory left after weights (CUDA) or a CPU default.
    max_sequences: rows of the request-slot table (sequences alive at once).
    max_context: longest sequence (prompt + generated); None = the model's limit.
    """

    kv_tokens: int | None = None
    kv_memory_fraction: float = 0.85
    max_sequences: int = 256
    max_context: int | None = None

    def __post_init__(self) -> None:
        _require(self.kv_tokens is None or self.kv_tokens > 0, "kv_tokens must be > 0")
        _require(0.0 < self.kv_memory_fraction <= 0.95, "kv_memory_fraction must be in (0, 0.95]")
        _require(self.max_sequences > 0, "max_sequences must be > 0")
        _require(self.max_context is None or self.max_context > 0, "max_context must be > 0")


@dataclass(frozen=True)
class GraphConfig:
    """Resolved CUDA-graph settings (see ``resolve_graph_modes``)."""

    decode_mode: DecodeGraphMode = "disabled"
    prefill_mode: PrefillGraphMode = "disabled"
    decode_buckets: tuple[int, ...] | None = None  # None: default list up to max_decode_batch
    prefill_buckets: tuple[int, ...] | None = None  # None: default list up to max_prefill_tokens
    capture_at_startup: bool = True
    compiler: Literal["eager", "inductor"] = "eager"  # for prefill_mode == "tc_piecewise"
    # tc_piecewise: compiled artifacts cached here, keyed by model, code and compiler
    # (None: no disk cache); the split graph and its pieces as readable Python (None: off).
    compile_cache_dir: str | None = None
    compile_debug_dir: str | None = None

    def __post_init__(self) -> None:
        _require(self.decode_mode in get_args(DecodeGraphMode),
                 f"decode graph mode must be one of {list(get_args(DecodeGraphMode))}, "
                 f"got {self.decode_mode!r}")
        _require(self.prefill_mode in get_args(PrefillGraphMode),
                 f"prefill graph mode must be one of {list(get_args(PrefillGraphMode))}, "
                 f"got {self.prefill_mode!r}")
        _require(self.compiler in ("eager", "inductor"),
                 f"tc_piecewise compiler must be 'eager' or 'inductor', got {self.compiler!r}")
        for name, buckets in (("decode", self.decode_buckets), ("prefill", self.prefill_buckets)):
            if buckets is not None:
                _require(len(buckets) > 0 and all(b > 0 for b in buckets),
                         f"{name} buckets must be positive, got {buckets}")

    @property
    def any_enabled(self) -> bool:
        return self.decode_mode != "disabled" or self.prefill_mode != "disabled"


@dataclass(frozen=True)
class ExecutorConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    graphs: GraphConfig = field(default_factory=GraphConfig)
    device: str = "cpu"
    attention_backend: AttentionBackendName = "auto"
    max_prefill_tokens: int = 8192  # packed tokens in one Prefill call
    max_decode_batch: int = 256  # sequences in one Decode call

    def __post_init__(self) -> None:
        _require(self.device == "cpu" or self.device.startswith("cuda"),
                 f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        _require(self.attention_backend in get_args(AttentionBackendName),
                 f"attention backend must be one of {list(get_args(AttentionBackendName))}, "
                 f"got {self.attention_backend!r}")
        _require(self.max_prefill_tokens > 0, "max_prefill_tokens must be > 0")
        _require(self.max_decode_batch > 0, "max_decode_batch must be > 0")

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def decode_batch_limit(self) -> int:
        """Sequences in one Decode call: no more than can be alive at once."""
        return min(self.max_decode_batch, self.cache.max_sequences)


# ---------------------------------------------------------------------------------------
# Graph-mode resolution: one table, no cascade of ifs.
# ---------------------------------------------------------------------------------------

# Default mode per (phase, device kind). "auto" on the command line means this table.
_DEFAULT_MODES: dict[tuple[str, bool], str] = {
    ("decode", True): "full",
    ("decode", False): "disabled",
    ("prefill", True): "breakable",
    ("prefill", False): "disabled",
}
_VALID_MODES: dict[str, tuple[str, ...]] = {
    "decode": get_args(DecodeGraphMode),
    "prefill": get_args(PrefillGraphMode),
}
_WHY_INVALID: dict[tuple[str, str], str] = {
    ("prefill", "full"): "prefill attention is variable-length, so a prefill forward cannot "
    "be one whole graph; use breakable or tc_piecewise",
    ("decode", "tc_piecewise"): "decode uses a full graph (or breakable); tc_piecewise is "
    "for prefill",
}


def resolve_graph_mode(phase: Literal["decode", "prefill"], requested: str, cuda: bool) -> str:
    """Resolve one phase's graph mode from a flag value ("auto" or a mode name).

    Raises ``ConfigError`` naming the valid choices for a name that is not one, and saying
    why for a graph mode requested on a machine without CUDA.
    """
    if requested == "auto":
        return _DEFAULT_MODES[(phase, cuda)]
    valid = _VALID_MODES[phase]
    if requested not in valid:
        why = _WHY_INVALID.get((phase, requested), f"unknown mode {requested!r}")
        raise ConfigError(
            f"invalid {phase} graph mode {requested!r}: {why}; valid: auto, {', '.join(valid)}"
        )
    if requested != "disabled" and not cuda:
        raise ConfigError(
            f"{phase} graph mode {requested!r} needs a CUDA device, and this executor runs on "
            "CPU; use 'disabled' or 'auto'"
        )
    return requested


def resolve_graph_modes(decode: str, prefill: str, cuda: bool) -> tuple[str, str]:
    """Resolve both phases; see ``resolve_graph_mode``."""
    return resolve_graph_mode("decode", decode, cuda), resolve_graph_mode("prefill", prefill, cuda)
