"""Capture backends by graph-mode name, and graph-mode resolution (one table).

Each backend registers once with the phases it can serve, the phases for which ``auto``
picks it on CUDA, and why a phase cannot use it. Config validation, the CLI's help and
``resolve_graph_mode`` read this registry; nothing else lists graph modes. It imports no
torch (the CLI lists modes without loading it): factories import their backend when called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from executor.api import Phase
from executor.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from executor.config import GraphConfig
    from executor.graphs.backends import CaptureBackend

DISABLED = "disabled"
AUTO = "auto"
PHASES: tuple[Phase, ...] = ("decode", "prefill")

# Each factory gets (device, graph config, model key); the key names the model's weights
# layout for on-disk compile caches.
CaptureFactory = Callable[["torch.device", "GraphConfig", str], "CaptureBackend"]


@dataclass(frozen=True)
class CaptureEntry:
    name: str
    factory: CaptureFactory
    phases: frozenset[Phase]  # phases it can capture
    auto_for: frozenset[Phase]  # phases for which ``auto`` picks it on CUDA
    refused: Mapping[Phase, str] = field(default_factory=dict)  # why not, per phase


_REGISTRY: dict[str, CaptureEntry] = {}


def register_capture_backend(name: str, *, phases: tuple[Phase, ...],
                             auto_for: tuple[Phase, ...] = (),
                             refused: Mapping[Phase, str] | None = None
                             ) -> Callable[[CaptureFactory], CaptureFactory]:
    def register(factory: CaptureFactory) -> CaptureFactory:
        if name in _REGISTRY or name in (DISABLED, AUTO):
            raise ValueError(f"graph mode {name!r} registered twice")
        _REGISTRY[name] = CaptureEntry(name, factory, frozenset(phases), frozenset(auto_for),
                                       dict(refused or {}))
        return factory
    return register


@register_capture_backend("full", phases=("decode",), auto_for=("decode",), refused={
    "prefill": "prefill attention is variable-length, so a prefill forward cannot be one "
               "whole graph; use breakable or tc_piecewise"})
def _full(device: torch.device, graphs: GraphConfig, key: str) -> CaptureBackend:
    from executor.graphs.backends import FullGraphBackend

    return FullGraphBackend(device)


@register_capture_backend("breakable", phases=("decode", "prefill"), auto_for=("prefill",))
def _breakable(device: torch.device, graphs: GraphConfig, key: str) -> CaptureBackend:
    from executor.graphs.breakable import BreakableGraphBackend

    return BreakableGraphBackend(device)


@register_capture_backend("fixed_grid", phases=("prefill",), refused={
    "decode": "decode's full graph already captures attention; fixed_grid is for prefill"})
def _fixed_grid(device: torch.device, graphs: GraphConfig, key: str) -> CaptureBackend:
    from executor.graphs.backends import FixedGridGraphBackend

    return FixedGridGraphBackend(device)


@register_capture_backend("tc_piecewise", phases=("prefill",), refused={
    "decode": "decode uses a full graph (or breakable); tc_piecewise is for prefill"})
def _tc_piecewise(device: torch.device, graphs: GraphConfig, model_key: str) -> CaptureBackend:
    from executor.graphs.piecewise.backend import PiecewiseCompileBackend  # imports Dynamo

    return PiecewiseCompileBackend(
        device, graphs.compiler,
        cache_dir=Path(graphs.compile_cache_dir) if graphs.compile_cache_dir else None,
        cache_key=model_key,
        debug_dir=Path(graphs.compile_debug_dir) if graphs.compile_debug_dir else None)


def valid_modes(phase: Phase) -> tuple[str, ...]:
    """The graph modes ``phase`` accepts (``disabled`` included, ``auto`` not)."""
    return (*(e.name for e in _REGISTRY.values() if phase in e.phases), DISABLED)


def default_mode(phase: Phase, cuda: bool) -> str:
    """What ``auto`` means for ``phase``: the backend registered for it on CUDA, else off."""
    if cuda:
        for e in _REGISTRY.values():
            if phase in e.auto_for:
                return e.name
    return DISABLED


def resolve_graph_mode(phase: Phase, requested: str, cuda: bool) -> str:
    """Resolve one phase's graph mode from a flag value (``auto`` or a mode name).

    Raises ``ConfigError`` naming the valid choices for a name that is not one, and saying
    why for a graph mode requested on a machine without CUDA.
    """
    if requested == AUTO:
        return default_mode(phase, cuda)
    valid = valid_modes(phase)
    if requested not in valid:
        known = _REGISTRY.get(requested)
        why = (known.refused.get(phase, f"{requested!r} cannot capture {phase}") if known
               else f"unknown mode {requested!r}")
        raise ConfigError(
            f"invalid {phase} graph mode {requested!r}: {why}; valid: {AUTO}, {', '.join(valid)}"
        )
    if requested != DISABLED and not cuda:
        raise ConfigError(
            f"{phase} graph mode {requested!r} needs a CUDA device, and this executor runs on "
            f"CPU; use {DISABLED!r} or {AUTO!r}"
        )
    return requested


def resolve_graph_modes(decode: str, prefill: str, cuda: bool) -> tuple[str, str]:
    """Resolve both phases; see ``resolve_graph_mode``."""
    return resolve_graph_mode("decode", decode, cuda), resolve_graph_mode("prefill", prefill, cuda)


def make_capture_backend(mode: str, device: torch.device, graphs: GraphConfig,
                         model_key: str) -> CaptureBackend:
    if mode not in _REGISTRY:
        raise ConfigError(f"graph mode {mode!r} has no capture backend; "
                          f"available: {', '.join(_REGISTRY)}")
    return _REGISTRY[mode].factory(device, graphs, model_key)
