"""A trainer process for the weight-transfer tests: ``python -m tests.helpers.trainer``.

Connects a ``WeightSender`` to a server and sends a checkpoint directory's tensors:
``--mode ok`` first sends a manifest with one tensor of the wrong shape (expects
INVALID_ARGUMENT naming it), then the checkpoint; ``--mode die`` sends the first bucket
of the checkpoint and exits the process mid-broadcast; ``--mode die-early`` exits once
the manifest was accepted, before the first bucket. Prints one JSON line per result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc
import torch
from safetensors.torch import load_file

from executor.weights import TransferGroup
from service.weight_sender import WeightSender


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--weights", required=True, help="a directory with model.safetensors")
    p.add_argument("--version", default="trained")
    p.add_argument("--mode", choices=("ok", "die", "die-early"), default="ok")
    p.add_argument("--bucket-bytes", type=int, default=256 << 10)
    args = p.parse_args()
    tensors = load_file(os.path.join(args.weights, "model.safetensors"))
    sender = WeightSender(args.target, backend="gloo", timeout_s=20)
    joined = sender.connect()
    print(json.dumps({"event": "joined", "ranks": list(joined.ranks)}), flush=True)
    if args.mode != "ok":
        sent = [0]
        broadcast = TransferGroup.broadcast
        last = 1 if args.mode == "die" else 0  # buckets sent before the process exits

        def dying(self: TransferGroup, tensor: torch.Tensor, src: int) -> None:
            if sent[0] < last:
                broadcast(self, tensor, src)
            sent[0] += 1
            if sent[0] > last:
                print(json.dumps({"event": "dying"}), flush=True)
                os._exit(3)

        TransferGroup.broadcast = dying  # type: ignore[method-assign]
        sender.update(args.version, tensors, bucket_bytes=args.bucket_bytes)
        return 1  # not reached
    bad = dict(tensors)
    name = "model.layers.0.mlp.down_proj.weight"
    bad[name] = bad[name][:, :7].contiguous()
    try:
        sender.update("refused", bad, bucket_bytes=args.bucket_bytes)
        print(json.dumps({"event": "bad_accepted"}), flush=True)
        return 1
    except grpc.RpcError as err:
        print(json.dumps({"event": "refused", "code": err.code().name,
                          "details": err.details()}), flush=True)
    done = sender.update(args.version, tensors, bucket_bytes=args.bucket_bytes)
    print(json.dumps({"event": "updated", "version": done.weight_version,
                      "tensors": done.tensors_updated, "bytes": done.bytes_updated}),
          flush=True)
    sender.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
