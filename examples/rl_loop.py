"""A reinforcement-learning loop against a model-executor server: generate, train, push.

The "trainer" here holds the policy as a state dict loaded from the served checkpoint and
"trains" by adding small noise; each iteration it generates greedily through the server,
trains, then pushes the new weights over a process group (``WeightSender``: gloo on CPU,
``--backend nccl --device cuda:1`` on GPUs) as version ``step-N``, and generates again:
every step's answer names the version its forward ran with.

With ``--colocate`` (trainer and server sharing a GPU) the server sleeps while the
trainer "trains": its KV cache is dropped and its weights discarded, so the memory is the
trainer's; the update refills the weights and WakeUp takes the KV cache back.

    python examples/rl_loop.py --target 127.0.0.1:50051 --weights /path/to/served/model

See docs/weights.md for the versions, the transfer protocol and the sleep tags.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file

from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc
from service.weight_sender import WeightSender


def generate(stub: pb_grpc.ExecutorStub, prompts: Sequence[Sequence[int]], n: int
             ) -> tuple[list[list[int]], set[str]]:
    """Greedy tokens of every prompt in one batch, and the weight versions that made them."""
    ids = [f"rollout-{i}" for i in range(len(prompts))]
    out = stub.Prefill(pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id=s, token_ids=list(p), sample=True)
        for s, p in zip(ids, prompts, strict=True)]))
    tokens = [[o.token_id] for o in out.outputs]
    versions = {out.step.weight_version}
    for _ in range(n - 1):
        out = stub.Decode(pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id=s, use_last_sampled=True) for s in ids]))
        versions.add(out.step.weight_version)
        for row, o in zip(tokens, out.outputs, strict=True):
            row.append(o.token_id)
    stub.Release(pb.ReleaseRequest(seq_ids=ids))
    return tokens, versions


def train(policy: dict[str, torch.Tensor], step: int, scale: float) -> None:
    """A stand-in for an optimizer step: every weight moves a little."""
    g = torch.Generator().manual_seed(step)
    for t in policy.values():
        t.add_(torch.randn(t.shape, generator=g).to(t.dtype) * scale * t.float().std()
               .to(t.dtype))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--weights", required=True, type=Path,
                   help="the served model's directory (the trainer starts from it)")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--scale", type=float, default=0.5, help="noise per 'training' step")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--device", default="cpu", help="where the trainer's tensors live")
    p.add_argument("--colocate", action="store_true",
                   help="sleep the server while training (drop KV, discard weights)")
    args = p.parse_args(argv)

    policy = {}
    for file in sorted(args.weights.glob("*.safetensors")):
        policy.update({k: v.to(args.device) for k, v in load_file(str(file)).items()})
    prompts = [[1, 5, 9, 13], [2, 4, 8, 16, 32], [7, 7, 7]]
    sender = WeightSender(args.target, backend=args.backend, device=args.device)
    sender.connect()
    stub = sender.stub
    try:
        tokens, versions = generate(stub, prompts, args.tokens)
        print(f"generate: versions {sorted(versions)} tokens {tokens}")
        for step in range(1, args.iterations + 1):
            if args.colocate:
                slept = stub.Sleep(pb.SleepRequest(tags=["weights", "kv_cache"],
                                                   discard_weights=True, drop_sequences=True))
                print(f"sleep: freed {slept.freed_bytes} bytes")
            train(policy, step, args.scale)
            done = sender.update(f"step-{step}", policy)
            print(f"update: {done.weight_version} {done.tensors_updated} tensors "
                  f"{done.bytes_updated} bytes in {done.update_ms:.1f} ms")
            if args.colocate:
                stub.WakeUp(pb.WakeUpRequest(tags=["kv_cache"]))
            tokens, versions = generate(stub, prompts, args.tokens)
            print(f"generate: versions {sorted(versions)} tokens {tokens}")
    finally:
        sender.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
