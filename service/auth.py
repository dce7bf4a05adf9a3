"""Bearer tokens: who may call what.

Clients send ``authorization: Bearer <token>`` metadata. Two optional tokens:

| method                                 | no tokens | service token set | + admin token  |
|----------------------------------------|-----------|-------------------|----------------|
| ``grpc.health.v1.Health/*`` (probes)   | open      | open              | open           |
| ``Executor/Capture`` (admin)           | open      | service or admin  | admin only     |
| everything else (steps, reflection...) | open      | service or admin  | service or admin |

With only an admin token, everything but Capture is open. No valid token: UNAUTHENTICATED;
the service token on Capture when an admin token exists: PERMISSION_DENIED (known caller,
missing permission). Tokens come from files or the environment (read once, ``cli.py``), are
compared in constant time and never logged (``Secret`` hides its value from ``repr``).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from service.errors import PermissionDenied, Unauthenticated

HEALTH_SERVICE_PREFIX = "/grpc.health.v1.Health/"
ADMIN_METHODS = frozenset({"/model_executor.v1.Executor/Capture"})
AUTHORIZATION = "authorization"


@dataclass(frozen=True, repr=False)
class Secret:
    """A token. ``repr``/``str`` never show it, so configs can be logged safely."""

    value: str

    def __post_init__(self) -> None:
        if not self.value or any(c.isspace() for c in self.value):
            raise ValueError("a token must be non-empty and contain no whitespace")

    def matches(self, presented: str) -> bool:
        return hmac.compare_digest(self.value.encode(), presented.encode())

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


def read_secret(path: str | None, env: dict[str, str], env_name: str) -> Secret | None:
    """The token in file ``path`` (surrounding whitespace stripped), else in ``env_name``."""
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the token file {path!r}: {exc.strerror}") from exc
        if not text:
            raise ValueError(f"the token file {path!r} is empty")
        return Secret(text)
    text = env.get(env_name, "").strip()
    return Secret(text) if text else None


@dataclass(frozen=True)
class AuthConfig:
    token: Secret | None = None  # steps, Release, Executor/Health, reflection
    admin_token: Secret | None = None  # Capture (when set)

    @property
    def enabled(self) -> bool:
        return self.token is not None or self.admin_token is not None


def bearer(metadata: Any) -> str | None:
    """The bearer token of ``authorization`` metadata; None if absent or another scheme."""
    for key, value in metadata or ():
        if key == AUTHORIZATION:
            scheme, _, token = str(value).strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def check(config: AuthConfig, method: str, token: str | None) -> Exception | None:
    """The error to fail ``method`` with for ``token`` (None: allowed). Pure."""
    if method.startswith(HEALTH_SERVICE_PREFIX):
        return None
    admin = config.admin_token is not None and token is not None and \
        config.admin_token.matches(token)
    service = config.token is not None and token is not None and config.token.matches(token)
    if method in ADMIN_METHODS and config.admin_token is not None:
        if admin:
            return None
        if service:
            return PermissionDenied("Capture needs the admin token; the service token was "
                                    "presented")
        return Unauthenticated(_why(token, "the admin token"))
    if config.token is None or admin or service:
        return None
    return Unauthenticated(_why(token, "a valid token"))


def _why(token: str | None, needed: str) -> str:
    if token is None:
        return f"missing credentials: send 'authorization: Bearer <token>' with {needed}"
    return f"invalid token: {needed} is required"


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the token their method needs (see the module docstring).

    It sits inside ``ServiceInterceptor``, so a refusal is logged, counted and turned into
    a status like any other error; the refused call's handler never runs.
    """

    def __init__(self, config: AuthConfig) -> None:
        self._config = config

    async def intercept_service(self, continuation: Continuation,
                                handler_call_details: grpc.HandlerCallDetails
                                ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or not self._config.enabled:
            return handler
        error = check(self._config, handler_call_details.method,
                      bearer(handler_call_details.invocation_metadata))
        return handler if error is None else _refusing(handler, error)


def _refusing(handler: grpc.RpcMethodHandler, error: Exception) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that fails with ``error``."""
    args = (handler.request_deserializer, handler.response_serializer)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise error

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise error
        yield  # an async generator, like the streaming handler it replaces

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, *args)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, *args)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, *args)
    return grpc.stream_stream_rpc_method_handler(stream, *args)
