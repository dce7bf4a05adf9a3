"""Server interceptors at the request boundary.

``ServiceInterceptor`` (outermost): the error boundary. For every call it binds
``request_id`` / ``rpc`` / ``peer`` into structlog's contextvars, counts it, and on the way
out either records OK or turns the exception into a gRPC status with google.rpc details
(``service/errors.py``), logging bugs with their traceback. It ends with one summary line
per RPC. Servicers therefore never catch or abort themselves. It is also where admission
happens (``service/admission.py``): each kind of call counts against its own budget, so
neither long-lived streams nor queued steps can starve the health probes.

``ParseInterceptor`` (innermost): a unary request that is not valid protobuf for its method
reaches the handler as ``Malformed`` and fails with INVALID_ARGUMENT inside the boundary,
instead of gRPC's own UNKNOWN before any interceptor sees it (not logged, not counted).
"""

from __future__ import annotations

import asyncio
import inspect
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
import structlog

from executor.errors import FieldViolation, InvalidRequest
from service import errors
from service.admission import Admission, Kind, kind_of
from service.stats import StatsRecorder

log = structlog.get_logger(__name__)

REQUEST_ID_HEADER = "x-request-id"


def _metadata_value(text: str) -> str:
    """``text`` as a valid ASCII metadata value: a request id from the body may hold any
    Unicode or control characters, which gRPC would refuse (failing the whole call)."""
    if text.isascii() and text.isprintable():
        return text
    return urllib.parse.quote(text, safe="")
MAX_HEADER_REQUEST_ID = 128
# Probes and tools call these every few seconds; their summary lines go to DEBUG.
QUIET_RPCS = frozenset({"grpc.health.v1.Health/Check", "grpc.health.v1.Health/Watch",
                        "grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                        "grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                        "model_executor.v1.Executor/Health"})

# Refusals by auth are logged at WARNING (probing a service without credentials is worth
# an operator's attention), at most once per interval per method and code, with a count of
# the lines held back, so a scanner cannot flood the log.
AUTH_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
AUTH_LOG_INTERVAL_S = 10.0

Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]


