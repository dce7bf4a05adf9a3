"""gRPC overhead: Decode RPC latency from a ``grpc.aio`` client acting as the scheduler,
against the same decode called in-process on an executor with the same configuration.

``python -m bench.grpc_overhead [--model tiny] [--device cpu] [--out DIR]`` starts the
server as a subprocess (``model-executor serve``) on a free loopback port, waits for
readiness, and for each batch size admits sequences, runs ``--steps`` Decode calls one
after the other (as a scheduler's step loop does), and releases them. Runs on a CPU-only
machine with the tiny model too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from executor.api import DecodeItem, PrefillItem
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from executor.executor import Executor
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc

CTX = 128
MAX_SEQS = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _percentiles(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    return {"p50_ms": statistics.median(s), "p99_ms": s[min(len(s) - 1, int(len(s) * 0.99))],
            "n": len(s)}


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % vocab for i in range(n)]


async def _rpc_run(target: str, batches: list[int], steps: int, vocab: int
                   ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.ExecutorStub(channel)
        for bs in batches:
            ids = [f"rpc{bs}-{i}" for i in range(bs)]
            res = await stub.Prefill(pb.PrefillRequest(items=[
                pb.PrefillItem(seq_id=s, token_ids=_tokens(i, CTX, vocab), sample=True)
                for i, s in enumerate(ids)]))
            toks = [o.token_id for o in res.outputs]
            times = []
            for step in range(steps + 10):
                req = pb.DecodeRequest(items=[pb.DecodeItem(seq_id=s, token_id=t)
                                              for s, t in zip(ids, toks, strict=True)])
                t0 = time.perf_counter()
                res = await stub.Decode(req)
                if step >= 10:
                    times.append((time.perf_counter() - t0) * 1e3)
                toks = [o.token_id for o in res.outputs]
            await stub.Release(pb.ReleaseRequest(seq_ids=ids))
            out[str(bs)] = {**_percentiles(times), "path": pb.Path.Name(res.step.path)}
    return out


def _direct_run(ex: Executor, batches: list[int], steps: int) -> dict[str, Any]:
    vocab = ex.model_info.vocab_size
    out: dict[str, Any] = {}
    for bs in batches:
        ids = [f"direct{bs}-{i}" for i in range(bs)]
        res = ex.prefill([PrefillItem(s, _tokens(i, CTX, vocab)) for i, s in enumerate(ids)])
        toks = [int(o.token_id) for o in res.outputs]  # type: ignore[arg-type]
        times = []
        for step in range(steps + 10):
            items = [DecodeItem(s, t) for s, t in zip(ids, toks, strict=True)]
            t0 = time.perf_counter()
            step_res = ex.decode(items)
            if step >= 10:
                times.append((time.perf_counter() - t0) * 1e3)
            toks = [int(o.token_id) for o in step_res.outputs]  # type: ignore[arg-type]
        ex.release(ids)
        out[str(bs)] = {**_percentiles(times), "path": step_res.step.path}
    return out


def _wait_ready(target: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
            try:
                req = health_pb2.HealthCheckRequest(service="model_executor.v1.Executor")
                if health.Check(req, timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"server at {target} not ready within {timeout_s} s")


def measure(model: str, device: str, batches: list[int], steps: int) -> dict[str, Any]:
    cuda = device.startswith("cuda")
    port = _free_port()
    target = f"127.0.0.1:{port}"
    kv_tokens = MAX_SEQS * (CTX + steps + 64)
    args = [sys.executable, "-m", "service.cli", "serve", "--model", model, "--device", device,
            "--port", str(port), "--metrics-port", "-1", "--max-sequences", str(MAX_SEQS),
            "--max-context", str(CTX + steps + 64), "--kv-tokens", str(kv_tokens),
            "--prefill-graph", "disabled", "--log-level", "WARNING"]
    # In-process first, then the server: on a small CPU machine the two processes would
    # otherwise compete for the same cores and both figures would be noise.
    ex_cfg = ExecutorConfig(
        model=ModelConfig(source=model), device=device,
        cache=CacheConfig(kv_tokens=kv_tokens, max_sequences=MAX_SEQS,
                          max_context=CTX + steps + 64),
        graphs=GraphConfig(decode_mode="full" if cuda else "disabled"),
        max_decode_batch=MAX_SEQS)
    ex = Executor(ex_cfg)
    if cuda:
        ex.capture(ex.startup_phases())
    direct = _direct_run(ex, batches, steps)
    vocab = ex.model_info.vocab_size
    del ex
    if cuda:
        import torch

        torch.cuda.empty_cache()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_ready(target, proc, 600)
        rpc = asyncio.run(_rpc_run(target, batches, steps, vocab))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    table = []
    for bs in batches:
        r, d = rpc[str(bs)], direct[str(bs)]
        table.append({"batch": bs, "rpc_p50_ms": r["p50_ms"], "rpc_p99_ms": r["p99_ms"],
                      "direct_p50_ms": d["p50_ms"], "direct_p99_ms": d["p99_ms"],
                      "overhead_p50_us": (r["p50_ms"] - d["p50_ms"]) * 1e3,
                      "rpc_path": r["path"], "direct_path": d["path"], "steps": steps})
    return {"model": model, "device": device, "context": CTX, "table": table}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    result = measure(args.model, args.device, [int(b) for b in args.batches.split(",")],
                     args.steps)
    lines = ["| batch | RPC p50 ms | RPC p99 ms | in-process p50 ms | in-process p99 ms | "
             "overhead p50 µs |", "|---:|---:|---:|---:|---:|---:|"]
    for r in result["table"]:
        lines.append(f"| {r['batch']} | {r['rpc_p50_ms']:.3f} | {r['rpc_p99_ms']:.3f} | "
                     f"{r['direct_p50_ms']:.3f} | {r['direct_p99_ms']:.3f} | "
                     f"{r['overhead_p50_us']:.0f} |")
    md = f"gRPC Decode overhead ({args.model} on {args.device}):\n\n" + "\n".join(lines) + "\n"
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "grpc_overhead.json").write_text(json.dumps(result, indent=2))
        (args.out / "grpc_overhead.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
