"""Server settings and the request limits derived from the executor's configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from executor.config import ExecutorConfig
from service.auth import AuthConfig
from service.tls import TlsConfig

MiB = 1024 * 1024


@dataclass(frozen=True)
class RetryCacheConfig:
    """Bounds of the cache of recent Prefill/Decode responses kept for retries.

    max_entries: responses kept (least recently used dropped first); 0 turns idempotent
        retries off (a retry then runs again).
    max_bytes: their serialized size in all; a single response larger than this is not kept.
    per_sequence: the most recent calls kept per sequence (a call counts for each of its
        sequences); a scheduler retries the last call, rarely an older one.
    max_forgotten: ids of responses dropped (evicted, or their sequence released) that are
        still remembered, so that a late retry of one gets ABORTED instead of running again.
    """

    max_entries: int = 4096
    max_bytes: int = 64 * MiB
    per_sequence: int = 4
    max_forgotten: int = 65536

    def __post_init__(self) -> None:
        if self.max_entries < 0 or self.max_bytes < 0 or self.max_forgotten < 0:
            raise ValueError("retry cache bounds must be >= 0")
        if self.per_sequence <= 0:
            raise ValueError(f"retry cache per_sequence must be > 0, got {self.per_sequence}")

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0


@dataclass(frozen=True)
class ServerConfig:
    """How the gRPC process listens and stops.

    port / metrics_port: 0 picks a free port (the bound one is logged); metrics_port None
        runs no exporter.
    grace_period_s: how long in-flight calls may run after a shutdown signal.
    drain_delay_s: how long to keep answering (health NOT_SERVING, new steps UNAVAILABLE)
        before the listener closes, so load balancers and the scheduler see the drain. The
        CLI defaults to 5 s (``--drain-delay``); 0 here suits servers embedded in tests.
    max_concurrent_rpcs: unary calls in flight at once (steps, Release, Capture; not
        Session or reflection streams, whose budgets are their own); more get
        RESOURCE_EXHAUSTED (reason OVERLOADED). Executor calls run one at a time anyway,
        so a deep queue only adds latency. Health probes (``Health/Check``,
        ``Executor/Health``) do not count: they always answer (``service/admission.py``).
    max_watch_streams: ``grpc.health.v1.Health/Watch`` streams open at once, per listener;
        more get RESOURCE_EXHAUSTED (reason WATCH_STREAMS_EXHAUSTED). Watch needs no token,
        so this bound keeps anyone from holding the call budget with idle streams.
    health_port: an extra plaintext listener with only ``grpc.health.v1`` (no auth), for
        probes that cannot speak TLS (Kubernetes' native gRPC probe); None: none.
    tls / auth: transport security and bearer tokens (``service/tls.py``, ``service/auth.py``).
    retry_cache: the idempotent-retry cache (``service/idempotency.py``).
    session_depth: steps a Session stream may have launched and unanswered at once.
    max_session_streams: Session streams open at once, counted from the moment they open;
        more get RESOURCE_EXHAUSTED (reason SESSION_STREAMS_EXHAUSTED).
    session_idle_timeout_s: a Session with no step unanswered and no new request for this
        long is closed with DEADLINE_EXCEEDED (reason SESSION_IDLE_TIMEOUT); 0: never.
    rpc_log: "all" logs one INFO line per call; "errors" only calls that did not succeed
        (a successful step's line costs server CPU on every call).
    """

    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = 9400
    grace_period_s: float = 10.0
    drain_delay_s: float = 0.0
    max_concurrent_rpcs: int = 256
    max_watch_streams: int = 16
    reflection: bool = True
    health_port: int | None = None
    tls: TlsConfig | None = None
    auth: AuthConfig = field(default_factory=AuthConfig)
    retry_cache: RetryCacheConfig = field(default_factory=RetryCacheConfig)
    session_depth: int = 3  # the client's default --pipeline depth too
    max_session_streams: int = 64
    session_idle_timeout_s: float = 60.0
    rpc_log: Literal["all", "errors"] = "all"

    def __post_init__(self) -> None:
        if not 1 <= self.session_depth <= 16:
            raise ValueError(f"session depth must be in [1, 16], got {self.session_depth}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics port must be in [0, 65535], got {self.metrics_port}")
        if self.grace_period_s < 0:
            raise ValueError(f"grace period must be >= 0, got {self.grace_period_s}")
        if self.drain_delay_s < 0:
            raise ValueError(f"drain delay must be >= 0, got {self.drain_delay_s}")
        if self.max_concurrent_rpcs <= 0:
            raise ValueError("max_concurrent_rpcs must be > 0")
        if self.max_watch_streams < 0:
            raise ValueError("max_watch_streams must be >= 0")
        if self.max_session_streams < 0:
            raise ValueError("max_session_streams must be >= 0")
        if self.session_idle_timeout_s < 0:
            raise ValueError("session_idle_timeout_s must be >= 0 (0: never)")
        if self.health_port is not None and not 0 <= self.health_port <= 65535:
            raise ValueError(f"health port must be in [0, 65535], got {self.health_port}")

    @property
    def is_loopback(self) -> bool:
        return self.host in ("127.0.0.1", "::1", "localhost") or self.host.startswith("127.")

    @property
    def address(self) -> str:
        return self.address_of(self.port)

    def address_of(self, port: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{port}"


@dataclass(frozen=True)
class RequestLimits:
    """Per-call limits the service enforces before a request reaches the executor."""

    max_prefill_items: int
    max_prefill_tokens: int
    max_decode_items: int
    max_release_ids: int
    max_seq_id_bytes: int = 256
    max_request_id_chars: int = 128

    @classmethod
    def from_executor(cls, config: ExecutorConfig) -> RequestLimits:
        return cls(
            max_prefill_items=config.cache.max_sequences,
            max_prefill_tokens=config.max_prefill_tokens,
            max_decode_items=min(config.max_decode_batch, config.cache.max_sequences),
            max_release_ids=max(1024, config.cache.max_sequences),
        )

    @property
    def max_receive_bytes(self) -> int:
        """The largest request the limits allow, with slack, and never under 4 MiB.

        A token id is a varint of at most 5 bytes (negative int32s take 10; they are
        invalid anyway); an item adds its seq_id, sampling params and framing.
        """
        per_item = self.max_seq_id_bytes + 96
        largest = max(
            10 * self.max_prefill_tokens + per_item * self.max_prefill_items,
            (per_item + 8) * self.max_decode_items,
            (self.max_seq_id_bytes + 4) * self.max_release_ids,
        )
        return max(4 * MiB, largest + MiB)

    @property
    def max_send_bytes(self) -> int:
        """The largest response: one output per item with 20 top logprobs each."""
        per_item = self.max_seq_id_bytes + 32 + 20 * 12
        return max(4 * MiB, per_item * max(self.max_prefill_items, self.max_decode_items) + MiB)


def channel_options(limits: RequestLimits) -> list[tuple[str, int]]:
    """gRPC server options: explicit message limits; keepalive pings every >= 10 s allowed;
    no SO_REUSEPORT (grpcio sets it by default, so a second server on a busy port would
    start without error and the kernel would split connections between the two processes:
    sequences would intermittently be NOT_FOUND)."""
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", limits.max_receive_bytes),
        ("grpc.max_send_message_length", limits.max_send_bytes),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 2),
    ]
