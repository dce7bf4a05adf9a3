"""Benchmark entry point: ``python -m bench.run [--profile quick|full] --out DIR``.

Measures the device (read bandwidth, bf16 matmul rate), then our decode latency on the
Llama-3.2-1B shape (random bf16 weights written in HF format and loaded through the real
loader), graph vs eager, and writes ``bench.json`` plus ``bench.md`` to ``--out``. The
short table is printed last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench import decode, hardware, shapes
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from executor.executor import Executor

PROFILES: dict[str, dict[str, Any]] = {
    "quick": {"batches": [1, 8, 64], "contexts": [512], "steps": 30},
    "full": {"batches": [1, 8, 32, 64, 128, 256], "contexts": [512, 2048], "steps": 50},
}


def environment() -> dict[str, Any]:
    import transformers
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    # The GPU machine gets a copy of the tree without .git: the caller passes the commit.
    commit = commit or os.environ.get("MODEL_EXECUTOR_COMMIT", "unknown")
    props = torch.cuda.get_device_properties(0)
    return {
        "date": dt.date.today().isoformat(),
        "device": props.name, "sm_count": props.multi_processor_count,
        "driver": _driver(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": triton.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "git_commit": commit,
    }


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False)
        return out.stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        return "unknown"


def build_executor(model_dir: Path, max_batch: int, max_ctx: int) -> tuple[Executor, dict]:
    t0 = time.perf_counter()
    cfg = ExecutorConfig(
        model=ModelConfig(source=str(model_dir), dtype="bfloat16"), device="cuda",
        cache=CacheConfig(kv_tokens=max_batch * (max_ctx + 128) + 4096,
                          max_sequences=max(max_batch, 8), max_context=max_ctx + 256),
        graphs=GraphConfig(decode_mode="full", prefill_mode="disabled"),
        attention_backend="triton", max_decode_batch=max_batch, max_prefill_tokens=8192)
    ex = Executor(cfg)
    load_s = time.perf_counter() - t0
    cap = ex.capture(["decode"], progress=True)[0]
    ready_s = time.perf_counter() - t0
    info = {"load_s": load_s, "ready_s": ready_s, "capture_ms": cap.total_ms,
            "graph_memory_bytes": cap.memory_bytes,
            "buckets": len(cap.buckets), "failed": [b.size for b in cap.buckets if not b.ok]}
    return ex, info


def markdown(result: dict[str, Any]) -> str:
    env, hw = result["environment"], result["hardware"]
    lines = [
        f"# Benchmark — {env['device']}, {env['date']} (commit {env['git_commit']})", "",
        f"torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, "
        f"transformers {env['transformers']}, driver {env['driver']}", "",
        f"Measured read bandwidth {hw['read_gbs']:.0f} GB/s, bf16 matmul "
        f"{hw['matmul_tflops']:.0f} TFLOP/s.", "",
        "## Decode, Llama-3.2-1B shape (bf16, random weights)", "",
        f"Start-up: load {result['startup']['load_s']:.1f} s, decode capture "
        f"{result['startup']['capture_ms'] / 1e3:.1f} s for {result['startup']['buckets']} "
        f"buckets, graph memory {result['startup']['graph_memory_bytes'] / 2**20:.0f} MiB.", "",
        "| batch | ctx | floor ms | eager step ms | graph step ms | graph forward ms | "
        "graph/floor | eager/graph |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["decode_table"]:
        lines.append(
            f"| {row['batch']} | {row['context']} | {row['floor_ms']:.3f} | "
            f"{row['eager_step_ms']:.3f} | {row['graph_step_ms']:.3f} | "
            f"{row['graph_forward_ms']:.3f} | {row['graph_step_ms'] / row['floor_ms']:.2f} | "
            f"{row['eager_step_ms'] / row['graph_step_ms']:.1f} |")
    prof = result.get("kernel_profile")
    if prof:
        lines += ["", f"Eager decode step at batch 1: {prof['kernels_per_step']} kernels. "
                  "Largest:", ""]
        lines += [f"- {k['name']} ×{k['count']}: {k['us_total']:.0f} µs" for k in prof["top"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", type=Path, default=Path("/tmp/model-executor-bench"))
    args = ap.parse_args(argv)
    prof = PROFILES[args.profile]
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"environment": environment(), "profile": args.profile}
    bw = hardware.read_bandwidth_gbs()
    result["hardware"] = {"read_gbs": bw, "matmul_tflops": hardware.matmul_tflops()}
    print(f"hardware: {result['hardware']}", flush=True)

    t0 = time.perf_counter()
    model_dir = shapes.write_shape("llama-3.2-1b", args.models)
    result["write_model_s"] = time.perf_counter() - t0
    max_batch, max_ctx = max(prof["batches"]), max(prof["contexts"])
    ex, startup = build_executor(model_dir, max_batch, max_ctx)
    result["startup"] = startup
    wbytes = shapes.weight_bytes("llama-3.2-1b")
    per_tok_kv = 2 * ex.spec.num_layers * ex.spec.num_kv_heads * ex.spec.head_dim * 2
    rows = []
    for ctx in prof["contexts"]:
        for bs in prof["batches"]:
            eager = decode.measure(ex, bs, ctx, prof["steps"], use_graph=False)
            graph = decode.measure(ex, bs, ctx, prof["steps"], use_graph=True)
            floor_ms = (wbytes + bs * ctx * per_tok_kv) / (bw * 1e9) * 1e3
            rows.append({"batch": bs, "context": ctx, "floor_ms": floor_ms,
                         "eager_step_ms": eager["step_ms_median"],
                         "graph_step_ms": graph["step_ms_median"],
                         "graph_forward_ms": graph["forward_ms_median"] or float("nan"),
                         "graph_paths": graph["paths"], "eager_paths": eager["paths"]})
            print(f"decode bs={bs} ctx={ctx}: {rows[-1]}", flush=True)
    result["decode_table"] = rows
    result["kernel_profile"] = decode.kernel_profile(ex, 1, 512)
    (args.out / "bench.json").write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (args.out / "bench.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
