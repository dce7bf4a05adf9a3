"""Attention backends by name: each registers once, with what it needs to serve.

``register_attention`` records a backend's factory with its requirements (CUDA, dtypes)
and its own availability check (``unusable``; FlashInfer's install hint and on-device
probe live with FlashInfer). Config validation, the CLI's choices and ``auto`` all read
this registry; nothing else lists backend names.

This module imports no torch, so the CLI can list choices without loading it: factories
and checks import their backend when called.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from executor.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from executor.attention.base import AttentionBackend, AttentionShape
    from executor.kv.pool import KVPool, ReqToTokenTable

_log = logging.getLogger("executor.attention")

BackendFactory = Callable[["AttentionShape", "KVPool", "ReqToTokenTable"], "AttentionBackend"]
#: Tries a backend on the device; returns why it cannot serve, or None. Replaceable in
#: tests (a real probe needs the GPU and the backend's package).
Probe = Callable[["torch.device", "torch.dtype", "AttentionShape"], "str | None"]
#: A backend's own check beyond device and dtype: (device, dtype, shape, probe) -> why not.
Check = Callable[["torch.device", "torch.dtype", "AttentionShape", "Probe | None"],
                 "str | None"]

AUTO = "auto"


@dataclass(frozen=True)
class AttentionEntry:
    name: str
    factory: BackendFactory
    needs_cuda: bool
    dtypes: tuple[str, ...] | None  # dtype names served ("bfloat16"); None = any
    #: ``auto`` tries backends by ascending preference; None: never chosen by ``auto``.
    auto_preference: int | None
    unusable: Check | None
    #: Whether its package is installed: a backend that is installed yet cannot serve
    #: deserves a warning when ``auto`` passes it over, one that is absent only a note.
    installed: Callable[[], bool]

    def why_not(self, device: torch.device, dtype: torch.dtype, shape: AttentionShape,
                probe: Probe | None) -> tuple[str, bool] | None:
        """Why this backend cannot serve here, and whether the reason is its own check's
        (not device or dtype); None when it can."""
        if self.needs_cuda and device.type != "cuda":
            return (f"attention backend {self.name!r} needs a CUDA device; use "
                    f"torch_native (or auto) on {device.type}"), False
        if self.dtypes is not None and str(dtype).removeprefix("torch.") not in self.dtypes:
            return (f"attention backend {self.name!r} supports {' and '.join(self.dtypes)}, "
                    f"not {dtype}; use torch_native (or auto) for it"), False
        if self.unusable is not None:
            why = self.unusable(device, dtype, shape, probe)
            if why is not None:
                return f"attention backend {self.name!r} cannot serve here: {why}", True
        return None


_REGISTRY: dict[str, AttentionEntry] = {}


def register_attention(name: str, *, needs_cuda: bool = False,
                       dtypes: tuple[str, ...] | None = None,
                       auto_preference: int | None = None, unusable: Check | None = None,
                       installed: Callable[[], bool] = lambda: True
                       ) -> Callable[[BackendFactory], BackendFactory]:
    """Decorator on a backend's factory (a function that imports the backend lazily)."""
    def register(factory: BackendFactory) -> BackendFactory:
        if name in _REGISTRY or name == AUTO:
            raise ValueError(f"attention backend {name!r} registered twice")
        _REGISTRY[name] = AttentionEntry(name, factory, needs_cuda, dtypes, auto_preference,
                                         unusable, installed)
        return factory
    return register


def available_backends() -> tuple[str, ...]:
    """Registered backend names (``auto`` is not one), in registration order."""
    return tuple(_REGISTRY)


def entry(name: str) -> AttentionEntry:
    if name not in _REGISTRY:
        raise ConfigError(f"unknown attention backend {name!r}; valid: {AUTO}, "
                          f"{', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype,
                    shape: AttentionShape, probe: Probe | None = None) -> tuple[str, str]:
    """The backend that serves, and why (for the start-up log; empty for a named one).

    ``auto``: the most preferred registered backend that can serve on this device, dtype
    and shape (a passed-over backend's own reason is logged: a warning when it is
    installed, else a note; the reason says why each was passed over). A named backend is
    checked the same way, and a start-up error says why it cannot serve."""
    if requested == AUTO:
        ranked = sorted((e for e in _REGISTRY.values() if e.auto_preference is not None),
                        key=lambda e: e.auto_preference or 0)
        passed: list[str] = []
        for candidate in ranked:
            why = candidate.why_not(device, dtype, shape, probe)
            if why is None:
                dtype_name = str(dtype).removeprefix("torch.")
                return candidate.name, ("; ".join(passed) if passed else
                                        f"preferred for {dtype_name} on {device.type}")
            reason, own = why
            passed.append(reason)
            if own:
                level = logging.WARNING if candidate.installed() else logging.INFO
                _log.log(level, "attention backend auto: not %s: %s", candidate.name, reason)
        raise ConfigError(f"no attention backend can serve {dtype} on {device.type}")
    why = entry(requested).why_not(device, dtype, shape, probe)
    if why is not None:
        raise ConfigError(why[0])
    return requested, ""


def resolve_backend_name(requested: str, device: torch.device, dtype: torch.dtype,
                         shape: AttentionShape, probe: Probe | None = None) -> str:
    """The name ``resolve_backend`` settles on."""
    return resolve_backend(requested, device, dtype, shape, probe)[0]


def create_backend(name: str, shape: AttentionShape, pool: KVPool,
                   table: ReqToTokenTable) -> AttentionBackend:
    return entry(name).factory(shape, pool, table)
