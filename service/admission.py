"""Admission: which calls may run now, by kind, so that no kind can starve another.

gRPC's own ``maximum_concurrent_rpcs`` counts every call against one limit (refusing the
excess before any interceptor sees it), so long-lived ``Health/Watch`` streams or a burst
of queued steps could take every slot and starve the probes. Each kind has its own budget:

| kind    | methods                                               | budget                  |
|---------|-------------------------------------------------------|-------------------------|
| probe   | ``grpc.health.v1.Health/Check``, ``Executor/Health``  | none: they never wait   |
| watch   | ``grpc.health.v1.Health/Watch``                       | ``max_watch_streams``   |
| call    | everything else (steps, Release, Capture, reflection) | ``max_concurrent_rpcs`` |

Probes answer from memory (never the executor thread), so admitting all of them is free.
Each listener has its own ``Admission`` (the health port cannot take the main port's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Kind = Literal["probe", "watch", "call"]
KINDS: tuple[Kind, ...] = ("probe", "watch", "call")
LIMITED_KINDS: tuple[Kind, ...] = ("watch", "call")

PROBE_METHODS = frozenset({"/grpc.health.v1.Health/Check",
                           "/model_executor.v1.Executor/Health"})
WATCH_METHODS = frozenset({"/grpc.health.v1.Health/Watch"})
RETRY_AFTER_OVERLOAD_S = 0.25


def kind_of(method: str) -> Kind:
    """The admission kind of ``method`` ("/package.Service/Method")."""
    if method in PROBE_METHODS:
        return "probe"
    if method in WATCH_METHODS:
        return "watch"
    return "call"


class Overloaded(Exception):
    """A call over its kind's budget; nothing ran. Maps to RESOURCE_EXHAUSTED with
    ``ErrorInfo`` reason ``OVERLOADED`` (a watch: ``WATCH_STREAMS_EXHAUSTED``) and a
    ``RetryInfo``, which tells it apart from KV exhaustion; counted in
    ``model_executor_overload_refusals_total{kind}``."""

    def __init__(self, kind: Kind, limit: int) -> None:
        what = ("Health/Watch streams" if kind == "watch" else "calls")
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

    def __post_init__(self) -> None:
        if self.max_calls <= 0 or self.max_watch_streams < 0:
            raise ValueError("admission budgets must be > 0 (calls) and >= 0 (watch streams)")
        self._in_flight: dict[Kind, int] = dict.fromkeys(KINDS, 0)

    def limit(self, kind: Kind) -> int | None:
        return {"probe": None, "watch": self.max_watch_streams, "call": self.max_calls}[kind]

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
