"""Exceptions to gRPC status: one table from error class to code and google.rpc details.

Nothing here touches a call: ``to_status`` builds a ``google.rpc.Status`` and the
interceptor (the one error boundary) sends it.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2

from executor.errors import (
    FieldViolation,
    GrammarUnavailable,
    GraphsUnavailable,
    InvalidRequest,
    OutOfResources,
    SequenceNotFound,
    StateConflict,
    TransferUnavailable,
    WeightUpdateFailed,
)
from service.admission import Overloaded
from service.gen.model_executor.v1 import executor_pb2 as pb

DOMAIN = "model_executor.v1"
SEQUENCE_RESOURCE = "model_executor.v1.Sequence"
RETRY_AFTER_OUT_OF_RESOURCES_S = 0.1

# Bounds on what one error puts in its trailers. gRPC-core clients (Python, C++, Ruby) drop
# a response whose metadata exceeds 16 KiB (and, at random, some over 8 KiB) and report
# RESOURCE_EXHAUSTED "received metadata size exceeds hard limit" instead of the real status.
# With these bounds the message (percent-encoded: 3 bytes per non-ASCII byte at worst) and
# the details (base64: 4/3) stay under about 5 KiB together, whatever the request held.
MAX_DETAIL_ITEMS = 10  # field violations / resources listed; the rest are counted
MAX_DETAIL_CHARS = 160  # one field name, description or resource name
MAX_MESSAGE_BYTES = 512  # grpc-message, in UTF-8 bytes


class Unavailable(Exception):
    """The server cannot take the call in its current state (starting, draining, ...)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StartupError(Exception):
    """The server cannot start (a port in use, ...); the message says what to do. Logged
    as one line, without a traceback."""


class OutcomeUnknown(Exception):
    """The server stopped waiting for a step that was still running (its grace period
    ended): the step may have applied. Maps to CANCELLED, whose documented meaning is
    "outcome unknown"."""


class DeadlineExpired(Exception):
    """The call's deadline passed while it waited for the executor; it never ran."""


class Unauthenticated(Exception):
    """No valid credentials for the method (``service/auth.py``)."""


class PermissionDenied(Exception):
    """Valid credentials that do not carry the permission the method needs."""


class ResponseExpired(Exception):
    """A retry of a call that succeeded, whose response is no longer kept: it cannot be
    answered and must not run again. Maps to ABORTED (resynchronise at a higher level)."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(
            f"request_id {request_id!r} already succeeded, and its response was dropped "
            f"({reason}); it is not run again. Treat the call as applied: release the "
            "sequences concerned, or query Health, and continue from there")
        self.request_id = request_id
        self.reason = reason


class StepAborted(Exception):
    """A Session step refused or rolled back because an earlier step of its session
    failed; nothing of it applied."""


class SessionIdle(Exception):
    """The server closed a Session stream that had nothing to do (no step unanswered, no
    new request) for ``timeout_s`` seconds. Maps to DEADLINE_EXCEEDED with reason
    ``SESSION_IDLE_TIMEOUT``: nothing was in flight, so nothing is lost."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"the Session stream had no request and no step unanswered for {timeout_s:g} s "
            "(--session-idle-timeout) and was closed; nothing was in flight: open a new "
            "Session when there is work")
        self.timeout_s = timeout_s


def _pack(*details: object) -> list[any_pb2.Any]:
    packed = []
    for detail in details:
        item = any_pb2.Any()
        item.Pack(detail)  # type: ignore[arg-type]
        packed.append(item)
    return packed


def _retry(seconds: float) -> error_details_pb2.RetryInfo:
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(seconds * 1e9))
    return error_details_pb2.RetryInfo(retry_delay=delay)


