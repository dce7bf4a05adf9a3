"""Capture backends by graph-mode name (modes come from ``config.resolve_graph_modes``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor.errors import ConfigError
from executor.graphs.backends import CaptureBackend, FullGraphBackend
from executor.graphs.breakable import BreakableGraphBackend

_BACKENDS: dict[str, Callable[[torch.device], CaptureBackend]] = {
    "full": FullGraphBackend,
    "breakable": BreakableGraphBackend,
}


def make_capture_backend(mode: str, device: torch.device) -> CaptureBackend:
    if mode not in _BACKENDS:
        raise ConfigError(f"graph mode {mode!r} has no capture backend in this build; "
                          f"available: {', '.join(_BACKENDS)}")
    return _BACKENDS[mode](device)
