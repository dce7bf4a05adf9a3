"""Capture backends by graph-mode name, and graph-mode resolution (one table).

Each backend registers once with the phases it can serve, the phases for which ``auto``
may pick it on CUDA, whether it captures attention, and why a phase cannot use it. ``auto``
picks, per phase, the first registered backend (this file's order) it may pick whose
capture the resolved attention backend supports (``AttentionBackend.capturable``). Config
validation, the CLI's help and ``resolve_graph_modes`` read this registry; nothing else
lists graph modes. It imports no torch (the CLI lists modes without loading it).
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
    auto_for: frozenset[Phase]  # phases for which ``auto`` may pick it on CUDA
    #: Attention is captured inside its graphs: the attention backend must be capturable
    #: for the phase (else attention runs eagerly between graph pieces).
    attention_in_graph: bool
    refused: Mapping[Phase, str] = field(default_factory=dict)  # why not, per phase


_REGISTRY: dict[str, CaptureEntry] = {}


def register_capture_backend(name: str, *, phases: tuple[Phase, ...],
                             attention_in_graph: bool, auto_for: tuple[Phase, ...] = (),
                             refused: Mapping[Phase, str] | None = None
                             ) -> Callable[[CaptureFactory], CaptureFactory]:
    def register(factory: CaptureFactory) -> CaptureFactory:
        if name in _REGISTRY or name in (DISABLED, AUTO):
            raise ValueError(f"graph mode {name!r} registered twice")
        _REGISTRY[name] = CaptureEntry(name, factory, frozenset(phases), frozenset(auto_for),
                                       attention_in_graph, dict(refused or {}))
        return factory
    return register


# Registration order is ``auto``'s preference: full before breakable for decode.
@register_capture_backend("full", phases=("decode",), attention_in_graph=True,
                          auto_for=("decode",), refused={
    "prefill": "prefill attention is variable-length, so a prefill forward cannot be one "
               "whole graph; use breakable or tc_piecewise"})
def _full(device: torch.device, graphs: GraphConfig, key: str) -> CaptureBackend:
    from executor.graphs.backends import FullGraphBackend

    return FullGraphBackend(device)


@register_capture_backend("breakable", phases=("decode", "prefill"), attention_in_graph=False,
                          auto_for=("decode", "prefill"))
def _breakable(device: torch.device, graphs: GraphConfig, key: str) -> CaptureBackend:
    from executor.graphs.breakable import BreakableGraphBackend

    return BreakableGraphBackend(device)


@register_capture_backend("fixed_grid", phases=("prefill",), attention_in_graph=True, refused={
    "decode": "decode's full graph already captures attention; fixed_grid is for prefill"})
def _fixed_grid(device: torch.device, graphs: GraphConfig, key: str) -> CaptureBackend:
    from executor.graphs.backends import FixedGridGraphBackend

    return FixedGridGraphBackend(device)


@register_capture_backend("tc_piecewise", phases=("prefill",), attention_in_graph=False,
                          refused={
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


def auto_graph_mode(phase: Phase, cuda: bool,
                    attention_capturable: frozenset[Phase] = frozenset(PHASES),
                    attention: str = "the attention backend") -> tuple[str, str]:
    """What ``auto`` means for ``phase``, and why: off without CUDA; else the first
    registered backend that ``auto`` may pick for the phase and that can run with an
    attention backend capturable for ``attention_capturable`` (``attention`` names it in
    the reason). Never fails: ``breakable`` keeps attention out of its graphs."""
    if not cuda:
        return DISABLED, "no CUDA device"
    passed: list[str] = []
    for e in _REGISTRY.values():
        if phase not in e.auto_for:
            continue
        if e.attention_in_graph and phase not in attention_capturable:
            passed.append(e.name)
            continue
        if not passed:
            return e.name, f"preferred for {phase} on CUDA"
        return e.name, (f"{' and '.join(passed)} would capture attention, and {attention} "
                        f"cannot be captured for {phase}")
    return DISABLED, f"no graph mode can run {attention} for {phase}"


def auto_summary(phase: Phase) -> str:
    """What ``auto`` picks for ``phase``, in words (the CLI's help)."""
    order = [e for e in _REGISTRY.values() if phase in e.auto_for]
    first, rest = order[0], [e.name for e in order[1:] if not e.attention_in_graph]
    fallback = (f", else {rest[0]} where the attention backend cannot be captured"
                if first.attention_in_graph and rest else "")
    return f"{first.name} on CUDA{fallback}; off on CPU"


def _one_of(names: tuple[str, ...]) -> str:
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


def _eager_attention_modes(phase: Phase) -> tuple[str, ...]:
    return tuple(e.name for e in _REGISTRY.values()
                 if phase in e.phases and not e.attention_in_graph)


def resolve_graph_mode(phase: Phase, requested: str, cuda: bool,
                       attention_capturable: frozenset[Phase] = frozenset(PHASES),
                       attention: str = "the attention backend") -> str:
    """Resolve one phase's graph mode from its flag value (``auto`` or a mode name) on a
    CUDA device or not, for an attention backend capturable for ``attention_capturable``
    (``attention`` says in messages which backend and which flags chose it).

    ``auto`` always resolves to a mode that can run (``auto_graph_mode``). Raises
    ``ConfigError`` naming ``--<phase>-graph`` for a name that is not a mode of the phase,
    a mode on a machine without CUDA, or a mode that captures attention the attention
    backend cannot capture.
    """
    if requested == AUTO:
        return auto_graph_mode(phase, cuda, attention_capturable, attention)[0]
    flag = f"--{phase}-graph {requested}"
    valid = valid_modes(phase)
    if requested not in valid:
        known = _REGISTRY.get(requested)
        why = (known.refused.get(phase, f"{requested!r} cannot capture {phase}") if known
               else f"unknown mode {requested!r}")
        raise ConfigError(f"invalid {phase} graph mode {requested!r} ({flag}): {why}; "
                          f"valid: {AUTO}, {', '.join(valid)}")
    if requested != DISABLED and not cuda:
        raise ConfigError(
            f"{phase} graph mode {requested!r} ({flag}) needs a CUDA device, and this "
            f"executor runs on CPU; use {DISABLED!r} or {AUTO!r}")
    entry = _REGISTRY.get(requested)
    if entry is not None and entry.attention_in_graph and phase not in attention_capturable:
        raise ConfigError(
            f"{flag} captures attention in its graphs, and {attention} cannot be captured "
            f"for {phase}; use --{phase}-graph "
            f"{_one_of((AUTO, *_eager_attention_modes(phase), DISABLED))}, or an "
            f"attention backend that can be captured for {phase}")
    return requested


def resolve_graph_modes(decode: str, prefill: str, cuda: bool,
                        attention_capturable: frozenset[Phase] = frozenset(PHASES),
                        attention: str = "the attention backend") -> tuple[str, str]:
    """Resolve both phases (decode, prefill); see ``resolve_graph_mode``."""
    return (resolve_graph_mode("decode", decode, cuda, attention_capturable, attention),
            resolve_graph_mode("prefill", prefill, cuda, attention_capturable, attention))


def make_capture_backend(mode: str, device: torch.device, graphs: GraphConfig,
                         model_key: str) -> CaptureBackend:
    if mode not in _REGISTRY:
        raise ConfigError(f"graph mode {mode!r} has no capture backend; "
                          f"available: {', '.join(_REGISTRY)}")
    return _REGISTRY[mode].factory(device, graphs, model_key)
