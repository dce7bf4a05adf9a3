"""Attention backends, chosen by name from a registry."""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor.attention.base import AttentionBackend, AttentionMetadata, AttentionShape
from executor.attention.torch_native import TorchNativeBackend
from executor.errors import ConfigError
from executor.kv.pool import KVPool, ReqToTokenTable

BackendFactory = Callable[[AttentionShape, KVPool, ReqToTokenTable], AttentionBackend]


def _triton(shape: AttentionShape, pool: KVPool, table: ReqToTokenTable) -> AttentionBackend:
    from executor.attention.triton_backend import TritonBackend  # needs triton + CUDA

    return TritonBackend(shape, pool, table)


_REGISTRY: dict[str, BackendFactory] = {
    "torch_native": TorchNativeBackend,
    "triton": _triton,
}


def available_backends() -> tuple[str, ...]:
    return tuple(_REGISTRY)


# KV dtypes the Triton kernels support.
_TRITON_DTYPES = (torch.float16, torch.bfloat16)


def resolve_backend_name(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` -> triton on CUDA for fp16/bf16, else torch_native; a named backend is
    checked against the device."""
    if requested == "auto":
        use_triton = device.type == "cuda" and dtype in _TRITON_DTYPES
        return "triton" if use_triton else "torch_native"
    if requested not in _REGISTRY:
        raise ConfigError(
            f"unknown attention backend {requested!r}; valid: auto, {', '.join(_REGISTRY)}"
        )
    if requested != "torch_native" and device.type != "cuda":
        raise ConfigError(f"attention backend {requested!r} needs a CUDA device")
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
    "resolve_backend_name",
]
