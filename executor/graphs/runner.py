"""The interface the executor sees of a phase's graph runner."""

from __future__ import annotations

from typing import Protocol

import torch

from executor.api import PhaseCapture
from executor.forward_batch import ForwardBatch
from executor.graphs.dispatch import RunnerState
from executor.packing import GraphLayout


class PhaseRunner(Protocol):
    def state(self) -> RunnerState:
        """Snapshot for the graph-or-eager decision."""
        ...

    def capture_all(self, force: bool = False, progress: bool = True) -> PhaseCapture:
        """Capture every bucket not yet captured (all of them again with ``force``)."""
        ...

    def layout(self, bucket: int) -> GraphLayout:
        """How to pack a batch that will replay ``bucket`` (a captured one), so that the
        replay finds it in place; such a batch publishes its table entries itself."""
        ...

    def replay(self, batch: ForwardBatch, bucket: int) -> torch.Tensor:
        """Run ``batch``, packed for ``bucket`` with ``layout(bucket)`` (any other batch is
        refused); logits of ``batch.logits_indices`` in the model's activation dtype
        (``CausalModel.compute_logits``), valid until the runner's next replay."""
        ...

    @property
    def runs_uncaptured(self) -> bool:
        """Whether ``run_uncaptured`` beats the plain eager model (compiled pieces)."""
        ...

    def run_uncaptured(self, batch: ForwardBatch) -> torch.Tensor:
        """Run a batch that fits no captured bucket without graphs; logits as ``replay``."""
        ...

    def captured_sizes(self) -> tuple[int, ...]: ...

    def drain_replay_seconds(self) -> list[float]:
        """Durations of finished replays since the last call (no host sync)."""
        ...

    def release(self) -> None: ...