def _cut(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """``text`` cut to ``limit`` characters, marked with an ellipsis when cut."""
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def bounded_message(text: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes (on a character boundary)."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode(errors="ignore") + "\u2026"


def _more(total: int, shown: int, what: str) -> str:
    return f" (+{total - shown} more {what} not listed)" if total > shown else ""


def _invalid(exc: InvalidRequest) -> status_pb2.Status:
    shown = exc.violations[:MAX_DETAIL_ITEMS]
    violations = [error_details_pb2.BadRequest.FieldViolation(
        field=_cut(v.field), description=_cut(v.description)) for v in shown]
    if len(exc.violations) > len(shown):
        # The last entry counts what was left out, so a client knows the list is partial.
        violations.append(error_details_pb2.BadRequest.FieldViolation(
            field="", description=f"{len(exc.violations) - len(shown)} more violations not "
            f"listed ({len(exc.violations)} in all)"))
    head = "; ".join(f"{v.field}: {v.description}" for v in violations[:3])
    message = f"{len(exc.violations)} invalid field(s): {head}" \
        f"{_more(len(exc.violations), min(3, len(shown)), 'violations')}"
    return status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=message,
                             details=_pack(error_details_pb2.BadRequest(
                                 field_violations=violations)))


def _not_found(exc: SequenceNotFound) -> status_pb2.Status:
    pairs = list(zip(exc.seq_ids, exc.field_names, strict=False))
    infos = [
        error_details_pb2.ResourceInfo(
            resource_type=SEQUENCE_RESOURCE, resource_name=_cut(seq_id),
            description=f"{_cut(field, 40)}: no such sequence (never admitted, or already "
                        "released)")
        for seq_id, field in pairs[:MAX_DETAIL_ITEMS]
    ]
    total = len(exc.seq_ids)
    info = error_details_pb2.ErrorInfo(reason="SEQUENCE_NOT_FOUND", domain=DOMAIN,
                                       metadata={"unknown_seq_ids": str(total)})
    named = ", ".join(repr(_cut(s, 40)) for s in exc.seq_ids[:3])
    message = (f"{total} unknown seq_id(s): {named}{_more(total, min(3, total), 'ids')}; "
               "only sequences admitted by Prefill and not yet released can be decoded, "
               "truncated or forked")
    return status_pb2.Status(code=code_pb2.NOT_FOUND, message=message,
                             details=_pack(*infos, info))


def _exhausted(exc: OutOfResources) -> status_pb2.Status:
    # One violation per short resource; ErrorInfo names the first (KV tokens when both).
    quota = error_details_pb2.QuotaFailure(violations=[
        error_details_pb2.QuotaFailure.Violation(subject=resource,
                                                 description=f"needed {needed}, free {free}")
        for resource, needed, free in exc.shortages])
    info = error_details_pb2.ErrorInfo(
        reason=f"{exc.resource.upper()}_EXHAUSTED", domain=DOMAIN,
        metadata={"resource": exc.resource, "needed": str(exc.needed), "free": str(exc.free)})
    return status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=str(exc),
                             details=_pack(quota, info, _retry(RETRY_AFTER_OUT_OF_RESOURCES_S)))


_OVERLOAD_REASONS = {"watch": "WATCH_STREAMS_EXHAUSTED", "session": "SESSION_STREAMS_EXHAUSTED",
                     "reflection": "REFLECTION_STREAMS_EXHAUSTED"}


def _overloaded(exc: Overloaded) -> status_pb2.Status:
    reason = _OVERLOAD_REASONS.get(exc.kind, "OVERLOADED")
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata={
        "kind": exc.kind, "limit": str(exc.limit)})
    return status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=str(exc),
                             details=_pack(info, _retry(exc.retry_after_s)))


def _graphs_unavailable(exc: GraphsUnavailable) -> status_pb2.Status:
    failure = error_details_pb2.PreconditionFailure(violations=[
        error_details_pb2.PreconditionFailure.Violation(
            type="CUDA_GRAPHS", subject="executor", description=str(exc))])
    return status_pb2.Status(code=code_pb2.FAILED_PRECONDITION, message=str(exc),
                             details=_pack(failure))


