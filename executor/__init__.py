"""model-executor's device side: model, KV cache, attention, graphs, sampling.

The package's face for the service: ``Executor`` (the facade), ``PendingStep`` (a launched
step), ``run_follower`` (the loop of a tensor-parallel rank other than 0) and
``sampling_violations``. They import torch on first use, so ``import executor.config``
stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from executor.executor import Executor
    from executor.follower import run as run_follower
    from executor.steps import PendingStep
    from executor.validation import sampling_violations

__version__ = "0.1.0"
__all__ = ["Executor", "PendingStep", "__version__", "run_follower", "sampling_violations"]

_FACE = {"Executor": ("executor.executor", "Executor"),
         "PendingStep": ("executor.steps", "PendingStep"),
         "run_follower": ("executor.follower", "run"),
         "sampling_violations": ("executor.validation", "sampling_violations")}


def __getattr__(name: str) -> Any:
    if name not in _FACE:
        raise AttributeError(f"module 'executor' has no attribute {name!r}")
    module, attr = _FACE[name]
    return getattr(importlib.import_module(module), attr)
