"""Weights that change under a served executor, two GPUs, one run
(``python -m bench.e2e.weights --shape llama-3.1-8b``; ``--smoke``: the same on CPU):

1. yardsticks: broadcast bandwidth trainer GPU -> server GPU (the update's own
   ``TransferGroup``), pinned host-to-device bandwidth on the server's GPU;
2. server A on random W1 (full decode graphs, breakable prefill): greedy tokens;
3. a trainer process sends W2 via NCCL (``WeightSender``): begin-to-end time;
4. UpdateWeights from the page-cached W2 directory: time;
5. no recapture (captured buckets and capture gauges unchanged), tokens after each;
6. Sleep(weights, kv_cache): device memory as this (other) process sees it; WakeUp time;
7. server B fresh on W2: its tokens must equal A's, bit for bit.

Prints a summary table; writes ``weights.json`` and ``weights.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from bench.common.meta import device_name, git_commit
from bench.common.server import free_port, stop, wait_ready
from bench.common.shapes import hf_config
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc

PROMPTS = [[(i * 7 + j * 131) % 500 + 3 for i in range(n)] for j, n in
           enumerate((7, 64, 200))]
STEPS = 16
ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30


# -- yardsticks -------------------------------------------------------------------------------
def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def nccl_probe(rank: int, port: int, device: str, nbytes: int, iters: int) -> None:
    """One side of the broadcast bandwidth probe (rank 0 sends); prints GB/s."""
    from executor.weights import TransferConfig, TransferGroup

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=True,
                                       wait_for_workers=False) if rank == 0 else None
    config = TransferConfig("127.0.0.1", port, 2, 1, _backend(device),  # type: ignore[arg-type]
                            "probe", 120.0)
    group = TransferGroup(config, rank, torch.device(device), store=store)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    group.broadcast(buf, 0)  # warm-up: the communicator and its buffers
    _sync(device)
    started = time.perf_counter()
    for _ in range(iters):
        group.broadcast(buf, 0)
    _sync(device)
    seconds = (time.perf_counter() - started) / iters
    print(json.dumps({"rank": rank, "gbps": nbytes / seconds / 1e9}), flush=True)
    group.close()


def measure_broadcast(server: str, trainer: str, nbytes: int) -> float:
    """GB/s of a broadcast from ``trainer``'s device to ``server``'s (two processes)."""
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "bench.e2e.weights", "--role", "probe", "--rank", str(rank),
         "--port", str(port), "--device", device, "--probe-bytes", str(nbytes)],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, text=True)
        for rank, device in ((0, trainer), (1, server))]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    rates = [json.loads(line)["gbps"] for out in outs for line in out.splitlines()
             if line.startswith("{")]
    if len(rates) != len(procs):
        raise RuntimeError(f"the broadcast probe failed (exit codes "
                           f"{[p.returncode for p in procs]}; its stderr is above)")
    return min(rates)


def measure_h2d(device: str, nbytes: int, iters: int = 5) -> float:
    """GB/s of pinned host-to-device copies (0 off CUDA)."""
    if not device.startswith("cuda"):
        return 0.0
    gpu = torch.device(device).index or 0
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{gpu}")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(gpu)
    started = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(gpu)
    rate = nbytes * iters / (time.perf_counter() - started) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return rate


def device_used(device: str) -> int:
    """Bytes in use on the device as this (another) process sees it; 0 off CUDA."""
    if not device.startswith("cuda"):
        return 0
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return total - free


# -- the trainer ------------------------------------------------------------------------------
def trainer(target: str, weights: Path, device: str, bucket_bytes: int, repeats: int) -> None:
    """Send ``weights`` (every safetensors file, on ``device``) ``repeats`` times over NCCL;
    one JSON line per update: begin-to-end seconds and the server's answer."""
    from safetensors.torch import load_file

    from service.weight_sender import WeightSender

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(weights.glob("*.safetensors")):
        tensors.update({k: v.to(device) for k, v in load_file(str(file)).items()})
    _sync(device)
    sender = WeightSender(target, backend=_backend(device), device=device, timeout_s=300)
    sender.connect()
    for i in range(repeats):
        started = time.perf_counter()
        done = sender.update(f"w2-nccl-{i}", tensors, bucket_bytes=bucket_bytes)
        seconds = time.perf_counter() - started
        print(json.dumps({"seconds": seconds, "update_ms": done.update_ms,
                          "bytes": done.bytes_updated, "tensors": done.tensors_updated}),
              flush=True)
    sender.close()


