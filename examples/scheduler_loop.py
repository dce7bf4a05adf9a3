"""Drive a model-executor server the way a scheduler does: one sequence, two loops.

``generate`` sends one call at a time and waits for each answer; ``generate_pipelined``
sends its steps over one ``Session`` with ``depth`` steps in flight, each continuing from
the token its sequence sampled last (kept on the device). With greedy sampling both give
the same tokens. Both release the sequence, so the server's KV cache ends as it began.

    python examples/scheduler_loop.py --target 127.0.0.1:50051 --prompt 1,2,3 --tokens 16

Token ids in, token ids out: a real scheduler tokenizes with the served model's tokenizer.
See docs/scheduler.md for the retry and failure rules.
"""

from __future__ import annotations

import argparse
import sys
import threading
import uuid
from collections.abc import Iterator, Sequence

import grpc

from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc


def generate(stub: pb_grpc.ExecutorStub, seq_id: str, prompt: Sequence[int],
             n: int) -> list[int]:
    """One call at a time: each Decode carries the token the previous one returned."""
    out = stub.Prefill(pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id=seq_id, token_ids=prompt, sample=True)]))
    tokens = [out.outputs[0].token_id]
    while len(tokens) < n:
        out = stub.Decode(pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id=seq_id, token_id=tokens[-1])]))
        tokens.append(out.outputs[0].token_id)
    stub.Release(pb.ReleaseRequest(seq_ids=[seq_id]))
    return tokens


def generate_pipelined(stub: pb_grpc.ExecutorStub, seq_id: str, prompt: Sequence[int],
                       n: int, depth: int = 3) -> list[int]:
    """One Session, ``depth`` steps in flight: a step is sent before the one ahead of it
    is answered, and continues from the token that step sampled, on the device."""
    window = threading.Semaphore(depth)  # steps sent and not answered yet

    def requests() -> Iterator[pb.SessionRequest]:
        window.acquire()
        yield pb.SessionRequest(step=1, prefill=pb.PrefillRequest(items=[
            pb.PrefillItem(seq_id=seq_id, token_ids=prompt, sample=True)]))
        for step in range(2, n + 1):
            # made while the window is full: it does not depend on the answers in flight
            request = pb.SessionRequest(step=step, decode=pb.DecodeRequest(items=[
                pb.DecodeItem(seq_id=seq_id, use_last_sampled=True)]))
            window.acquire()
            yield request

    tokens: list[int] = []
    for response in stub.Session(requests()):
        window.release()  # the next step goes out while this answer is read
        kind = response.WhichOneof("result")
        if kind == "error":  # nothing of it applied; later steps get ABORTED until acked
            raise RuntimeError(f"step {response.step}: {response.error.code_name}: "
                               f"{response.error.message}")
        tokens.append(getattr(response, kind).outputs[0].token_id)
    stub.Release(pb.ReleaseRequest(seq_ids=[seq_id]))
    return tokens


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--target", default="127.0.0.1:50051", help="the server's host:port")
    ap.add_argument("--prompt", default="5,17,99,3,250,41", help="prompt token ids")
    ap.add_argument("--tokens", type=int, default=16, help="tokens to generate")
    ap.add_argument("--depth", type=int, default=3,
                    help="Session steps in flight (the server's default --session-depth)")
    args = ap.parse_args(argv)
    prompt = [int(t) for t in args.prompt.split(",")]
    run = uuid.uuid4().hex[:8]
    with grpc.insecure_channel(args.target) as channel:
        stub = pb_grpc.ExecutorStub(channel)
        before = stub.Health(pb.HealthRequest(), timeout=10).kv.free_tokens
        unary = generate(stub, f"example-unary-{run}", prompt, args.tokens)
        print(f"unary:     {unary}")
        piped = generate_pipelined(stub, f"example-session-{run}", prompt, args.tokens,
                                   args.depth)
        print(f"pipelined: {piped} (Session, {args.depth} in flight)")
        after = stub.Health(pb.HealthRequest(), timeout=10).kv.free_tokens
    same = unary == piped
    print(f"same tokens: {'yes' if same else 'NO'}")
    print(f"kv free tokens before / after: {before} / {after}"
          f" ({'all released' if after == before else 'NOT all released'})")
    return 0 if same and after == before else 1


if __name__ == "__main__":
    sys.exit(main())
