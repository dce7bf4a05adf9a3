"""The executor's boot sequence, one function per step, each returning frozen parts.

    1. device and dtype, the process-wide kernel switches
    2. the attention backend settled (before anything big is allocated), the weights
    3. the KV cache sized and allocated (pools + request-slot table), the TP step channel
    4. the attention backend built, the fused decode RoPE decided, ``ModelInfo``
    5. the per-step pools: sampler, last sampled tokens, pinned staging, step pools
    6. the graph modes settled against the attention backend (what each ``auto`` chose
       logged in one line), the graph runners (capture on ``Executor.capture``), ``Forward``

Under tensor parallelism every rank runs it: each loads its weight shard and allocates
its KV shard (its KV heads); the collectives in steps 3 and 4 run in the same order on
every rank.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

import torch

from executor import quant
from executor.api import ModelInfo, Phase
from executor.attention import create_backend, resolve_backend
from executor.attention.base import AttentionBackend, AttentionShape
from executor.config import ExecutorConfig
from executor.distributed import group
from executor.distributed.channel import StepChannel
from executor.distributed.group import TensorParallel
from executor.errors import ConfigError
from executor.forward import Forward
from executor.forward_batch import PinnedStaging
from executor.graphs.buckets import (
    default_decode_buckets,
    default_prefill_buckets,
    normalize_buckets,
)
from executor.graphs.graph_runner import GraphRunner
from executor.graphs.registry import (
    AUTO,
    PHASES,
    auto_graph_mode,
    make_capture_backend,
    resolve_graph_mode,
)
from executor.kernels.switches import KernelSwitches
from executor.kv import KVCacheManager, KVPool, ReqToTokenTable
from executor.last_sampled import LastSampled
from executor.logit_controls import SlotControls
from executor.model.base import CausalModel
from executor.model.spec import ModelSpec
from executor.sampling import Sampler
from executor.steps import StepPools
from executor.validation import Limits
from executor.weights.catalog import model_name, resolve_model_source
from executor.weights.loader import load_hf_config, load_model
from executor.weights.sharding import local_spec

_log = logging.getLogger("executor.boot")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: KV tokens off CUDA when ``--kv-tokens`` is not given (no device memory to size by).
CPU_DEFAULT_KV_TOKENS = 32768


# -- 1. device and dtype ------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype
    dtype_name: str
    #: Process-wide kernel launch choices (PDL, the row kernel), held active around each
    #: forward and capture so executors sharing a process launch as configured.
    switches: KernelSwitches


def place(config: ExecutorConfig) -> Placement:
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {config.device!r} requested but CUDA is not available")
    dtype_name = config.model.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    switches = KernelSwitches.resolve(config.pdl, config.skinny_row_kernel, device,
                                      config.fp8_glu, config.moe_one_launch)
    return Placement(device, _DTYPES[dtype_name], dtype_name, switches)


# -- 2. attention settled, weights ----------------------------------------------------
@dataclass(frozen=True)
class Weights:
    model: CausalModel
    spec: ModelSpec  # this rank's (its heads)
    name: str
    max_context: int
    shape: AttentionShape
    backend_name: str
    #: Why ``auto`` chose it (empty for a named backend), for the start-up log line.
    backend_why: str
    #: Seconds per boot step (FlashInfer's probe JIT-compiles its kernels in "attention").
    seconds: dict[str, float]


def load_weights(config: ExecutorConfig, at: Placement, tp: TensorParallel) -> Weights:
    source = config.model.source
    model_dir = resolve_model_source(source)  # tiny, a named model, or a directory
    spec = local_spec(load_hf_config(model_dir), tp.size)  # this rank's heads
    max_context = config.cache.max_context or spec.max_position
    # Settled before the weights load: a backend that cannot serve here fails fast.
    shape = AttentionShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.attn_scale,
                           spec.layer_windows, spec.attn_softcap)
    started = time.perf_counter()
    backend_name, backend_why = resolve_backend(config.attention_backend, at.device, at.dtype,
                                                shape)
    seconds = {"attention": time.perf_counter() - started}
    started = time.perf_counter()
    model, spec = load_model(model_dir, at.dtype, at.device, max_context, spec, tp,
                             config.model.load_format, config.model.seed,
                             config.model.quantization)
    seconds["weights"] = time.perf_counter() - started
    qi = quant.info_of(model, at.dtype)
    if qi.quantization and tp.leads:  # one line: which GEMM each projection kind takes
        _log.info("fp8_gemm_paths", extra={"quantization": qi.quantization,
                                           "weight_format": qi.weight_format,
                                           "paths": qi.paths})
    return Weights(model, spec, model_name(source, model_dir), max_context, shape,
                   backend_name, backend_why, seconds)


# -- 3. KV cache, TP channel ----------------------------------------------------------
@dataclass(frozen=True)
class Cache:
    pool: KVPool
    table: ReqToTokenTable
    kv: KVCacheManager
    limits: Limits
    #: Bytes of weights and KV cache each rank holds, in rank order.
    rank_memory_bytes: tuple[int, ...]
    channel: StepChannel | None  # to the other ranks (None without any)


def size_cache(config: ExecutorConfig, at: Placement, w: Weights,
               tp: TensorParallel) -> Cache:
    # Every rank holds the same locations (of its own KV heads): the fewest any fits.
    tp.settle()  # ranks load their slices at different speeds
    num_tokens = tp.min_over_ranks(_kv_tokens(config, at, w))
    spec = w.spec
    pool = KVPool(spec.num_layers, num_tokens, spec.num_kv_heads, spec.head_dim, at.dtype,
                  at.device)
    table = ReqToTokenTable(config.cache.max_sequences, w.max_context, at.device)
    weights = w.model.parameters() if isinstance(w.model, torch.nn.Module) else ()
    rank_memory_bytes = tp.gather_over_ranks(
        sum(p.numel() * p.element_size() for p in weights) + pool.nbytes)
    channel = StepChannel(tp, at.device) if tp.distributed else None
    limits = Limits(spec.vocab_size, w.max_context, config.max_prefill_tokens,
                    config.decode_batch_limit, kv_tokens=num_tokens)
    return Cache(pool, table, KVCacheManager(table, num_tokens), limits, rank_memory_bytes,
                 channel)


def _kv_tokens(config: ExecutorConfig, at: Placement, w: Weights) -> int:
    cache = config.cache
    if cache.kv_tokens is not None:
        return cache.kv_tokens
    if at.device.type != "cuda":
        return min(cache.max_sequences * w.max_context, CPU_DEFAULT_KV_TOKENS)
    free, _total = torch.cuda.mem_get_info(at.device)
    per_token = KVPool.bytes_per_token(w.spec.num_layers, w.spec.num_kv_heads,
                                       w.spec.head_dim, at.dtype)
    tokens = int(free * cache.kv_memory_fraction) // per_token
    if tokens <= 0:
        raise ConfigError(f"no device memory left for the KV cache ({free} bytes free)")
    return tokens


# -- 4. attention backend, fused decode RoPE, ModelInfo ---------------------------------
@dataclass(frozen=True)
class Attention:
    attn: AttentionBackend
    #: Whether the decode attention kernel applies RoPE (the model then does not).
    fuses_decode_rope: bool
    model_info: ModelInfo


def build_attention(config: ExecutorConfig, at: Placement, w: Weights, cache: Cache,
                    tp: TensorParallel) -> Attention:
    attn = create_backend(w.backend_name, w.shape, cache.pool, cache.table)
    rotary = getattr(w.model, "rotary", None)
    can_fuse = attn.can_fuse_decode_rope and rotary is not None and \
        not w.spec.features.qk_norm and rotary.fusable
    if config.fuse_decode_rope == "on" and not can_fuse:
        raise ConfigError(
            f"--fuse-decode-rope on needs the triton attention backend (this one is "
            f"{w.backend_name!r}) and a model with RoPE and no per-head q/k norm")
    fuses = can_fuse and config.fuse_decode_rope != "off"
    if fuses:
        attn.fuse_decode_rope(rotary.cos, rotary.sin)  # type: ignore[union-attr]
    qi = quant.info_of(w.model, at.dtype)
    # FP8 projections never store into the all-reduce's buffers (only the bf16 skinny GEMM
    # does), so under FP8 the send is not in effect whatever the group planned.
    sends = group.projection_features(tp) if qi.weight_format != "fp8_e4m3" else ()
    # (the FP8 gated epilogue is in effect only where projections are held in FP8, the
    # one-launch MoE decode only for a mixture of experts held in bf16/fp16/fp32)
    fp8 = qi.weight_format == "fp8_e4m3"
    in_effect = {"fp8_glu": fp8, "moe_one_launch": w.spec.moe is not None and not fp8}
    switched = tuple(f for f in at.switches.features if in_effect.get(f, True))
    features = ("fused_decode_rope",) * fuses + switched + sends
    info = ModelInfo(
        name=w.name, architecture=w.spec.architecture, dtype=at.dtype_name,
        device=str(at.device), vocab_size=w.spec.vocab_size, max_context=w.max_context,
        attention_backend=w.backend_name, load_format=config.model.load_format,
        tensor_parallel_size=tp.size, rank_memory_bytes=cache.rank_memory_bytes,
        kernel_features=features,
        tp_all_reduce=group.all_reduce_algorithm(tp) if tp.distributed else "",
        num_experts=w.spec.moe.num_experts if w.spec.moe else 0,
        num_experts_per_token=w.spec.moe.top_k if w.spec.moe else 0,
        weight_format=qi.weight_format, quantization=qi.quantization,
        sliding_window=w.spec.sliding_window or 0, model_features=w.spec.model_features)
    return Attention(attn, fuses, info)


# -- 5. per-step pools ----------------------------------------------------------------
@dataclass(frozen=True)
class Pools:
    sampler: Sampler
    last: LastSampled
    #: Every batch's metadata goes to the device through one reused pinned buffer.
    staging: PinnedStaging | None
    steps: StepPools
    #: Each request slot's token mask and logit bias (``logit_controls.py``).
    controls: SlotControls


def make_pools(config: ExecutorConfig, at: Placement, cache: Cache) -> Pools:
    staging = PinnedStaging(at.device) if at.device.type == "cuda" else None
    return Pools(Sampler(), LastSampled(config.cache.max_sequences, at.device, cache.channel),
                 staging, StepPools(at.device),
                 SlotControls(config.cache.max_sequences, cache.limits.vocab_size, at.device))


# -- 6. graph runners and the forward ----------------------------------------------------
@dataclass(frozen=True)
class Graphs:
    modes: dict[Phase, str]  # the resolved graph mode per phase (``auto`` settled)
    runners: dict[Phase, GraphRunner]  # per phase with graphs on a CUDA device
    forward: Forward


def resolve_modes(config: ExecutorConfig, at: Placement, w: Weights, att: Attention
                  ) -> tuple[dict[Phase, str], dict[str, str]]:
    """Each phase's graph mode, resolved against the attention backend's capabilities
    (``auto`` always yields a mode that runs; a named mode it cannot run is refused naming
    the flags), and what each ``auto`` setting resolved to and why."""
    cuda = at.device.type == "cuda"
    attention = _attention_label(config, at, w.backend_name)
    # Off CUDA no runner is built: a named mode is only checked to be one of the phase's.
    capturable = att.attn.capturable if cuda else frozenset(PHASES)
    chosen: dict[str, str] = {}
    if config.attention_backend == AUTO:
        chosen["attention_backend"] = f"{w.backend_name} ({w.backend_why})"
    modes: dict[Phase, str] = {}
    requests: dict[Phase, str] = {"decode": config.graphs.decode_mode,
                                  "prefill": config.graphs.prefill_mode}
    for phase, requested in requests.items():
        if requested == AUTO:
            mode, why = auto_graph_mode(phase, cuda, att.attn.capturable, attention)
            chosen[f"{phase}_graph"] = f"{mode} ({why})"
        else:
            mode = resolve_graph_mode(phase, requested, True, capturable, attention)
        modes[phase] = mode
    return modes, chosen


def _attention_label(config: ExecutorConfig, at: Placement, name: str) -> str:
    """The attention backend and the flags that chose it, for refusals."""
    if config.attention_backend != AUTO:
        return f"--attention-backend {name}"
    dtype = f"--dtype {at.dtype_name}" if config.model.dtype else at.dtype_name
    return (f"attention backend {name!r} (what --attention-backend auto picks for {dtype} "
            f"on {at.device.type})")


def make_graphs(config: ExecutorConfig, at: Placement, w: Weights, cache: Cache,
                att: Attention, pools: Pools, tp: TensorParallel) -> Graphs:
    modes, chosen = resolve_modes(config, at, w, att)
    if chosen and tp.leads:  # one line: what each auto setting resolved to, and why
        _log.info("auto_resolved", extra={"auto": chosen})
    runners: dict[Phase, GraphRunner] = {}
    for phase, mode in modes.items():
        if mode == "disabled" or at.device.type != "cuda":
            continue
        backend = make_capture_backend(mode, at.device, config.graphs,
                                       _model_key(at, w, cache, tp))
        # resolve_modes read the registry's record of this; the backend must agree.
        assert not (backend.attention_in_graph and phase not in att.attn.capturable), mode
        if phase == "decode":
            buckets = config.graphs.decode_buckets or default_decode_buckets(
                config.decode_batch_limit)
        else:
            buckets = config.graphs.prefill_buckets or default_prefill_buckets(
                config.max_prefill_tokens)
        runner = GraphRunner(phase, w.model, att.attn, backend, normalize_buckets(buckets),
                             cache.limits.max_context, cache.table, at.device,
                             pools.last.tokens, pools.controls)
        if cache.channel is not None:  # a bucket failing on any rank fails on all
            runner.agree = cache.channel.agree
        runners[phase] = runner
    forward = Forward(w.model, att.attn, runners, modes, cache.table, at.device,
                      pools.staging, pools.sampler, pools.last, at.switches, cache.channel,
                      pools.controls)
    return Graphs(modes, runners, forward)


def _model_key(at: Placement, w: Weights, cache: Cache, tp: TensorParallel) -> str:
    """What a compiled forward depends on besides our code: layout, dtype, context (the
    RoPE table is a graph input) and the kernel choice."""
    raw = f"{w.spec!r}|{at.dtype}|{cache.limits.max_context}|{w.model.kernels}"
    if tp.distributed:  # the collectives are part of the compiled graph
        raw += f"|tp{tp.rank}/{tp.size}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


# -- all of it ------------------------------------------------------------------------
@dataclass(frozen=True)
class Parts:
    at: Placement
    weights: Weights
    cache: Cache
    attention: Attention
    pools: Pools
    graphs: Graphs


def boot(config: ExecutorConfig, tp: TensorParallel) -> Parts:
    """Steps 1 to 6, in order."""
    at = place(config)
    w = load_weights(config, at, tp)
    cache = size_cache(config, at, w, tp)
    att = build_attention(config, at, w, cache, tp)
    pools = make_pools(config, at, cache)
    return Parts(at, w, cache, att, pools, make_graphs(config, at, w, cache, att, pools, tp))
