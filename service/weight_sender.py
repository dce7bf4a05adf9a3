"""The trainer's side of weight transfer: ``WeightSender``.

A trainer process makes one, ``connect``s once (it hosts the group's TCP store as rank 0
and asks the server to join with ``InitWeightTransfer``), then after every training step
calls ``update(version, named_tensors)``: the manifest travels in the UpdateWeights
request, the server checks it and broadcasts its verdict on the group, and only then are
the tensors broadcast, packed into flat buckets (``executor/weights/transfer.py``). Use
``nccl`` with CUDA tensors, ``gloo`` with CPU ones. The protocol: docs/weights.md.

    sender = WeightSender("127.0.0.1:50051", backend="gloo")
    sender.connect()
    sender.update("step-1", model.state_dict().items())
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import time
from collections.abc import Iterable, Mapping
from typing import Any

import grpc
import torch
import torch.distributed as dist

from executor.weights import (
    TensorMeta,
    TransferConfig,
    TransferGroup,
    dtype_name,
    pack_bucket,
    plan_buckets,
)
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc

_POLL_S = 0.005


class WeightSender:
    """Broadcasts new weights from this (trainer) process to one model-executor server."""

    def __init__(self, target: str | pb_grpc.ExecutorStub, *, backend: str = "gloo",
                 device: str | torch.device = "cpu", master_address: str = "127.0.0.1",
                 master_port: int = 0, group_name: str = "weight_transfer",
                 timeout_s: float = 120.0,
                 metadata: tuple[tuple[str, str], ...] | None = None) -> None:
        """``target``: the server's address (or a stub); ``master_port`` 0 picks a free
        port for the group's store; ``timeout_s`` bounds joining and each transfer."""
        if isinstance(target, str):
            self._channel: grpc.Channel | None = grpc.insecure_channel(target)
            self.stub = pb_grpc.ExecutorStub(self._channel)
        else:
            self._channel, self.stub = None, target
        self.backend, self.device = backend, torch.device(device)
        self.master_address, self.master_port = master_address, master_port
        self.group_name, self.timeout_s, self._metadata = group_name, timeout_s, metadata
        self.group: TransferGroup | None = None
        self.rank_offset = 1
        self._calls = concurrent.futures.ThreadPoolExecutor(1, "weight_sender")
        # A verdict broadcast posted for an update the server refused before it reached
        # the group: the next update's verdict completes it (the group's order holds).
        self._pending: tuple[Any, torch.Tensor] | None = None

    def connect(self) -> pb.InitWeightTransferResponse:
        """Host the group's store, have every rank of the server join, join as rank 0."""
        health = self.stub.Health(pb.HealthRequest(), timeout=30, metadata=self._metadata)
        ranks = max(1, health.model.tensor_parallel_size)
        world = 1 + ranks
        store = dist.TCPStore(self.master_address, self.master_port, world, is_master=True,
                              timeout=datetime.timedelta(seconds=self.timeout_s),
                              wait_for_workers=False)
        config = TransferConfig(self.master_address, store.port, world, self.rank_offset,
                                self.backend, self.group_name,  # type: ignore[arg-type]
                                self.timeout_s)
        request = pb.InitWeightTransferRequest(
            master_address=config.master_address, master_port=config.master_port,
            world_size=world, rank_offset=self.rank_offset, backend=self.backend,
            group_name=self.group_name, timeout_s=self.timeout_s)
        call = self._calls.submit(self.stub.InitWeightTransfer, request,
                                  timeout=self.timeout_s + 30, metadata=self._metadata)
        try:
            self.group = TransferGroup(config, 0, self.device, store=store)
        except BaseException:
            call.cancel()
            raise
        return call.result()

    def update(self, version: str,
               tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
               bucket_bytes: int = 0, request_id: str = "") -> pb.UpdateWeightsResponse:
        """Send every tensor (named as in the checkpoint, whole, in the served dtype) as
        ``version``; the server's answer. A refused manifest raises the server's status
        (``grpc.RpcError``, INVALID_ARGUMENT naming the tensor) and sends nothing."""
        group = self._require_group()
        named = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        metas = [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named]
        request = pb.UpdateWeightsRequest(
            request_id=request_id, weight_version=version,
            distributed=pb.DistributedSource(bucket_bytes=bucket_bytes, tensors=[
                pb.TensorSpec(name=m.name, shape=m.shape, dtype=dtype_name(m.dtype))
                for m in metas]))
        call = self._calls.submit(self.stub.UpdateWeights, request,
                                  timeout=self.timeout_s * 4 + 60, metadata=self._metadata)
        if not self._verdict(group, call):
            return call.result()  # raises the refusal (or is a retry's stored answer)
        buckets = plan_buckets(metas, bucket_bytes)
        buffer = torch.empty(max(b.nbytes for b in buckets), dtype=torch.uint8,
                             device=self.device)
        values = [t for _, t in named]
        for bucket in buckets:
            flat = buffer[: bucket.nbytes]
            pack_bucket(bucket, values, flat)
            group.broadcast(flat, 0)
        return call.result()

    def _verdict(self, group: TransferGroup, call: concurrent.futures.Future[Any]) -> bool:
        """The server's verdict on the manifest; False also when the call ended before
        the server reached the group (refused by its state or its checks of the request,
        or answered from the retry cache)."""
        if self._pending is None:
            flag = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._pending = (group.broadcast_async(flag, self.rank_offset), flag)
        work, flag = self._pending
        while not work.is_completed():
            if call.done():  # nothing more comes for this update: keep the work posted
                return False
            time.sleep(_POLL_S)
        work.wait()
        self._pending = None
        return bool(flag.item())

    def close(self) -> None:
        """Leave the group (the server too) and close the channel."""
        if self.group is not None:
            with contextlib.suppress(grpc.RpcError):  # a server gone: nothing to leave
                self.stub.DestroyWeightTransfer(pb.DestroyWeightTransferRequest(), timeout=30,
                                                metadata=self._metadata)
            self.group.close()
            self.group = None
        self._calls.shutdown(wait=False)
        if self._channel is not None:
            self._channel.close()

    def _require_group(self) -> TransferGroup:
        if self.group is None:
            raise RuntimeError("call connect() first")
        return self.group
