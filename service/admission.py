"""Admission: which calls may run now, by kind, so that no kind can starve another
(gRPC's own ``maximum_concurrent_rpcs`` counts every call against one limit). A stream
counts from the moment it opens, against its own kind's budget only:

| kind       | methods                                           | budget                  |
|------------|---------------------------------------------------|-------------------------|
| probe      | ``Health/Check``, ``Executor/Health``             | none: they never wait   |
| watch      | ``Health/Watch``                                  | ``max_watch_streams``   |
| session    | ``Executor/Session`` (idle ones time out)         | ``max_session_streams`` |
| reflection | ``ServerReflectionInfo`` (v1, v1alpha)            | calls + sessions        |
| call       | everything else (unary steps, Release, Capture)   | ``max_concurrent_rpcs`` |

Probes answer from memory, so admitting all of them is free. grpcurl holds a reflection
stream while the call it resolved runs: hence that budget. Each listener has its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Kind = Literal["probe", "watch", "session", "reflection", "call"]
KINDS: tuple[Kind, ...] = ("probe", "watch", "session", "reflection", "call")
LIMITED_KINDS: tuple[Kind, ...] = ("watch", "session", "reflection", "call")

PROBE_METHODS = frozenset({"/grpc.health.v1.Health/Check",
                           "/model_executor.v1.Executor/Health"})
WATCH_METHODS = frozenset({"/grpc.health.v1.Health/Watch"})
SESSION_METHODS = frozenset({"/model_executor.v1.Executor/Session"})
REFLECTION_METHODS = frozenset({
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"})
RETRY_AFTER_OVERLOAD_S = 0.25


def kind_of(method: str) -> Kind:
    """The admission kind of ``method`` ("/package.Service/Method")."""
    if method in PROBE_METHODS:
        return "probe"
    if method in WATCH_METHODS:
        return "watch"
    if method in SESSION_METHODS:
        return "session"
    if method in REFLECTION_METHODS:
        return "reflection"
    return "call"


class Overloaded(Exception):
    """A call over its kind's budget; nothing ran. Maps to RESOURCE_EXHAUSTED with
    ``ErrorInfo`` reason ``OVERLOADED`` (a watch: ``WATCH_STREAMS_EXHAUSTED``, a session:
    ``SESSION_STREAMS_EXHAUSTED``, reflection: ``REFLECTION_STREAMS_EXHAUSTED``) and a
    ``RetryInfo``, which tells it apart from KV
    exhaustion; counted in ``model_executor_overload_refusals_total{kind}``."""

    def __init__(self, kind: Kind, limit: int) -> None:
        what = {"watch": "Health/Watch streams", "session": "Session streams",
                "reflection": "reflection streams"}.get(kind, "calls")
        super().__init__(f"too many {what} in flight on this server (limit {limit}); retry "
                         "later (health probes are not affected)")
        self.kind: Kind = kind
        self.limit = limit
        self.retry_after_s = RETRY_AFTER_OVERLOAD_S


@dataclass
class Admission:
    """In-flight counts per kind, on one event loop (no lock needed). ``on_change(kind, n)``
    is told every new count (a gauge)."""

    max_calls: int
    max_watch_streams: int
    on_change: Callable[[Kind, int], None] | None = None
    max_session_streams: int = 64

    def __post_init__(self) -> None:
        if self.max_calls <= 0 or self.max_watch_streams < 0 or self.max_session_streams < 0:
            raise ValueError("admission budgets must be > 0 (calls) and >= 0 (streams)")
        self._in_flight: dict[Kind, int] = dict.fromkeys(KINDS, 0)
        self._limits: dict[Kind, int | None] = {
            "probe": None, "watch": self.max_watch_streams,
            "session": self.max_session_streams,
            "reflection": self.max_calls + self.max_session_streams, "call": self.max_calls}

    def limit(self, kind: Kind) -> int | None:
        return self._limits[kind]

    def in_flight(self, kind: Kind) -> int:
        return self._in_flight[kind]

    def enter(self, kind: Kind) -> None:
        """Count a call in; raises ``Overloaded`` (counting nothing) over the budget."""
        limit = self.limit(kind)
        if limit is not None and self._in_flight[kind] >= limit:
            raise Overloaded(kind, limit)
        self._in_flight[kind] += 1
        if self.on_change is not None:
            self.on_change(kind, self._in_flight[kind])

    def leave(self, kind: Kind) -> None:
        self._in_flight[kind] -= 1
        if self.on_change is not None:
            self.on_change(kind, self._in_flight[kind])