class RateLimiter:
    """``allow(key)``: the count of events held back for ``key`` since the last one allowed,
    or None to hold this one back. At most one event per ``interval_s`` per key; keys come
    from small fixed sets (method, code)."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval = interval_s
        self._clock = clock
        self._last: dict[Any, float] = {}
        self._held: dict[Any, int] = {}

    def allow(self, key: Any) -> int | None:
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._interval:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._held.pop(key, 0)

    def overdue(self, everything: bool = False) -> dict[Any, int]:
        """Take the held-back counts whose interval is over (all of them with
        ``everything``), as if an event of each key were allowed now: {key: count}."""
        now = self._clock()
        due = {key: n for key, n in self._held.items()
               if everything or now - self._last[key] >= self._interval}
        for key in due:
            del self._held[key]
            self._last[key] = now
        return due


@dataclass
class _Call:
    service: str
    method: str
    rpc_type: str
    request_id: str
    started: float


Wrap = Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler]


class _HandlerCache:
    """``wrap(method, inner)`` by method, reused while the inner handler is the same object.

    Wrapping depends only on the method and the inner handler, so building it once per
    method (not once per call) takes that work off every RPC. A handler that differs from
    the cached one (an auth refusal is built per call) is wrapped for that call only.
    """

    def __init__(self, wrap: Wrap) -> None:
        self._wrap = wrap
        self._by_method: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def get(self, method: str, inner: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        cached = self._by_method.get(method)
        if cached is not None and cached[0] is inner:
            return cached[1]
        wrapped = self._wrap(method, inner)
        if cached is None:
            self._by_method[method] = (inner, wrapped)
        return wrapped


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, recorder: StatsRecorder,
                 on_fatal: Callable[[BaseException], Awaitable[None]],
                 admission: Admission | None = None, log_successes: bool = True) -> None:
        self._recorder = recorder
        self._log_successes = log_successes
        self._on_fatal = on_fatal
        self._admission = admission
        self._handlers = _HandlerCache(self._wrap)
        self._auth_log = RateLimiter(AUTH_LOG_INTERVAL_S)

    @contextmanager
    def _admitted(self, kind: Kind) -> Iterator[None]:
        """Hold a slot of ``kind`` for the call (raises ``Overloaded`` over the budget)."""
        admission = self._admission
        if admission is None:
            yield
            return
        admission.enter(kind)
        try:
            yield
        finally:
            admission.leave(kind)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED; not counted
            return None
        return self._handlers.get(handler_call_details.method, handler)

    def log_held_back(self, everything: bool = False) -> None:
        """Say the ``auth_refused`` lines held back whose interval is over (``everything``:
        all, at shutdown), so a count never waits for the next refusal of its kind."""
        for (service, method, code), count in self._auth_log.overdue(everything).items():
            log.warning("auth_refused_held_back", rpc=f"{service.rsplit('.', 1)[-1]}/{method}",
                        code=code.name, held_back=count, every_s=AUTH_LOG_INTERVAL_S)

    def _wrap(self, full: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` inside the error boundary; ``full`` is "/pkg.Service/Method"."""
        service, _, method = full.lstrip("/").partition("/")
        args = (handler.request_deserializer, handler.response_serializer)
        kind = kind_of(full)

        def wrap(behavior: Behavior, rpc_type: str) -> Behavior:
            if inspect.isasyncgenfunction(behavior):
                return self._stream(behavior, service, method, rpc_type, kind)
            return self._unary(behavior, service, method, rpc_type, kind)

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, "unary"), *args)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                wrap(handler.unary_stream, "server_stream"), *args)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                wrap(handler.stream_unary, "client_stream"), *args)
        return grpc.stream_stream_rpc_method_handler(
            wrap(handler.stream_stream, "bidi_stream"), *args)

    # -- wrappers -----------------------------------------------------------------------
    def _unary(self, behavior: Behavior, service: str, method: str, rpc_type: str,
               kind: Kind) -> Behavior:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            call = self._begin(service, method, rpc_type, request, context)
            try:
                with self._admitted(kind):
                    response = await behavior(request, context)
            except BaseException as exc:
                await self._fail(call, exc, context)
            self._finish(call, grpc.StatusCode.OK, context)
            return response

        return handle

    def _stream(self, behavior: Behavior, service: str, method: str, rpc_type: str,
                kind: Kind) -> Behavior:
        async def handle(request: Any, context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[Any]:
            call = self._begin(service, method, rpc_type, request, context)
            try:
                with self._admitted(kind):
                    async for response in behavior(request, context):
                        yield response
            except GeneratorExit:  # the client went away; nothing may be awaited here
                self._end(call, grpc.StatusCode.CANCELLED)
                raise
            except BaseException as exc:
                await self._fail(call, exc, context)
            self._finish(call, grpc.StatusCode.OK, context)

        return handle

    # -- bookkeeping --------------------------------------------------------------------
    def _begin(self, service: str, method: str, rpc_type: str, request: Any,
               context: grpc.aio.ServicerContext) -> _Call:
        body_id = getattr(request, "request_id", "") if rpc_type == "unary" else ""
        # Bounded: an over-long id is refused by validation, but logged (cut) first.
        request_id = (str(body_id)[:MAX_HEADER_REQUEST_ID] or _header_id(context)
                      or uuid.uuid4().hex[:16])
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(
            request_id=request_id, rpc=f"{service.rsplit('.', 1)[-1]}/{method}",
            peer=context.peer())
        self._recorder.rpc_started(service, method, rpc_type)
        return _Call(service, method, rpc_type, request_id, time.perf_counter())

    def _finish(self, call: _Call, code: grpc.StatusCode,
                context: grpc.aio.ServicerContext) -> None:
        context.set_trailing_metadata(((REQUEST_ID_HEADER, _metadata_value(call.request_id)),))
        self._end(call, code)

    def _end(self, call: _Call, code: grpc.StatusCode,
             exc: BaseException | None = None, status: Any = None) -> None:
        """Record and log the call's outcome. ``exc``: a bug (logged with its traceback);
        ``status``: the google.rpc.Status of an expected error (its reason and message go
        into the line, so a refusal can be understood from the log alone)."""
        seconds = time.perf_counter() - call.started
        self._recorder.rpc_handled(call.service, call.method, call.rpc_type, code, seconds)
        fields: dict[str, Any] = {"code": code.name, "duration_ms": round(seconds * 1e3, 3)}
        if status is not None:
            reason = errors.reason_of(status)
            if reason:
                fields["reason"] = reason
            fields["message"] = status.message
        if exc is not None:
            log.error("rpc", **fields, exc_info=exc)
            return
        if code in AUTH_CODES:
            held = self._auth_log.allow((call.service, call.method, code))
            if held is not None:
                log.warning("auth_refused", **fields, held_back=held,
                            every_s=AUTH_LOG_INTERVAL_S)
        if code is grpc.StatusCode.OK and not self._log_successes:
            return  # --rpc-log errors: the metrics still count the call
        if f"{call.service}/{call.method}" in QUIET_RPCS:
            log.debug("rpc", **fields)
        else:
            log.info("rpc", **fields)

    async def _fail(self, call: _Call, exc: BaseException,
                    context: grpc.aio.ServicerContext) -> NoReturn:
        if isinstance(exc, asyncio.CancelledError):
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= 0
            self._end(call, grpc.StatusCode.DEADLINE_EXCEEDED if expired
                      else grpc.StatusCode.CANCELLED)
            raise exc
        if isinstance(exc, grpc.aio.AbortError):  # a handler aborted on its own
            self._end(call, _code_of(context))
            raise exc
        status = errors.to_status(exc, call.request_id)
        code = errors.grpc_code(status)
        self._recorder.error(exc)
        if errors.is_fatal_device_error(exc):
            await self._on_fatal(exc)
        expected = errors.is_expected(exc)
        self._end(call, code, None if expected else exc, status if expected else None)
        await context.abort(code, status.message, trailing_metadata=(
            ("grpc-status-details-bin", status.SerializeToString()),
            (REQUEST_ID_HEADER, _metadata_value(call.request_id)),
        ))
        raise AssertionError("context.abort() returned")  # it raises; this keeps mypy sure


def _header_id(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_HEADER:
            return str(value)[:MAX_HEADER_REQUEST_ID]
    return ""


@dataclass(frozen=True)
class Malformed:
    """What a unary request that failed to parse becomes (see ``ParseInterceptor``)."""

    error: str


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError and friends: the client's bytes are wrong
            return Malformed(str(exc) or type(exc).__name__)

    return parse


class ParseInterceptor(grpc.aio.ServerInterceptor):
    """Unparseable unary requests fail with INVALID_ARGUMENT (see the module docstring)."""

    def __init__(self) -> None:
        self._handlers = _HandlerCache(_tolerant_handler)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler  # a stream's messages parse inside the handler (DecodeError)
        return self._handlers.get(handler_call_details.method, handler)


def _tolerant_handler(_: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` with a parser that turns bad bytes into ``Malformed``."""
    behavior = handler.unary_unary or handler.unary_stream
    parse = _tolerant(handler.request_deserializer)
    wrap = grpc.unary_unary_rpc_method_handler if handler.unary_unary else \
        grpc.unary_stream_rpc_method_handler
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[Any]:
            async for response in behavior(_parsed(request), context):
                yield response

        return wrap(stream, parse, handler.response_serializer)

    # A unary handler, or a streaming one that writes with context.write().
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(_parsed(request), context)

    return wrap(unary, parse, handler.response_serializer)


def _parsed(request: Any) -> Any:
    if isinstance(request, Malformed):
        raise InvalidRequest([FieldViolation("", f"the request could not be parsed: "
                                                 f"{request.error}")])
    return request


def _code_of(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):
        return errors.GRPC_CODES.get(code, grpc.StatusCode.UNKNOWN)
    return grpc.StatusCode.UNKNOWN
