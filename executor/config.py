"""Frozen configuration, one dataclass per concern, validated once in ``__post_init__``.

Nothing here reads the environment or touches a device: ``service/cli.py`` builds these
from flags. This module is the ground floor: it imports nothing from ``executor`` but
``errors``. Names of graph modes and attention backends are checked where their registries
resolve them (``executor/graphs/registry.py``, ``executor/attention/registry.py``), at
boot, so no list of names lives here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from executor.errors import ConfigError

DType = Literal["float32", "bfloat16", "float16"]
#: Where the weights come from: the directory's safetensors, or random values drawn on
#: the device from its config.json alone (vLLM's ``--load-format dummy``; benchmarks).
LoadFormat = Literal["safetensors", "random"]
#: ``--quantization``: quantize an unquantized checkpoint's projections at load
#: (``fp8``: e4m3 weights per output channel, activations per token; docs/quantization.md).
Quantization = Literal["fp8"]

TINY_MODEL = "tiny"


#: Values of the kernel switches (``fuse_decode_rope``, ``pdl``, ``skinny_row_kernel``,
#: ``fp8_glu``, ``moe_one_launch``).
KERNEL_SWITCH_MODES = ("auto", "on", "off")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to serve. ``source`` is a local HF directory or ``"tiny"`` (embedded)."""

    source: str = TINY_MODEL
    dtype: DType | None = None  # None: float32 on CPU, bfloat16 on CUDA
    load_format: LoadFormat = "safetensors"
    seed: int = 0  # of load_format "random"'s values
    #: The version the start-up weights are served as (StepInfo, Health).
    weight_version: str = "initial"
    quantization: Quantization | None = None  # None: the checkpoint's own format, if any

    def __post_init__(self) -> None:
        _require(
            self.dtype is None or self.dtype in get_args(DType),
            f"dtype must be one of {list(get_args(DType))}, got {self.dtype!r}",
        )
        _require(self.load_format in get_args(LoadFormat),
                 f"load_format must be one of {list(get_args(LoadFormat))}, "
                 f"got {self.load_format!r}")
        _require(0 < len(self.weight_version.encode()) <= 256,
                 f"weight_version must be 1..256 bytes, got {self.weight_version!r}")
        _require(self.quantization is None or self.quantization in get_args(Quantization),
                 f"quantization must be one of {list(get_args(Quantization))} or None, "
                 f"got {self.quantization!r}")


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
    """CUDA-graph settings; ``auto`` modes are settled at boot (``resolve_graph_modes``)."""

    decode_mode: str = "disabled"  # a registered graph mode for decode, "disabled" or "auto"
    prefill_mode: str = "disabled"
    decode_buckets: tuple[int, ...] | None = None  # None: default list up to max_decode_batch
    prefill_buckets: tuple[int, ...] | None = None  # None: default list up to max_prefill_tokens
    capture_at_startup: bool = True
    compiler: Literal["eager", "inductor"] = "eager"  # for prefill_mode == "tc_piecewise"
    # tc_piecewise: compiled artifacts cached here, keyed by model, code and compiler
    # (None: no disk cache); the split graph and its pieces as readable Python (None: off).
    compile_cache_dir: str | None = None
    compile_debug_dir: str | None = None

    def __post_init__(self) -> None:
        _require(self.compiler in ("eager", "inductor"),
                 f"tc_piecewise compiler must be 'eager' or 'inductor', got {self.compiler!r}")
        for name, buckets in (("decode", self.decode_buckets), ("prefill", self.prefill_buckets)):
            if buckets is not None:
                _require(len(buckets) > 0 and all(b > 0 for b in buckets),
                         f"{name} buckets must be positive, got {buckets}")


@dataclass(frozen=True)
class ExecutorConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    graphs: GraphConfig = field(default_factory=GraphConfig)
    device: str = "cpu"
    attention_backend: str = "auto"  # "auto" or a registered attention backend
    max_prefill_tokens: int = 8192  # packed tokens in one Prefill call
    max_decode_batch: int = 256  # sequences in one Decode call
    #: RoPE inside the Triton decode attention kernel instead of its own launch per layer
    #: (``executor/attention/triton_kernels/decode.py``): ``auto`` where the attention
    #: backend can and the model has RoPE without per-head q/k norms, ``on`` (refused
    #: where it cannot), ``off``.
    fuse_decode_rope: str = "auto"
    #: Programmatic dependent launch of our Triton kernels (``executor/kernels/pdl.py``):
    #: ``auto`` on CUDA devices of compute capability 9.0+, ``on`` (refused elsewhere),
    #: ``off``.
    pdl: str = "auto"
    #: The skinny GEMM's persistent row kernel for one-row projections of the shapes it
    #: takes (``executor/kernels/skinny/tiles.py``, ``row_tile``): ``auto`` on CUDA devices,
    #: ``on`` (refused elsewhere), ``off`` (the classic kernel only).
    skinny_row_kernel: str = "auto"
    #: FP8 gate_up projections of fewer than 8 rows end in SiLU-and-mul (the gated
    #: epilogue, ``executor/quant/launch.py`` ``w8a16_glu``) and down takes the activation
    #: as a plain input: ``auto``/``on`` wherever projections are held in FP8, ``off``
    #: (down computes SiLU-and-mul itself, fused into its GEMM).
    fp8_glu: str = "auto"
    #: A mixture of experts' routed experts at one decode token in one launch (down in
    #: gate_up's grid, behind a device-wide spin; ``executor/kernels/moe/
    #: decode_persistent.py``) where the grid fits the GPU at once: ``auto`` on CUDA
    #: devices, ``on`` (refused elsewhere), ``off`` (two launches; for GPUs shared with
    #: other processes' kernels at once, as under MPS).
    moe_one_launch: str = "auto"

    def __post_init__(self) -> None:
        _require(self.device == "cpu" or self.device.startswith("cuda"),
                 f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        _require(self.max_prefill_tokens > 0, "max_prefill_tokens must be > 0")
        _require(self.max_decode_batch > 0, "max_decode_batch must be > 0")
        for name in ("fuse_decode_rope", "pdl", "skinny_row_kernel", "fp8_glu",
                     "moe_one_launch"):
            value = getattr(self, name)
            _require(value in KERNEL_SWITCH_MODES,
                     f"{name} must be one of {list(KERNEL_SWITCH_MODES)}, got {value!r}")

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def decode_batch_limit(self) -> int:
        """Sequences in one Decode call: no more than can be alive at once."""
        return min(self.max_decode_batch, self.cache.max_sequences)
