"""gRPC overhead: Decode RPC latency from a ``grpc.aio`` client acting as the scheduler,
against the same decode called in-process on an executor with the same configuration.

``python -m bench.serving.grpc_overhead [--model tiny] [--device cpu] [--out DIR]`` starts
the server as a subprocess (``model-executor serve``) on a free loopback port, waits for
readiness, and for each batch size admits sequences, runs ``--steps`` Decode calls one
after the other (as a scheduler's step loop does), and releases them. Runs on a CPU-only
machine with the tiny model too.

Two figures split the overhead: *outside executor* is each call's latency minus the
executor time the server reports in it (``execute_ms``), so it holds transport, protobuf,
the servicer, interceptors, logging, metrics and the hop to the executor thread; *bare
gRPC* is the same client loop against a bare ``grpc.aio`` server in its own process that
answers the same messages without any of our code (``--echo-server PORT``). Their
difference is what our service layer costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from bench.common.meta import git_commit
from bench.common.server import SERVICE, free_port, stop, tokens, wait_ready
from executor.api import DecodeItem, PrefillItem
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from executor.executor import Executor
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc

CTX = 128
MAX_SEQS = 64


def _percentiles(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    return {"p50_ms": statistics.median(s), "p99_ms": s[min(len(s) - 1, int(len(s) * 0.99))],
            "n": len(s)}


async def _rpc_run(target: str, batches: list[int], steps: int, vocab: int
                   ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.ExecutorStub(channel)
        for bs in batches:
            ids = [f"rpc{bs}-{i}" for i in range(bs)]
            res = await stub.Prefill(pb.PrefillRequest(items=[
                pb.PrefillItem(seq_id=s, token_ids=tokens(i, CTX, vocab), sample=True)
                for i, s in enumerate(ids)]))
            toks = [o.token_id for o in res.outputs]
            times, outside, queued = [], [], []
            for step in range(steps + 10):
                req = pb.DecodeRequest(items=[pb.DecodeItem(seq_id=s, token_id=t)
                                              for s, t in zip(ids, toks, strict=True)])
                t0 = time.perf_counter()
                res = await stub.Decode(req)
                if step >= 10:
                    ms = (time.perf_counter() - t0) * 1e3
                    times.append(ms)
                    # Everything but the executor call itself, per call (the server says how
                    # long that took): free of the noise of two separate runs.
                    outside.append(ms - res.execute_ms)
                    queued.append(res.queue_ms)
                toks = [o.token_id for o in res.outputs]
            await stub.Release(pb.ReleaseRequest(seq_ids=ids))
            out[str(bs)] = {**_percentiles(times), "path": pb.Path.Name(res.step.path),
                            "outside_executor_p50_ms": statistics.median(outside),
                            "queue_p50_ms": statistics.median(queued)}
    return out


def _direct_run(ex: Executor, batches: list[int], steps: int) -> dict[str, Any]:
    vocab = ex.model_info.vocab_size
    out: dict[str, Any] = {}
    for bs in batches:
        ids = [f"direct{bs}-{i}" for i in range(bs)]
        res = ex.prefill([PrefillItem(s, tokens(i, CTX, vocab)) for i, s in enumerate(ids)])
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


async def _echo_serve(port: int) -> None:
    """A bare ``grpc.aio`` server answering Prefill/Decode/Release with well-formed replies
    of the same size as ours (one output per item) and nothing else: the transport floor."""
    from grpc_health.v1 import health
    from grpc_health.v1.health_pb2_grpc import add_HealthServicer_to_server

    def step(items: Any, message: Any) -> Any:
        return message(
            outputs=[pb.ItemOutput(seq_id=i.seq_id, token_id=1, seq_len=CTX) for i in items],
            step=pb.StepInfo(phase=pb.PHASE_DECODE, path=pb.PATH_EAGER, num_tokens=len(items)))

    async def prefill(req: pb.PrefillRequest, _: Any) -> pb.PrefillResponse:
        return step(req.items, pb.PrefillResponse)  # type: ignore[no-any-return]

    async def decode(req: pb.DecodeRequest, _: Any) -> pb.DecodeResponse:
        return step(req.items, pb.DecodeResponse)  # type: ignore[no-any-return]

    async def release(req: pb.ReleaseRequest, _: Any) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=len(req.seq_ids))

    def unary(fn: Any, req: Any, resp: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=req.FromString, response_serializer=resp.SerializeToString)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE, {
            "Prefill": unary(prefill, pb.PrefillRequest, pb.PrefillResponse),
            "Decode": unary(decode, pb.DecodeRequest, pb.DecodeResponse),
            "Release": unary(release, pb.ReleaseRequest, pb.ReleaseResponse)}),))
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def _served(args: list[str], target: str, batches: list[int], steps: int, vocab: int
            ) -> dict[str, Any]:
    """Start ``args`` as a server process, run the client loop against it, stop it."""
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_ready(target, proc, 600)
        return asyncio.run(_rpc_run(target, batches, steps, vocab))
    finally:
        stop(proc, 30)


def measure(model: str, device: str, batches: list[int], steps: int) -> dict[str, Any]:
    cuda = device.startswith("cuda")
    port = free_port()
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
    rpc = _served(args, target, batches, steps, vocab)
    port = free_port()
    bare = _served([sys.executable, "-m", "bench.serving.grpc_overhead", "--echo-server",
                    str(port)], f"127.0.0.1:{port}", batches, steps, vocab)
    table = []
    for bs in batches:
        r, d, b = rpc[str(bs)], direct[str(bs)], bare[str(bs)]
        table.append({"batch": bs, "rpc_p50_ms": r["p50_ms"], "rpc_p99_ms": r["p99_ms"],
                      "direct_p50_ms": d["p50_ms"], "direct_p99_ms": d["p99_ms"],
                      "overhead_p50_us": (r["p50_ms"] - d["p50_ms"]) * 1e3,
                      "outside_executor_p50_us": r["outside_executor_p50_ms"] * 1e3,
                      "queue_p50_us": r["queue_p50_ms"] * 1e3,
                      "bare_grpc_p50_us": b["p50_ms"] * 1e3,
                      "rpc_path": r["path"], "direct_path": d["path"], "steps": steps})
    return {"model": model, "device": device, "context": CTX, "table": table,
            "thread_hop_p50_us": thread_hop_us(), "environment": _environment()}


def thread_hop_us(n: int = 3000) -> float:
    """Median round trip of a no-op through a one-thread pool from the event loop: what
    the hop to the executor thread and back costs on this host, with nothing else."""
    from concurrent.futures import ThreadPoolExecutor

    async def run() -> float:
        loop = asyncio.get_running_loop()
        times = []
        with ThreadPoolExecutor(max_workers=1) as pool:
            for _ in range(n):
                t0 = time.perf_counter()
                await loop.run_in_executor(pool, int)
                times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times[n // 10:])

    return asyncio.run(run())


def _environment() -> dict[str, Any]:
    import datetime as dt
    import os
    import platform

    return {"date": dt.date.today().isoformat(), "cpu": platform.processor() or
            platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "grpcio": grpc.__version__,
            "git_commit": git_commit()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--echo-server", type=int, metavar="PORT",
                    help="serve the bare baseline on PORT (used by the benchmark itself)")
    args = ap.parse_args(argv)
    if args.echo_server:
        asyncio.run(_echo_serve(args.echo_server))
        return 0
    result = measure(args.model, args.device, [int(b) for b in args.batches.split(",")],
                     args.steps)
    lines = ["| batch | RPC p50 ms | RPC p99 ms | in-process p50 ms | in-process p99 ms | "
             "overhead p50 µs | outside executor p50 µs | of it queued µs | bare gRPC p50 µs |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["table"]:
        lines.append(f"| {r['batch']} | {r['rpc_p50_ms']:.3f} | {r['rpc_p99_ms']:.3f} | "
                     f"{r['direct_p50_ms']:.3f} | {r['direct_p99_ms']:.3f} | "
                     f"{r['overhead_p50_us']:.0f} | {r['outside_executor_p50_us']:.0f} | "
                     f"{r['queue_p50_us']:.0f} | {r['bare_grpc_p50_us']:.0f} |")
    env = result["environment"]
    md = (f"gRPC Decode overhead ({args.model} on {args.device}; {env['date']}, "
          f"{env['cpus']} CPUs, grpcio {env['grpcio']}, commit {env['git_commit']}):\n\n"
          + "\n".join(lines) + "\n\n"
          f"A no-op round trip to a worker thread and back: {result['thread_hop_p50_us']:.0f} µs"
          " p50 (part of every step RPC).\n")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "grpc_overhead.json").write_text(json.dumps(result, indent=2))
        (args.out / "grpc_overhead.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