def _state_conflict(exc: StateConflict) -> status_pb2.Status:
    failure = error_details_pb2.PreconditionFailure(violations=[
        error_details_pb2.PreconditionFailure.Violation(
            type=exc.reason, subject="executor", description=_cut(str(exc)))])
    info = error_details_pb2.ErrorInfo(reason=exc.reason, domain=DOMAIN)
    return status_pb2.Status(code=code_pb2.FAILED_PRECONDITION, message=str(exc),
                             details=_pack(failure, info))


def _transfer_unavailable(exc: TransferUnavailable) -> status_pb2.Status:
    info = error_details_pb2.ErrorInfo(reason=exc.reason, domain=DOMAIN)
    return status_pb2.Status(code=code_pb2.UNAVAILABLE, message=str(exc), details=_pack(info))


def _weights_corrupted(exc: WeightUpdateFailed) -> status_pb2.Status:
    info = error_details_pb2.ErrorInfo(reason="WEIGHT_UPDATE_FAILED", domain=DOMAIN)
    return status_pb2.Status(code=code_pb2.DATA_LOSS, message=str(exc), details=_pack(info))
def _grammar_unavailable(exc: GrammarUnavailable) -> status_pb2.Status:
    failure = error_details_pb2.PreconditionFailure(violations=[
        error_details_pb2.PreconditionFailure.Violation(
            type="TOKENIZER", subject="model", description=str(exc))])
    return status_pb2.Status(code=code_pb2.FAILED_PRECONDITION, message=str(exc),
                             details=_pack(failure))


def _unavailable(exc: Unavailable) -> status_pb2.Status:
    details = _pack(_retry(exc.retry_after_s)) if exc.retry_after_s is not None else []
    return status_pb2.Status(code=code_pb2.UNAVAILABLE, message=str(exc), details=details)


def _deadline(exc: DeadlineExpired) -> status_pb2.Status:
    return status_pb2.Status(code=code_pb2.DEADLINE_EXCEEDED, message=str(exc))


def _session_idle(exc: SessionIdle) -> status_pb2.Status:
    info = error_details_pb2.ErrorInfo(reason="SESSION_IDLE_TIMEOUT", domain=DOMAIN, metadata={
        "idle_timeout_s": f"{exc.timeout_s:g}"})
    return status_pb2.Status(code=code_pb2.DEADLINE_EXCEEDED, message=str(exc),
                             details=_pack(info))


def _outcome_unknown(exc: OutcomeUnknown) -> status_pb2.Status:
    info = error_details_pb2.ErrorInfo(reason="STEP_OUTCOME_UNKNOWN", domain=DOMAIN)
    return status_pb2.Status(code=code_pb2.CANCELLED, message=str(exc), details=_pack(info))


def _undecodable(exc: DecodeError) -> status_pb2.Status:
    return _invalid(InvalidRequest([FieldViolation("", f"a message could not be parsed: "
                                                       f"{exc}")]))


def _unauthenticated(exc: Unauthenticated) -> status_pb2.Status:
    info = error_details_pb2.ErrorInfo(reason="UNAUTHENTICATED", domain=DOMAIN)
    return status_pb2.Status(code=code_pb2.UNAUTHENTICATED, message=str(exc),
                             details=_pack(info))


def _permission_denied(exc: PermissionDenied) -> status_pb2.Status:
    info = error_details_pb2.ErrorInfo(reason="ADMIN_TOKEN_REQUIRED", domain=DOMAIN)
    return status_pb2.Status(code=code_pb2.PERMISSION_DENIED, message=str(exc),
                             details=_pack(info))


def _expired(exc: ResponseExpired) -> status_pb2.Status:
    info = error_details_pb2.ErrorInfo(reason="RESPONSE_EXPIRED", domain=DOMAIN, metadata={
        "request_id": exc.request_id, "why": exc.reason})
    return status_pb2.Status(code=code_pb2.ABORTED, message=str(exc), details=_pack(info))


