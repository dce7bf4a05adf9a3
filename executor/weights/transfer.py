"""Weight transfer from a trainer: the process group, the bucket plan, the receive loop.

The trainer is rank 0 of a group of its own (not the tensor-parallel one) and hosts its
TCP store; executor rank r joins as ``rank_offset + r`` (``TransferGroup``, a process group
built straight on the store, as vLLM's ``StatelessProcessGroup`` and SGLang's
``init_weights_update_group`` do, so the default group is never touched). Per update:
every member joins one broadcast of the verdict from executor rank 0 (1: the manifest
passed the check, 0: refused, nothing follows), then the trainer broadcasts the tensors in
manifest order packed into flat byte buckets (``plan_buckets``, which both sides compute
the same way). Each executor rank keeps its slice of every tensor (``receive``).
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from executor.errors import ConfigError
from executor.weights.update import TensorMeta

#: Each tensor starts at a multiple of this many bytes inside its bucket (any dtype's
#: view of it is then aligned).
ALIGN = 256
DEFAULT_BUCKET_BYTES = 512 << 20
Backend = Literal["nccl", "gloo"]


@dataclass(frozen=True)
class TransferConfig:
    """Where the trainer's group is and which ranks this server takes in it."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int
    backend: Backend
    group_name: str = "weight_transfer"
    timeout_s: float = 120.0


@dataclass(frozen=True)
class Bucket:
    """One broadcast: (manifest index, byte offset) of each tensor in it, and its size."""

    entries: tuple[tuple[int, int], ...]
    nbytes: int


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Tensors in manifest order, packed greedily into buckets of at most
    ``bucket_bytes`` (a larger tensor fills a bucket alone)."""
    limit = bucket_bytes or DEFAULT_BUCKET_BYTES
    buckets: list[Bucket] = []
    entries: list[tuple[int, int]] = []
    size = 0
    for i, meta in enumerate(metas):
        n = _aligned(meta.nbytes)
        if entries and size + n > limit:
            buckets.append(Bucket(tuple(entries), size))
            entries, size = [], 0
        entries.append((i, size))
        size += n
    if entries:
        buckets.append(Bucket(tuple(entries), size))
    return buckets


def pack_bucket(bucket: Bucket, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Copy the bucket's tensors (in manifest order) into the flat uint8 ``out``."""
    for index, offset in bucket.entries:
        t = tensors[index].detach().contiguous().reshape(-1).view(torch.uint8)
        out[offset : offset + t.numel()].copy_(t)


def unpack(bucket: Bucket, metas: Sequence[TensorMeta], flat: torch.Tensor
           ) -> dict[str, torch.Tensor]:
    """Views of the bucket's tensors inside the flat uint8 ``flat``, by name."""
    return {metas[i].name: flat[off : off + metas[i].nbytes].view(metas[i].dtype)
            .view(metas[i].shape) for i, off in bucket.entries}


class TransferGroup:
    """One member's handle on the trainer's group (trainer or executor rank)."""

    def __init__(self, config: TransferConfig, rank: int, device: torch.device,
                 store: dist.Store | None = None) -> None:
        """Join as ``rank``: over ``store`` (the trainer's, which it made as the master),
        else as a client of the store at ``config``'s address."""
        if config.backend not in ("nccl", "gloo"):
            raise ConfigError(f"backend must be 'nccl' or 'gloo', got {config.backend!r}")
        if config.backend == "nccl" and device.type != "cuda":
            raise ConfigError("backend 'nccl' needs CUDA devices; use 'gloo' on CPU")
        if not 0 <= rank < config.world_size:
            raise ConfigError(f"group rank {rank} is outside world_size "
                              f"{config.world_size}")
        self.config, self.rank, self.device = config, rank, device
        self.timeout = datetime.timedelta(seconds=config.timeout_s)
        started = time.perf_counter()
        if store is None:
            store = dist.TCPStore(config.master_address, config.master_port,
                                  config.world_size, is_master=False, timeout=self.timeout)
        self._store = dist.PrefixStore(config.group_name, store)
        # (a backend object of its own: the default group is never touched)
        self._group = _process_group(config.backend, self._store, rank,
                                     config.world_size, self.timeout)
        self.barrier()  # every member is in: the first collective pairs up
        self.init_ms = (time.perf_counter() - started) * 1e3

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.broadcast_async(tensor, src).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> Any:
        """The broadcast posted; its work object (``wait``, ``is_completed``)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        opts.timeout = self.timeout
        return self._group.broadcast([tensor], opts)

    def barrier(self) -> None:
        flag = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(flag, 0)

    def verdict(self, src: int, ok: bool | None = None) -> bool:
        """Broadcast (``ok`` given: as ``src``) or receive the update's verdict."""
        flag = torch.tensor([int(bool(ok))], dtype=torch.int64, device=self.device)
        self.broadcast(flag, src)
        return bool(flag.item())

    def close(self) -> None:
        shutdown = getattr(self._group, "shutdown", None)
        if shutdown is not None:
            with contextlib.suppress(RuntimeError):  # a peer already gone
                shutdown()


def _process_group(backend: Backend, store: dist.Store, rank: int, size: int,
                   timeout: datetime.timedelta) -> Any:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    group = dist.ProcessGroupNCCL(store, rank, size, opts)
    # As ``init_process_group`` does for a new NCCL backend (the sequence numbers its
    # collectives carry start agreed over the members).
    if hasattr(group, "_set_sequence_number_for_group"):
        group._set_sequence_number_for_group()
    return group


def receive(group: TransferGroup, metas: Sequence[TensorMeta], bucket_bytes: int,
            keep: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Receive every bucket the trainer broadcasts into one reused buffer on this rank's
    device; ``keep`` copies each bucket's tensors (this rank's slices) before the next
    broadcast overwrites them."""
    buckets = plan_buckets(metas, bucket_bytes)
    if not buckets:
        return
    buffer = torch.empty(max(b.nbytes for b in buckets), dtype=torch.uint8,
                         device=group.device)
    for bucket in buckets:
        flat = buffer[: bucket.nbytes]
        group.broadcast(flat, 0)
        keep(unpack(bucket, metas, flat))