# -- the served side ---------------------------------------------------------------------------
def _env() -> dict[str, str]:
    """The children's environment: the repository first on the path, the parent's path kept
    (packages installed with ``--target`` live there)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def start_server(model: Path, device: str, random: bool, log: Path
                 ) -> tuple[subprocess.Popen[bytes], str, int]:
    """A server on ``device`` (its log lines in ``log``): on random weights (W1) with the
    shape of ``model``, or on ``model``'s checkpoint."""
    port, metrics = free_port(), free_port()
    graphs = ["--decode-graph", "full", "--prefill-graph", "breakable"] \
        if device.startswith("cuda") else ["--kv-tokens", "4096"]
    args = [sys.executable, "-m", "service.cli", "serve", "--model", str(model),
            "--device", device, "--port", str(port), "--metrics-port", str(metrics),
            *graphs, "--max-context", "2048", "--max-sequences", "16", "--drain-delay", "0",
            *(["--load-format", "random", "--weight-version", "w1"] if random else [])]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, cwd=ROOT, env=_env(), stdout=out,
                                stderr=subprocess.STDOUT)
    target = f"127.0.0.1:{port}"
    wait_ready(target, proc, 900)
    return proc, target, metrics


def greedy(stub: pb_grpc.ExecutorStub, tag: str) -> tuple[list[list[int]], set[str], set[int]]:
    ids = [f"{tag}-{i}" for i in range(len(PROMPTS))]
    out = stub.Prefill(pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id=s, token_ids=p, sample=True)
        for s, p in zip(ids, PROMPTS, strict=True)]), timeout=120)
    tokens = [[o.token_id] for o in out.outputs]
    versions, paths = {out.step.weight_version}, set()
    for _ in range(STEPS - 1):
        step = stub.Decode(pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id=s, use_last_sampled=True) for s in ids]), timeout=120)
        versions.add(step.step.weight_version)
        paths.add(step.step.path)
        for row, o in zip(tokens, step.outputs, strict=True):
            row.append(o.token_id)
    stub.Release(pb.ReleaseRequest(seq_ids=ids), timeout=60)
    return tokens, versions, paths


def capture_state(stub: pb_grpc.ExecutorStub, metrics_port: int) -> Any:
    """Captured buckets per phase and the capture-seconds gauges (a recapture sets them)."""
    import urllib.request

    health = stub.Health(pb.HealthRequest(), timeout=10)
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        gauges = sorted(line for line in r.read().decode().splitlines()
                        if line.startswith("model_executor_graph_capture_seconds"))
    return [list(g.captured_sizes) for g in health.graphs], gauges


def write_w2(shape: str, root: Path) -> Path:
    """The shape's W2 checkpoint (bf16; ``tiny``: float32), written once, page-cached."""
    from executor.weights.random_weights import write_random_model
    from executor.weights.tiny import tiny_config

    path = root / f"{shape}-w2"
    if not (path / "config.json").is_file():
        if shape == "tiny":
            write_random_model(path, tiny_config(), seed=1)
        else:
            write_random_model(path, hf_config(shape), seed=1, dtype=torch.bfloat16,
                               max_shard_bytes=2 * GiB)
    for file in path.glob("*.safetensors"):  # into the page cache
        with file.open("rb") as f:
            while f.read(64 << 20):
                pass
    return path


