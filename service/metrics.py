"""Every Prometheus metric the service exports, on one registry, and the HTTP exporter.

Names follow Prometheus conventions: one prefix, base units (seconds, bytes), ``_total``
counters (prometheus-client appends it), ``_ratio`` for 0..1. Labels only take values from
small fixed sets (phase, path, fallback reason, state, gRPC method and code), never a
request or sequence id. Every graph series exists from the start (at zero), so dashboards
built before graphs land keep working.

Nothing here knows about requests or the executor: ``service/stats.py`` records into it.
"""

from __future__ import annotations

import platform
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

PREFIX = "model_executor_"
PHASES = ("prefill", "decode")
PATHS = ("graph", "eager")
CAPTURE_FAILURE_REASONS = ("oom", "error")
ALLOCATION_RESOURCES = ("kv_tokens", "sequence_slots")
STEP_METHODS = ("Prefill", "Decode")
OVERLOAD_KINDS = ("call", "watch", "session", "reflection")  # admission.LIMITED_KINDS
CALL_KINDS = ("probe", "watch", "session", "reflection", "call")  # admission.KINDS
RETRY_EVICTION_REASONS = ("capacity", "bytes", "sequence", "release", "too_large")

STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
                10.0)
REPLAY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                  0.1, 0.25, 0.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
LAUNCH_LAG_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025,
                      0.01, 0.1)
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
               5.0, 10.0, 30.0)


