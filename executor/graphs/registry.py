"""Capture backends by graph-mode name (modes come from ``config.resolve_graph_modes``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from executor.config import GraphConfig
from executor.errors import ConfigError
from executor.graphs.backends import CaptureBackend, FullGraphBackend
from executor.graphs.breakable import BreakableGraphBackend


def _tc_piecewise(device: torch.device, graphs: GraphConfig, model_key: str) -> CaptureBackend:
    from executor.graphs.piecewise.backend import PiecewiseCompileBackend  # imports Dynamo

    return PiecewiseCompileBackend(
        device, graphs.compiler,
        cache_dir=Path(graphs.compile_cache_dir) if graphs.compile_cache_dir else None,
        cache_key=model_key,
        debug_dir=Path(graphs.compile_debug_dir) if graphs.compile_debug_dir else None)


# Each factory gets (device, graph config, model key); the key names the model's weights
# layout for on-disk compile caches.
_BACKENDS: dict[str, Callable[[torch.device, GraphConfig, str], CaptureBackend]] = {
    "full": lambda device, _graphs, _key: FullGraphBackend(device),
    "breakable": lambda device, _graphs, _key: BreakableGraphBackend(device),
    "tc_piecewise": _tc_piecewise,
}


def make_capture_backend(mode: str, device: torch.device, graphs: GraphConfig,
                         model_key: str) -> CaptureBackend:
    if mode not in _BACKENDS:
        raise ConfigError(f"graph mode {mode!r} has no capture backend; "
                          f"available: {', '.join(_BACKENDS)}")
    return _BACKENDS[mode](device, graphs, model_key)