def run(args: argparse.Namespace) -> dict[str, Any]:
    r: dict[str, Any] = {"commit": git_commit(), "device": device_name(), "shape": args.shape}
    server, trainer_device = (("cpu", "cpu") if args.smoke else
                              (f"cuda:{args.server_gpu}", f"cuda:{args.trainer_gpu}"))
    r["nccl_gbps"] = measure_broadcast(server, trainer_device, args.probe_bytes)
    r["h2d_gbps"] = measure_h2d(server, args.probe_bytes)
    w2 = write_w2(args.shape, args.models)
    weight_bytes = sum(f.stat().st_size for f in w2.glob("*.safetensors"))
    baseline = device_used(server)
    args.out.mkdir(parents=True, exist_ok=True)
    proc, target, metrics = start_server(w2, server, True,
                                         args.out / "weights-server-a.log")
    try:
        stub = pb_grpc.ExecutorStub(grpc.insecure_channel(target))
        graphs_before = capture_state(stub, metrics)
        r["tokens_w1"], _, _ = greedy(stub, "w1")
        out = subprocess.run(
            [sys.executable, "-m", "bench.e2e.weights", "--role", "trainer", "--target",
             target, "--weights", str(w2), "--device", trainer_device,
             "--bucket-bytes", str(args.bucket_bytes), "--repeats", "2"],
            cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stdout + out.stderr[-4000:]
        r["nccl_updates"] = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
        r["tokens_nccl"], versions, paths = greedy(stub, "nccl")
        r["versions_nccl"] = sorted(versions)
        started = time.perf_counter()
        disk = stub.UpdateWeights(pb.UpdateWeightsRequest(weight_version="w2-disk",
                                                          path=str(w2)), timeout=900)
        r["disk_s"], r["disk_update_ms"] = time.perf_counter() - started, disk.update_ms
        r["tokens_disk"], _, paths2 = greedy(stub, "disk")
        r["graph_paths"] = sorted(paths | paths2)
        r["graphs_unchanged"] = capture_state(stub, metrics) == graphs_before
        awake = device_used(server)
        slept = stub.Sleep(pb.SleepRequest(tags=["weights", "kv_cache"]), timeout=900)
        time.sleep(1.0)
        asleep = device_used(server)
        r["executor_bytes"] = awake - baseline
        r["freed_fraction"] = (awake - asleep) / max(1, awake - baseline)
        r["sleep_ms"], r["reported_freed"] = slept.sleep_ms, slept.freed_bytes
        started = time.perf_counter()
        woke = stub.WakeUp(pb.WakeUpRequest(), timeout=900)
        r["wake_s"], r["restore_ms"] = time.perf_counter() - started, woke.restore_ms
        r["recapture_ms"] = woke.recapture_ms
        r["tokens_wake"], _, _ = greedy(stub, "wake")
    finally:
        stop(proc)
    proc, target, _ = start_server(w2, server, False,
                                   args.out / "weights-server-b.log")
    try:
        r["tokens_fresh"], _, _ = greedy(pb_grpc.ExecutorStub(grpc.insecure_channel(target)),
                                         "fresh")
    finally:
        stop(proc)
    r["weight_bytes"] = weight_bytes
    return r


def table(r: dict[str, Any]) -> str:
    best = min(u["seconds"] for u in r["nccl_updates"])
    floor = r["weight_bytes"] / (r["nccl_gbps"] * 1e9)
    wake_floor = r["weight_bytes"] / (r["h2d_gbps"] * 1e9) if r["h2d_gbps"] else 0.0
    same = r["tokens_nccl"] == r["tokens_disk"] == r["tokens_wake"] == r["tokens_fresh"]
    rows = [
        ("NCCL broadcast bandwidth (probe)", f"{r['nccl_gbps']:.1f} GB/s", ""),
        ("pinned H2D bandwidth (probe)", f"{r['h2d_gbps']:.1f} GB/s", ""),
        ("weights", f"{r['weight_bytes'] / GiB:.2f} GiB", r["shape"]),
        ("update via NCCL, begin to end (best of 2)", f"{best:.2f} s",
         f"{floor / best:.0%} of bandwidth (goal <= 2 s, >= 50 %); first "
         f"{r['nccl_updates'][0]['seconds']:.2f} s"),
        ("update from page-cached safetensors", f"{r['disk_s']:.2f} s",
         f"server {r['disk_update_ms'] / 1e3:.2f} s"),
        ("graphs recaptured by the updates", "none" if r["graphs_unchanged"] else "CHANGED",
         f"decode paths {r['graph_paths']} (1 = graph)"),
        ("tokens after updates == fresh server", "yes" if same else "NO",
         f"{len(PROMPTS)} prompts x {STEPS} steps, bit for bit"),
        ("Sleep(weights, kv_cache) freed", f"{r['freed_fraction']:.1%}",
         f"of {r['executor_bytes'] / GiB:.1f} GiB the executor held (goal >= 90 %)"),
        ("WakeUp", f"{r['wake_s']:.2f} s",
         f"restore {r['restore_ms'] / 1e3:.2f} s vs H2D floor {wake_floor:.2f} s; recapture "
         f"{r['recapture_ms'] / 1e3:.2f} s"),
    ]
    lines = ["| measure | value | note |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines) + f"\n\n{r['device']}, commit {r['commit']}\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("main", "trainer", "probe"), default="main")
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--models", type=Path, default=Path("/tmp/model-executor-bench"))
    ap.add_argument("--out", type=Path, default=Path("results-local"))
    ap.add_argument("--server-gpu", type=int, default=0)
    ap.add_argument("--trainer-gpu", type=int, default=1)
    ap.add_argument("--bucket-bytes", type=int, default=1 << 30)
    ap.add_argument("--probe-bytes", type=int, default=1 << 30)
    ap.add_argument("--smoke", action="store_true",
                    help="CPU: the tiny shape over gloo, no graphs (checks the script)")
    # the roles' own arguments
    ap.add_argument("--target", default="")
    ap.add_argument("--weights", type=Path, default=None)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    if args.role == "probe":
        nccl_probe(args.rank, args.port, args.device, args.probe_bytes, 10)
        return 0
    if args.role == "trainer":
        trainer(args.target, args.weights, args.device, args.bucket_bytes, args.repeats)
        return 0
    if args.smoke:
        args.shape, args.probe_bytes = "tiny", min(args.probe_bytes, 16 << 20)
    r = run(args)
    text = table(r)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weights.json").write_text(json.dumps(r, indent=1))
    (args.out / "weights.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