# Most specific class first: ``to_status`` takes the first match.
_TABLE: list[tuple[type[BaseException], Callable[..., status_pb2.Status]]] = [
    (InvalidRequest, _invalid),  # includes ContextLengthExceeded
    (SequenceNotFound, _not_found),
    (OutOfResources, _exhausted),
    (Overloaded, _overloaded),
    (GraphsUnavailable, _graphs_unavailable),
    (StateConflict, _state_conflict),
    (TransferUnavailable, _transfer_unavailable),
    (WeightUpdateFailed, _weights_corrupted),
    (GrammarUnavailable, _grammar_unavailable),
    (Unavailable, _unavailable),
    (DeadlineExpired, _deadline),
    (SessionIdle, _session_idle),
    (OutcomeUnknown, _outcome_unknown),
    (Unauthenticated, _unauthenticated),
    (PermissionDenied, _permission_denied),
    (ResponseExpired, _expired),
    (DecodeError, _undecodable),  # a streamed request message that is not protobuf
]


def to_status(exc: BaseException, request_id: str) -> status_pb2.Status:
    """The status for ``exc``; anything not in the table is a bug and maps to INTERNAL."""
    for cls, build in _TABLE:
        if isinstance(exc, cls):
            status = build(exc)
            status.message = bounded_message(status.message)
            return status
    info = error_details_pb2.ErrorInfo(reason="INTERNAL", domain=DOMAIN,
                                       metadata={"request_id": request_id})
    return status_pb2.Status(
        code=code_pb2.INTERNAL,
        message=f"internal error ({type(exc).__name__}); request_id={request_id} in the "
        "server log has the traceback",
        details=_pack(info))


def step_error(step: int, exc: BaseException, request_id: str) -> pb.SessionResponse:
    """A Session step's failure as its response (the stream itself stays open):
    ``StepAborted`` is ABORTED with reason STEP_ABORTED, anything else as ``to_status``
    (``request_id``: the id the step's failure is logged under)."""
    if isinstance(exc, StepAborted):
        status = status_pb2.Status(code=code_pb2.ABORTED, message=str(exc))
        status.details.add().Pack(error_details_pb2.ErrorInfo(
            reason="STEP_ABORTED", domain=DOMAIN))
    else:
        status = to_status(exc, request_id)
    code = grpc_code(status)
    return pb.SessionResponse(step=step, error=pb.StepError(
        code=code.value[0], code_name=code.name, message=status.message,
        status=status.SerializeToString()))


def reason_of(status: status_pb2.Status) -> str:
    """The ``ErrorInfo`` reason among ``status``'s details ("" if none)."""
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return str(info.reason)
    return ""


def is_expected(exc: BaseException) -> bool:
    """True for errors that are the client's or the state's, not a bug."""
    return any(isinstance(exc, cls) for cls, _ in _TABLE)


# Messages of errors after which the CUDA context cannot be trusted any more.
_FATAL_MARKERS = ("CUDA error", "device-side assert", "illegal memory access",
                  "CUBLAS_STATUS_EXECUTION_FAILED", "unspecified launch failure")


def is_fatal_device_error(exc: BaseException) -> bool:
    """True if ``exc`` means the device (and so this process) can no longer serve: also a
    failed tensor-parallel collective (a rank died or timed out: the group cannot step)
    and a weight update that failed while copying."""
    if isinstance(exc, WeightUpdateFailed):  # a mix of two versions must not serve
        return True
    accelerator_error = _accelerator_error_class()
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    if isinstance(exc, _dist_error_class()):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(m in text for m in _FATAL_MARKERS)


def _dist_error_class() -> tuple[type[BaseException], ...]:
    import torch.distributed as dist

    from executor.distributed import CollectiveFailed

    cls = getattr(dist, "DistError", None)
    return (CollectiveFailed, cls) if isinstance(cls, type) else (CollectiveFailed,)


def _accelerator_error_class() -> type[BaseException] | None:
    import torch

    cls = getattr(torch, "AcceleratorError", None)
    return cls if isinstance(cls, type) else None


GRPC_CODES: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def grpc_code(status: status_pb2.Status) -> grpc.StatusCode:
    return GRPC_CODES[status.code]