class Metrics:
    """The metric objects; construct one per registry (tests use a fresh registry each)."""

    def __init__(self, registry: CollectorRegistry, fallback_reasons: tuple[str, ...]) -> None:
        self.registry = registry
        self.fallback_reasons = fallback_reasons
        r, p = registry, PREFIX
        # -- steps ---------------------------------------------------------------------
        self.step_seconds = Histogram(
            p + "step_seconds", "Wall time of one executor step (validation, forward, "
            "sampling)", ["phase", "path"], buckets=STEP_BUCKETS, registry=r)
        self.tokens = Counter(p + "tokens", "Tokens run through the model (no padding)",
                              ["phase"], registry=r)
        self.batch_size = Histogram(p + "batch_size", "Sequences in one step", ["phase"],
                                    buckets=BATCH_BUCKETS, registry=r)
        # -- graphs --------------------------------------------------------------------
        self.eager_fallbacks = Counter(p + "eager_fallbacks", "Steps that ran eagerly, by "
                                       "reason", ["phase", "reason"], registry=r)
        self.graph_replays = Counter(p + "graph_replays", "Steps replayed from a CUDA graph",
                                     ["phase"], registry=r)
        self.graph_replay_seconds = Histogram(
            p + "graph_replay_seconds", "Forward time of graph-replayed steps", ["phase"],
            buckets=REPLAY_BUCKETS, registry=r)
        self.padded_tokens = Counter(p + "padded_tokens", "Padding tokens added to reach a "
                                     "graph bucket", ["phase"], registry=r)
        self.graph_captured_buckets = Gauge(p + "graph_captured_buckets", "Buckets captured "
                                            "now", ["phase"], registry=r)
        self.graph_capture_seconds = Gauge(p + "graph_capture_seconds", "Duration of the "
                                           "phase's last capture", ["phase"], registry=r)
        self.graph_memory_bytes = Gauge(p + "graph_memory_bytes", "Device memory held by the "
                                        "phase's graphs", ["phase"], registry=r)
        self.graph_capture_failures = Counter(p + "graph_capture_failures", "Buckets whose "
                                              "capture failed", ["phase", "reason"],
                                              registry=r)
        # -- KV cache ------------------------------------------------------------------
        self.kv_tokens = Gauge(p + "kv_tokens", "KV-cache token locations", ["state"],
                               registry=r)
        self.kv_usage_ratio = Gauge(p + "kv_usage_ratio", "Used / total KV token locations",
                                    registry=r)
        self.kv_slots = Gauge(p + "kv_slots", "Sequence slots", ["state"], registry=r)
        self.active_sequences = Gauge(p + "active_sequences", "Sequences admitted and not "
                                      "released", registry=r)
        self.kv_shared_tokens = Gauge(p + "kv_shared_tokens", "KV token locations held by "
                                      "more than one sequence (Fork)", registry=r)
        self.forked_sequences = Gauge(p + "forked_sequences", "Live sequences created by "
                                      "Fork", registry=r)
        self.kv_allocation_failures = Counter(p + "kv_allocation_failures", "Calls refused "
                                              "for lack of KV tokens or sequence slots",
                                              ["resource"], registry=r)
        # -- admission and the executor queue (service/admission.py, worker.py) ---------
        self.overload_refusals = Counter(p + "overload_refusals", "Calls refused because "
                                         "their kind's in-flight budget was full (not KV "
                                         "exhaustion)", ["kind"], registry=r)
        self.calls_in_flight = Gauge(p + "calls_in_flight", "Calls in flight on the main "
                                     "listener, by admission kind", ["kind"], registry=r)
        self.queue_depth = Gauge(p + "executor_queue_depth", "Executor calls queued or "
                                 "running (saturation: above 1, calls wait)", registry=r)
        self.queue_wait_seconds = Histogram(
            p + "executor_queue_wait_seconds", "Time a call waited for the executor thread "
            "before it started", buckets=STEP_BUCKETS, registry=r)
        # -- idempotent retries (service/idempotency.py) --------------------------------
        self.retry_replays = Counter(p + "retry_cache_hits", "Retries answered with the "
                                     "original call's response (nothing run)", ["method"],
                                     registry=r)
        self.retry_entries = Gauge(p + "retry_cache_entries", "Responses kept for retries",
                                   registry=r)
        self.retry_bytes = Gauge(p + "retry_cache_bytes", "Size of the responses kept for "
                                 "retries", registry=r)
        self.retry_evictions = Counter(p + "retry_cache_evictions", "Responses dropped from "
                                       "the retry cache, by reason", ["reason"], registry=r)
        # -- weights (service/weights_rpc.py) --------------------------------------------
        self.weight_updates = Counter(p + "weight_updates", "UpdateWeights calls that "
                                      "applied, by source", ["source"], registry=r)
        self.weight_update_seconds = Gauge(p + "weight_update_seconds", "Duration of the "
                                           "last update (check and copy)", ["source"],
                                           registry=r)
        self.sleeping = Gauge(p + "sleeping", "1 while Sleep holds memory released (or "
                              "discarded weights wait for an update): not ready on purpose",
                              registry=r)
        # -- process -------------------------------------------------------------------
        self.healthy = Gauge(p + "healthy", "1 when ready to serve steps, else 0", registry=r)
        self.build_info = Gauge(p + "build_info", "Build and runtime versions (always 1)",
                                ["version", "python", "torch", "grpcio"], registry=r)
        self.model_info = Gauge(p + "model_info", "The served model (always 1)",
                                ["name", "architecture", "dtype", "device"], registry=r)
        self.kernel_feature = Gauge(p + "kernel_feature", "Kernel switches in effect (1 per "
                                    "feature: fused_decode_rope, pdl, skinny_row_kernel, "
                                    "fp8_glu, moe_one_launch, tp_projections_send), "
                                    "what auto resolved to",
                                    ["feature"], registry=r)
        self.tp_all_reduce = Gauge(p + "tp_all_reduce", "What the tensor-parallel group's "
                                   "small all-reduces run as (always 1; absent for one "
                                   "process)", ["algorithm"], registry=r)
        self.tensor_parallel_size = Gauge(p + "tensor_parallel_size", "Ranks the model is "
                                          "split over (1: one process)", registry=r)
        self.rank_memory_bytes = Gauge(p + "rank_memory_bytes", "Weights and KV cache held "
                                       "by each tensor-parallel rank, at start-up", ["rank"],
                                       registry=r)
        self.tp_step_delivery_seconds = Histogram(
            p + "tp_step_delivery_seconds", "From rank 0 starting to send a step to the "
            "last other tensor-parallel rank having it (ranks on one host only; absent "
            "otherwise)", ["phase"], buckets=LAUNCH_LAG_BUCKETS, registry=r)
        self.tp_launch_lag_seconds = Histogram(
            p + "tp_launch_lag_seconds", "How much later than rank 0 the last other "
            "tensor-parallel rank launched a step's forward (0 when every one launched "
            "first): what rank 0's device waits at the step's first collective (ranks on "
            "one host only; absent otherwise)", ["phase"], buckets=LAUNCH_LAG_BUCKETS,
            registry=r)
        # -- gRPC (the go-grpc-prometheus names, so stock gRPC dashboards work) --------
        rpc_labels = ["grpc_service", "grpc_method", "grpc_type"]
        self.grpc_started = Counter("grpc_server_started", "RPCs started", rpc_labels,
                                    registry=r)
        self.grpc_handled = Counter("grpc_server_handled", "RPCs completed, by status code",
                                    [*rpc_labels, "grpc_code"], registry=r)
        self.grpc_handling_seconds = Histogram("grpc_server_handling_seconds", "RPC latency",
                                               rpc_labels, buckets=RPC_BUCKETS, registry=r)
        self._touch()

    def _touch(self) -> None:
        """Create every fixed-label series at zero."""
        for phase in PHASES:
            for path in PATHS:
                self.step_seconds.labels(phase, path)
            for reason in self.fallback_reasons:
                self.eager_fallbacks.labels(phase, reason)
            for reason in CAPTURE_FAILURE_REASONS:
                self.graph_capture_failures.labels(phase, reason)
            for metric in (self.tokens, self.batch_size, self.graph_replays,
                           self.graph_replay_seconds, self.padded_tokens,
                           self.graph_captured_buckets, self.graph_capture_seconds,
                           self.graph_memory_bytes):
                metric.labels(phase)
        for state in ("used", "free"):
            self.kv_tokens.labels(state)
            self.kv_slots.labels(state)
        for resource in ALLOCATION_RESOURCES:
            self.kv_allocation_failures.labels(resource)
        for kind in OVERLOAD_KINDS:
            self.overload_refusals.labels(kind)
        for kind in CALL_KINDS:
            self.calls_in_flight.labels(kind)
        for method in (*STEP_METHODS, "Fork"):
            self.retry_replays.labels(method)
        for reason in RETRY_EVICTION_REASONS:
            self.retry_evictions.labels(reason)

    def touch_rpcs(self, service: str, methods: tuple[str, ...], rpc_type: str = "unary"
                   ) -> None:
        """Create the gRPC series of ``methods`` at zero (OK only; other codes on use)."""
        for method in methods:
            self.grpc_started.labels(service, method, rpc_type)
            self.grpc_handled.labels(service, method, rpc_type, "OK")
            self.grpc_handling_seconds.labels(service, method, rpc_type)

    def set_build_info(self, version: str) -> None:
        import torch

        self.build_info.labels(version, platform.python_version(), torch.__version__,
                               grpc.__version__).set(1)


@dataclass
class Exporter:
    """The ``/metrics`` HTTP server (a daemon thread)."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_exporter(registry: CollectorRegistry, host: str, port: int) -> Exporter:
    server, thread = start_http_server(port, addr=host, registry=registry)
    return Exporter(server, thread)
