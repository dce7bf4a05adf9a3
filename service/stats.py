"""Records what the service observes (steps, KV accounting, captures, RPC outcomes) into
``Metrics``. Callers speak in executor and gRPC terms; this module turns them into
bounded label values, so nothing unbounded can reach a label.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc

from executor.api import GraphStatus, KVStats, ModelInfo, Phase, PhaseCapture, StepInfo
from executor.errors import OutOfResources
from service.admission import Overloaded
from service.metrics import ALLOCATION_RESOURCES, Metrics

OTHER = "other"


def capture_failure_reason(error: str) -> str:
    return "oom" if "out of memory" in error.lower() else "error"


class StatsRecorder:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._reasons = frozenset(metrics.fallback_reasons)
        # Labelled children of the per-step metrics, looked up once per label set: a
        # step records about ten of them (``labels()`` checks and locks on every call).
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # The KV gauges read the latest accounting when scraped: a step only keeps it.
        self._kv: KVStats | None = None
        m = metrics
        for gauge, read in (
                (m.kv_tokens.labels("used"), lambda kv: kv.used_tokens),
                (m.kv_tokens.labels("free"), lambda kv: kv.free_tokens),
                (m.kv_slots.labels("used"), lambda kv: kv.total_slots - kv.free_slots),
                (m.kv_slots.labels("free"), lambda kv: kv.free_slots),
                (m.kv_usage_ratio, lambda kv: kv.usage_ratio),
                (m.active_sequences, lambda kv: kv.active_sequences),
                (m.kv_shared_tokens, lambda kv: kv.shared_tokens),
                (m.forked_sequences, lambda kv: kv.forked_sequences)):
            gauge.set_function(self._reader(read))

    def _reader(self, read: Callable[[KVStats], float]) -> Callable[[], float]:
        return lambda: 0.0 if self._kv is None else float(read(self._kv))

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def step(self, step: StepInfo, batch_size: int, seconds: float) -> None:
        m, phase, child = self.metrics, step.phase, self._child
        child(m.step_seconds, phase, step.path).observe(seconds)
        child(m.tokens, phase).inc(step.num_tokens)
        child(m.batch_size, phase).observe(batch_size)
        child(m.padded_tokens, phase).inc(step.padded_tokens)
        if step.ranks is not None:
            child(m.tp_step_delivery_seconds, phase).observe(step.ranks.delivery_ms / 1e3)
            child(m.tp_launch_lag_seconds, phase).observe(step.ranks.launch_lag_ms / 1e3)
        if step.path == "graph":
            child(m.graph_replays, phase).inc()
        else:
            reason = step.fallback_reason if step.fallback_reason in self._reasons else OTHER
            child(m.eager_fallbacks, phase, reason).inc()

    def graphs(self, graphs: Sequence[GraphStatus]) -> None:
        for g in graphs:
            self.metrics.graph_captured_buckets.labels(g.phase).set(len(g.captured_sizes))

    def replays(self, seconds: Mapping[Phase, Sequence[float]]) -> None:
        """Replay durations the executor measured with CUDA events (read without a sync,
        so they trail the steps they belong to by a call or so)."""
        for phase, durations in seconds.items():
            histogram = self._child(self.metrics.graph_replay_seconds, phase)
            for duration in durations:
                histogram.observe(duration)

    def kv(self, kv: KVStats) -> None:
        """The latest KV accounting; the KV gauges read it when scraped."""
        self._kv = kv

    @property
    def latest_kv(self) -> KVStats | None:
        return self._kv

    def capture(self, phases: Sequence[PhaseCapture], force: bool) -> None:
        """A capture's cost. Without ``force`` only missing buckets were captured, so the
        memory it reports adds to what the phase held; with it, it replaces that."""
        m = self.metrics
        for p in phases:
            if not p.buckets:  # everything was captured already
                continue
            m.graph_capture_seconds.labels(p.phase).set(p.total_ms / 1e3)
            memory = m.graph_memory_bytes.labels(p.phase)
            if force:
                memory.set(p.memory_bytes)
            else:
                memory.inc(p.memory_bytes)
            for b in p.buckets:
                if not b.ok:
                    reason = capture_failure_reason(b.error)
                    m.graph_capture_failures.labels(p.phase, reason).inc()

    def error(self, exc: BaseException) -> None:
        if isinstance(exc, OutOfResources):
            for resource, _, _ in exc.shortages:
                if resource in ALLOCATION_RESOURCES:
                    self.metrics.kv_allocation_failures.labels(resource).inc()
        elif isinstance(exc, Overloaded):
            self.metrics.overload_refusals.labels(exc.kind).inc()

    def calls_in_flight(self, kind: str, count: int) -> None:
        self.metrics.calls_in_flight.labels(kind).set(count)

    def queue_wait(self, seconds: float) -> None:
        self.metrics.queue_wait_seconds.observe(seconds)

    def retry_cache(self, entries: int, size_bytes: int) -> None:
        self.metrics.retry_entries.set(entries)
        self.metrics.retry_bytes.set(size_bytes)

    def retry_replayed(self, method: str) -> None:
        self.metrics.retry_replays.labels(method).inc()

    def retry_evicted(self, reason: str) -> None:
        self.metrics.retry_evictions.labels(reason).inc()

    def weights_updated(self, source: str, seconds: float) -> None:
        self.metrics.weight_updates.labels(source).inc()
        self.metrics.weight_update_seconds.labels(source).set(seconds)

    def sleeping(self, asleep: bool) -> None:
        self.metrics.sleeping.set(1 if asleep else 0)

    def healthy(self, healthy: bool) -> None:
        self.metrics.healthy.set(1 if healthy else 0)

    def model(self, info: ModelInfo) -> None:
        self.metrics.model_info.labels(info.name, info.architecture, info.dtype,
                                       info.device).set(1)
        self.metrics.tensor_parallel_size.set(info.tensor_parallel_size)
        for feature in info.kernel_features:
            self.metrics.kernel_feature.labels(feature).set(1)
        if info.tp_all_reduce:
            self.metrics.tp_all_reduce.labels(info.tp_all_reduce).set(1)
        for rank, size in enumerate(info.rank_memory_bytes):
            self.metrics.rank_memory_bytes.labels(str(rank)).set(size)

    def rpc_started(self, service: str, method: str, rpc_type: str) -> None:
        self.metrics.grpc_started.labels(service, method, rpc_type).inc()

    def rpc_handled(self, service: str, method: str, rpc_type: str, code: grpc.StatusCode,
                    seconds: float) -> None:
        m = self.metrics
        m.grpc_handled.labels(service, method, rpc_type, code.name).inc()
        m.grpc_handling_seconds.labels(service, method, rpc_type).observe(seconds)
