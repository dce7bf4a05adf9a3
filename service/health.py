"""Lifecycle state and the standard ``grpc.health.v1`` statuses it implies.

Two health services: ``""`` is liveness (the process is up and can serve or recover) and
``READINESS_SERVICE`` is readiness (weights loaded, KV pools allocated, start-up capture
done). A table maps each state to both; draining enters the servicer's graceful shutdown,
which pins every service at NOT_SERVING for good.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import grpc
import structlog
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from service.gen.model_executor.v1 import executor_pb2 as pb

READINESS_SERVICE = pb.DESCRIPTOR.services_by_name["Executor"].full_name
LIVENESS_SERVICE = ""

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

log = structlog.get_logger(__name__)


class HealthServicer(health_aio.HealthServicer):
    """grpcio's asyncio health servicer with ``List``, which its reference implementation
    leaves to the base class (an exception: INTERNAL and a traceback on every call)."""

    async def List(self, request: health_pb2.HealthListRequest,
                   context: grpc.aio.ServicerContext) -> health_pb2.HealthListResponse:
        """Every registered service and its status: the table ``Check`` answers from, so a
        listed status is what ``Check`` gives for that name at the same moment."""
        statuses = dict(self._server_status)  # a snapshot: set() may run between awaits
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status)
            for name, status in statuses.items()})


class State(enum.Enum):
    STARTING = pb.SERVER_STATE_STARTING
    CAPTURING = pb.SERVER_STATE_CAPTURING
    READY = pb.SERVER_STATE_READY
    DRAINING = pb.SERVER_STATE_DRAINING
    UNHEALTHY = pb.SERVER_STATE_UNHEALTHY
    SLEEPING = pb.SERVER_STATE_SLEEPING


# state -> (liveness, readiness)
_HEALTH: dict[State, tuple[int, int]] = {
    State.STARTING: (SERVING, NOT_SERVING),
    State.CAPTURING: (SERVING, NOT_SERVING),
    State.READY: (SERVING, SERVING),
    State.DRAINING: (NOT_SERVING, NOT_SERVING),
    State.UNHEALTHY: (NOT_SERVING, NOT_SERVING),
    # alive, and not ready: its memory is given back until WakeUp
    State.SLEEPING: (SERVING, NOT_SERVING),
}

# Allowed moves. DRAINING is final; UNHEALTHY can only drain; SLEEPING (Sleep) returns to
# READY on WakeUp.
_NEXT: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.CAPTURING, State.READY, State.DRAINING, State.UNHEALTHY}),
    State.CAPTURING: frozenset({State.READY, State.DRAINING, State.UNHEALTHY}),
    State.READY: frozenset({State.SLEEPING, State.DRAINING, State.UNHEALTHY}),
    State.SLEEPING: frozenset({State.READY, State.DRAINING, State.UNHEALTHY}),
    State.UNHEALTHY: frozenset({State.DRAINING}),
    State.DRAINING: frozenset(),
}


class Lifecycle:
    """Owns the server's state; every change goes through ``set`` on the event loop."""

    def __init__(self, health: HealthServicer,
                 on_change: Callable[[State], None] | None = None) -> None:
        self.health = health
        self._state = State.STARTING
        self._on_change = on_change
        self.reason = ""  # why the server is UNHEALTHY

    @property
    def state(self) -> State:
        return self._state

    async def publish(self) -> None:
        """Push the current state to the health servicer (at start-up)."""
        await self._apply(self._state)

    async def set(self, state: State, reason: str = "") -> bool:
        """Move to ``state``; returns False (and changes nothing) for a move not allowed."""
        if state == self._state:
            return True
        if state not in _NEXT[self._state]:
            return False
        log.info("state_changed", old=self._state.name, new=state.name, reason=reason or None)
        self._state = state
        if state is State.UNHEALTHY:
            self.reason = reason
        await self._apply(state)
        return True

    async def _apply(self, state: State) -> None:
        if state is State.DRAINING:
            await self.health.enter_graceful_shutdown()
        else:
            live, ready = _HEALTH[state]
            await self.health.set(LIVENESS_SERVICE, live)  # type: ignore[arg-type]
            await self.health.set(READINESS_SERVICE, ready)  # type: ignore[arg-type]
        if self._on_change is not None:
            self._on_change(state)
