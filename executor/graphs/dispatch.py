""""Which graph?" as one small pure decision, apart from capture and replay.

``decide`` maps a hashable ``GraphKey`` plus the runner's state to either a bucket to
replay or the reason the step runs eagerly. Every reason is a small enum value, used as
``StepInfo.fallback_reason`` and as the ``reason`` label of
``model_executor_eager_fallbacks_total``.
"""

from __future__ import annotations

from dataclasses import dataclass

from executor.api import FallbackReason, Phase
from executor.graphs.buckets import bucket_for

# Padding may at most double the work of a bucket at least this large; below it,
# padding is cheaper than leaving the graph.
PADDING_GUARD_MIN_BUCKET = 256


@dataclass(frozen=True)
class GraphKey:
    phase: Phase
    size: int  # batch size (decode) or packed tokens (prefill)


@dataclass(frozen=True)
class RunnerState:
    """What a phase runner knows about its graphs (immutable snapshot)."""

    cuda: bool
    enabled: bool
    buckets: tuple[int, ...]
    captured: frozenset[int]
    failed: frozenset[int]


@dataclass(frozen=True)
class Decision:
    bucket: int | None
    reason: FallbackReason | None

    @property
    def use_graph(self) -> bool:
        return self.bucket is not None


def decide(key: GraphKey, state: RunnerState) -> Decision:
    if not state.cuda:
        return Decision(None, FallbackReason.NO_CUDA)
    if not state.enabled:
        return Decision(None, FallbackReason.DISABLED)
    bucket = bucket_for(key.size, state.buckets)
    if bucket is None:
        return Decision(None, FallbackReason.TOO_LARGE)
    if bucket >= PADDING_GUARD_MIN_BUCKET and bucket > 2 * key.size:
        return Decision(None, FallbackReason.PADDING)
    if bucket in state.failed:
        return Decision(None, FallbackReason.CAPTURE_FAILED)
    if bucket not in state.captured:
        return Decision(None, FallbackReason.NOT_CAPTURED)
    return Decision(bucket, None)
