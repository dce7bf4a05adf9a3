"""A served executor from the scheduler's side: a free port, readiness, stopping the
process, deterministic prompts, and ``Client``, the decode loops over one gRPC channel."""

from __future__ import annotations

import socket
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc

#: Prompt tokens per sequence that ``Client.admit`` prefills.
CTX = 128
#: The readiness service every server reports SERVING on.
SERVICE = "model_executor.v1.Executor"


def free_port() -> int:
    """A loopback port free right now (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    """``n`` deterministic token ids below ``vocab``, a different prompt per ``seed``."""
    return [(seed * 7919 + i * 104729) % vocab for i in range(n)]


def wait_ready(target: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Poll the health service at ``target`` until SERVING; raise if ``proc`` exits first
    or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
            try:
                req = health_pb2.HealthCheckRequest(service=SERVICE)
                if health.Check(req, timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"server at {target} not ready within {timeout_s} s")


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """Terminate a server process; kill it if it has not exited within ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()


class Client:
    """The scheduler's side: decode loops over one channel."""

    def __init__(self, target: str, vocab: int) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.ExecutorStub(self.channel)
        self.vocab = vocab
        self.seen: list[Any] = []  # the measured responses' StepInfo and execute_ms

    def diagnostics(self) -> dict[str, Any]:
        """What the server reported for the last run: graph steps and its own time."""
        seen, self.seen = self.seen, []
        return {"graph_steps": sum(s.path == pb.PATH_GRAPH for s, _ in seen) / len(seen),
                "server_execute_ms": statistics.median(ms for _, ms in seen),
                "server_forward_ms": statistics.median(s.forward_ms for s, _ in seen)}

    def admit(self, ids: list[str]) -> list[int]:
        """Prefill ``CTX`` tokens for each of ``ids``; their first sampled tokens."""
        res = self.stub.Prefill(pb.PrefillRequest(items=[
            pb.PrefillItem(seq_id=s, token_ids=tokens(i, CTX, self.vocab), sample=True)
            for i, s in enumerate(ids)]), timeout=120)
        return [o.token_id for o in res.outputs]

    def unary(self, ids: list[str], toks: list[int], steps: int, num_steps: int = 1
              ) -> float:
        """Seconds per token of ``steps`` unary Decode calls (after 10 untimed), each of
        ``num_steps`` steps."""
        stamps = []
        for _ in range(steps + 10):
            res = self.stub.Decode(pb.DecodeRequest(num_steps=num_steps, items=[
                pb.DecodeItem(seq_id=s, token_id=t) for s, t in zip(ids, toks, strict=True)]),
                timeout=60)
            toks = [o.token_id for o in res.outputs]
            stamps.append(time.perf_counter())
            self.seen.append((res.step, res.execute_ms))
        return (stamps[-1] - stamps[9]) / (steps * num_steps)

    def session(self, ids: list[str], toks: list[int], steps: int, depth: int,
                packed: bool = False) -> float:
        """Seconds per token of ``steps`` Session steps (after 10 untimed) with ``depth``
        requests outstanding; with depth 1 each carries the tokens just read, deeper ones
        continue from the device's last samples. ``packed``: the answers come as flat
        arrays (``packed_outputs``).

        Deeper ones work as a pipelined scheduler would: the next request is made while
        the window is full (its items do not depend on the answers in flight), and an
        answer frees the window before it is read, so neither is on the path from one
        answer to the next launch."""
        window = threading.Semaphore(depth)
        latest: dict[str, int] = dict(zip(ids, toks, strict=True))
        ahead = pb.DecodeRequest(items=[pb.DecodeItem(seq_id=s, use_last_sampled=True)
                                        for s in ids], packed_outputs=packed)

        def requests() -> Iterator[pb.SessionRequest]:
            for n in range(steps + 10):
                if depth == 1:
                    window.acquire()
                    yield pb.SessionRequest(step=n + 1, decode=pb.DecodeRequest(
                        items=[pb.DecodeItem(seq_id=s, token_id=latest[s]) for s in ids],
                        packed_outputs=packed))
                else:
                    request = pb.SessionRequest(step=n + 1, decode=ahead)
                    window.acquire()
                    yield request

        stamps = []
        for response in self.stub.Session(requests(), timeout=600):
            stamps.append(time.perf_counter())
            if depth > 1:
                window.release()
            if response.WhichOneof("result") != "decode":
                raise RuntimeError(f"session step failed: {response}")
            if packed:
                latest.update(zip(ids, response.decode.packed.token_ids, strict=True))
            else:
                latest.update((o.seq_id, o.token_id) for o in response.decode.outputs)
            self.seen.append((response.decode.step, response.decode.execute_ms))
            if depth == 1:
                window.release()
        return (stamps[-1] - stamps[9]) / steps

    def release(self, ids: list[str]) -> None:
        self.stub.Release(pb.ReleaseRequest(seq_ids=ids), timeout=60)
