"""Attention backends, each registered here once (``registry.py``), by name.

A registration names the backend's requirements and its own availability check; the
factory imports the backend only when it is made, so listing and validating names (the
CLI, config) loads neither torch nor any kernel library. The interface is
``executor.attention.base.AttentionBackend``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from executor.attention.dtypes import KERNEL_DTYPE_NAMES
from executor.attention.registry import (
    Probe,
    available_backends,
    create_backend,
    register_attention,
    resolve_backend,
    resolve_backend_name,
)

if TYPE_CHECKING:
    import torch

    from executor.attention.base import AttentionBackend, AttentionShape
    from executor.kv.pool import KVPool, ReqToTokenTable


@register_attention("torch_native", auto_preference=1)
def _torch_native(shape: AttentionShape, pool: KVPool, table: ReqToTokenTable
                  ) -> AttentionBackend:
    """The reference path: any device, any dtype; ``auto``'s last resort."""
    from executor.attention.torch_native import TorchNativeBackend

    return TorchNativeBackend(shape, pool, table)


@register_attention("triton", needs_cuda=True, dtypes=KERNEL_DTYPE_NAMES, auto_preference=0)
def _triton(shape: AttentionShape, pool: KVPool, table: ReqToTokenTable) -> AttentionBackend:
    from executor.attention.triton_backend import TritonBackend  # needs triton + CUDA

    return TritonBackend(shape, pool, table)


def _flashinfer_installed() -> bool:
    from executor.attention import flashinfer_backend

    return flashinfer_backend.flashinfer_installed()


def _flashinfer_unusable(device: torch.device, dtype: torch.dtype, shape: AttentionShape,
                         probe: Probe | None) -> str | None:
    from executor.attention import flashinfer_backend

    return flashinfer_backend.flashinfer_unusable(device, dtype, shape, probe)


# NOTE: ``auto`` never picks FlashInfer: it trailed the Triton kernels in most
# configurations and led only at one large-batch, short-context corner, which a backend
# chosen once at start-up cannot exploit (docs/kernels.md). Name it explicitly to use it.
@register_attention("flashinfer", needs_cuda=True, dtypes=KERNEL_DTYPE_NAMES,
                    auto_preference=None, unusable=_flashinfer_unusable,
                    installed=_flashinfer_installed)
def _flashinfer(shape: AttentionShape, pool: KVPool, table: ReqToTokenTable
                ) -> AttentionBackend:
    from executor.attention.flashinfer_backend import FlashInferBackend  # optional extra

    return FlashInferBackend(shape, pool, table)


__all__ = ["available_backends", "create_backend", "resolve_backend", "resolve_backend_name"]
