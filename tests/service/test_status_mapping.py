"""The exception -> status table, without a server."""

from __future__ import annotations

from typing import Any

import pytest
from google.rpc import code_pb2, error_details_pb2

from executor.errors import (
    ContextLengthExceeded,
    FieldViolation,
    GraphsUnavailable,
    InvalidRequest,
    OutOfResources,
    SequenceNotFound,
)
from service.errors import (
    DeadlineExpired,
    Unavailable,
    is_expected,
    is_fatal_device_error,
    to_status,
)

CASES = [
    (InvalidRequest([FieldViolation("items[0].seq_id", "empty")]), code_pb2.INVALID_ARGUMENT,
     error_details_pb2.BadRequest),
    (ContextLengthExceeded([FieldViolation("items[0].token_ids", "too long")]),
     code_pb2.INVALID_ARGUMENT, error_details_pb2.BadRequest),
    (SequenceNotFound(["x"], ["items[0].seq_id"]), code_pb2.NOT_FOUND,
     error_details_pb2.ResourceInfo),
    (OutOfResources("kv_tokens", 10, 3), code_pb2.RESOURCE_EXHAUSTED,
     error_details_pb2.QuotaFailure),
    (GraphsUnavailable("no CUDA"), code_pb2.FAILED_PRECONDITION,
     error_details_pb2.PreconditionFailure),
    (Unavailable("starting", 1.0), code_pb2.UNAVAILABLE, error_details_pb2.RetryInfo),
    (DeadlineExpired("late"), code_pb2.DEADLINE_EXCEEDED, None),
    (KeyError("bug"), code_pb2.INTERNAL, error_details_pb2.ErrorInfo),
]


@pytest.mark.parametrize(("exc", "code", "detail"), CASES)
def test_each_error_class_has_one_code(exc: Exception, code: int, detail: Any) -> None:
    status = to_status(exc, "rid-1")
    assert status.code == code
    assert is_expected(exc) == (code != code_pb2.INTERNAL)
    if detail is not None:
        assert status.details[0].Is(detail.DESCRIPTOR)
    if code == code_pb2.INTERNAL:
        assert "rid-1" in status.message and "KeyError" in status.message


def test_fatal_device_errors() -> None:
    assert is_fatal_device_error(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_fatal_device_error(RuntimeError("CUDA out of memory. Tried to allocate"))
    assert not is_fatal_device_error(ValueError("CUDA error"))  # not a runtime error
    assert not is_fatal_device_error(ZeroDivisionError())
