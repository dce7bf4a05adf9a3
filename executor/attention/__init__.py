"""Attention backends, chosen by name from a registry."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

import torch

from executor.attention.base import (
    KERNEL_DTYPES,
    AttentionBackend,
    AttentionMetadata,
    AttentionShape,
)
from executor.attention.torch_native import TorchNativeBackend
from executor.errors import ConfigError
from executor.kv.pool import KVPool, ReqToTokenTable

_log = logging.getLogger(__name__)

BackendFactory = Callable[[AttentionShape, KVPool, ReqToTokenTable], AttentionBackend]


def _triton(shape: AttentionShape, pool: KVPool, table: ReqToTokenTable) -> AttentionBackend:
    from executor.attention.triton_backend import TritonBackend  # needs triton + CUDA

    return TritonBackend(shape, pool, table)


def _flashinfer(shape: AttentionShape, pool: KVPool,
                table: ReqToTokenTable) -> AttentionBackend:
    from executor.attention.flashinfer_backend import FlashInferBackend  # optional extra

    return FlashInferBackend(shape, pool, table)


_REGISTRY: dict[str, BackendFactory] = {
    "torch_native": TorchNativeBackend,
    "triton": _triton,
    "flashinfer": _flashinfer,
}

# Head sizes FlashInfer compiles attention for.
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_INSTALL = ("install it with `pip install 'model-executor[flashinfer]'`, or on a "
                      "machine without a package index see docs/flashinfer.md")

#: Tries FlashInfer on the device; returns why it cannot serve, or None. Replaceable in
#: tests (the real probe needs a GPU with FlashInfer installed).
Probe = Callable[[torch.device, torch.dtype, AttentionShape], "str | None"]


def _flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def available_backends() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def flashinfer_unusable(device: torch.device, dtype: torch.dtype, shape: AttentionShape,
                        probe: Probe | None = None) -> str | None:
    """Why FlashInfer cannot serve this model on this device, or None when it can.

    Cheap checks first (device, dtype, head size, import), then ``probe`` runs a small
    attention on the device against the reference (this JIT-compiles the kernels the model
    needs, which would happen on the first request anyway)."""
    if device.type != "cuda":
        return f"FlashInfer needs a CUDA device, not {device.type}"
    if dtype not in KERNEL_DTYPES:
        return f"FlashInfer attention here supports float16 and bfloat16, not {dtype}"
    if shape.head_dim not in FLASHINFER_HEAD_DIMS:
        return (f"FlashInfer supports head_dim {list(FLASHINFER_HEAD_DIMS)}, "
                f"not {shape.head_dim}")
    if not _flashinfer_installed():
        return f"the flashinfer package is not installed; {FLASHINFER_INSTALL}"
    if probe is None:
        from executor.attention.flashinfer_backend import probe as real_probe

        probe = real_probe
    return probe(device, dtype, shape)


def resolve_backend_name(requested: str, device: torch.device, dtype: torch.dtype,
                         shape: AttentionShape, probe: Probe | None = None) -> str:
    """The backend that serves: ``auto`` -> flashinfer when it imports and works on the
    device, else triton on CUDA for fp16/bf16, else torch_native. A named backend is
    checked against the device, and a start-up error says why it cannot serve."""
    if requested == "auto":
        if device.type != "cuda" or dtype not in KERNEL_DTYPES:
            return "torch_native"
        why = flashinfer_unusable(device, dtype, shape, probe)
        if why is None:
            return "flashinfer"
        # Not installed is the common case; installed but failing deserves a warning.
        level = logging.WARNING if _flashinfer_installed() else logging.INFO
        _log.log(level, "attention backend auto: triton, not flashinfer: %s", why)
        return "triton"
    if requested not in _REGISTRY:
        raise ConfigError(
            f"unknown attention backend {requested!r}; valid: auto, {', '.join(_REGISTRY)}"
        )
    if requested != "torch_native" and device.type != "cuda":
        raise ConfigError(f"attention backend {requested!r} needs a CUDA device; use "
                          f"torch_native (or auto) on {device.type}")
    if requested == "triton" and dtype not in KERNEL_DTYPES:
        raise ConfigError(f"attention backend 'triton' supports float16 and bfloat16, not "
                          f"{dtype}; use torch_native (or auto) for it")
    if requested == "flashinfer":
        why = flashinfer_unusable(device, dtype, shape, probe)
        if why is not None:
            raise ConfigError(f"attention backend 'flashinfer' cannot serve here: {why}")
    return requested


def create_backend(name: str, shape: AttentionShape, pool: KVPool,
                   table: ReqToTokenTable) -> AttentionBackend:
    return _REGISTRY[name](shape, pool, table)


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionShape",
    "TorchNativeBackend",
    "available_backends",
    "create_backend",
    "flashinfer_unusable",
    "resolve_backend_name",
]
