"""Typed errors raised by the executor.

The gRPC layer maps each class to one status code (see ``service/errors.py``); nothing here
knows about gRPC. Every error is raised *before* any state is changed, so a caller that
catches one can assume the executor is exactly as it was before the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


class ExecutorError(Exception):
    """Base class of every error the executor raises on purpose."""


@dataclass(frozen=True)
class FieldViolation:
    """One problem with one request field, e.g. ``items[2].token_ids[5]``."""

    field: str
    description: str


class InvalidRequest(ExecutorError):
    """The request is malformed; nothing was applied. Maps to INVALID_ARGUMENT.

    Carries every violation found, not only the first, so a client can fix them at once.
    """

    def __init__(self, violations: list[FieldViolation]) -> None:
        if not violations:
            raise ValueError("InvalidRequest needs at least one violation")
        self.violations = list(violations)
        shown = "; ".join(f"{v.field}: {v.description}" for v in self.violations[:5])
        more = f" (+{len(self.violations) - 5} more)" if len(self.violations) > 5 else ""
        super().__init__(shown + more)


class ContextLengthExceeded(InvalidRequest):
    """A sequence would grow past ``max_context`` tokens. Maps to INVALID_ARGUMENT."""


class SequenceNotFound(ExecutorError):
    """A ``seq_id`` that must exist (decode, truncate, fork) is unknown. Maps to NOT_FOUND."""

    def __init__(self, seq_ids: list[str], field_names: list[str]) -> None:
        self.seq_ids = list(seq_ids)
        self.field_names = list(field_names)
        super().__init__(
            f"unknown seq_id(s) {self.seq_ids!r}: only sequences admitted by Prefill and not "
            "yet released can be decoded, truncated or forked"
        )


Resource = Literal["kv_tokens", "sequence_slots"]


Shortage = tuple[Resource, int, int]  # (resource, needed, free)


def _unit(resource: Resource) -> str:
    return "KV tokens" if resource == "kv_tokens" else "sequence slots"


class OutOfResources(ExecutorError):
    """Not enough KV tokens or sequence slots for the whole call; nothing was allocated.

    Maps to RESOURCE_EXHAUSTED. ``needed`` and ``free`` are in the resource's unit; when
    both resources are short, ``also`` names the second, and ``shortages`` lists every one.
    """

    def __init__(self, resource: Resource, needed: int, free: int,
                 also: tuple[Shortage, ...] = ()) -> None:
        self.resource: Resource = resource
        self.needed = needed
        self.free = free
        self.shortages: tuple[Shortage, ...] = ((resource, needed, free), *also)
        short = " and ".join(f"{_unit(r)} (the call needs {n}, {f} are free)"
                             for r, n, f in self.shortages)
        super().__init__(f"out of {short}; release finished sequences or retry later")


class GraphsUnavailable(ExecutorError):
    """CUDA graphs cannot be captured in this process. Maps to FAILED_PRECONDITION."""


class StateConflict(ExecutorError):
    """The executor's state forbids the call (asleep, discarded weights, a transfer group
    missing or already there); nothing was applied. Maps to FAILED_PRECONDITION, with
    ``reason`` as the ErrorInfo reason."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class TransferUnavailable(ExecutorError):
    """The trainer's weight-transfer group could not be joined, or an update's source
    failed before any weight was written; nothing changed. Maps to UNAVAILABLE, with
    ``reason`` as the ErrorInfo reason."""

    def __init__(self, message: str, reason: str = "TRANSFER_GROUP_UNREACHABLE") -> None:
        super().__init__(message)
        self.reason = reason


class WeightUpdateFailed(ExecutorError):
    """A weight update failed while copying: the model holds a mix of versions and must
    not serve. Maps to DATA_LOSS, and the server turns UNHEALTHY."""
class GrammarUnavailable(ExecutorError):
    """Grammars cannot be compiled: the served model has no tokenizer. Maps to
    FAILED_PRECONDITION."""


class ModelLoadError(ExecutorError):
    """The model directory or its config cannot be served (start-up error)."""


class ConfigError(ExecutorError, ValueError):
    """An invalid executor configuration (start-up error)."""
