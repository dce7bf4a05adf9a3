"""The benchmark: ``python -m bench.e2e.run [--profile smoke|quick|full|8b] [--out DIR]``.

In one run on a CUDA machine: the device (read bandwidth, bf16 matmul rate) and from it
the floor per step; our decode (eager, full graph, breakable) and prefill (eager,
breakable, tc_piecewise with the eager and inductor compilers) on the Llama-3.2-1B shape
(random bf16 weights written in HF format and loaded through the real loader); capture
time and graph memory per phase and backend; start-up time to ready; and the peer (HF
transformers on the same weights). ``smoke`` runs the same on the embedded tiny model;
it is the one profile that also runs without CUDA (eager steps with torch_native attention,
HF eager as the peer), so the CPU suite exercises the whole pipeline. Writes
``bench.json``, ``bench.md`` and PNG plots to ``--out`` (default ``results-local``) and
prints the short table last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import hardware, shapes
from bench.common.meta import device_name, driver, git_commit
from bench.common.plots import write_plots
from bench.common.report import markdown
from bench.e2e import peer
from bench.e2e.step_latency import decode_kernels, measure_decode, measure_prefill
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from executor.errors import ConfigError
from executor.executor import Executor

PROFILES: dict[str, dict[str, Any]] = {
    # The embedded tiny model: a smoke run of every code path in about a minute.
    "smoke": {"shape": "tiny", "batches": [1, 8], "contexts": [128], "steps": 10,
              "prefill_tokens": [16, 128], "prefill_seqs": [1, 2],
              "decode_modes": ["full", "breakable"],
              "prefill_modes": ["breakable", "tc_piecewise:eager"],
              "peer_compile": False, "peer_prefill": [16, 128], "repeats": 5},
    # Only the 8B decode figures (a short GPU lease).
    "8b": {"batches": [1, 8], "contexts": [512], "steps": 20, "prefill_tokens": [],
           "prefill_seqs": [1], "decode_modes": [], "prefill_modes": [], "peer_compile": False,
           "repeats": 10, "big_shape": "llama-3.1-8b", "big_batches": [1, 8]},
    "quick": {"batches": [1, 8, 64], "contexts": [512], "steps": 30,
              "prefill_tokens": [16, 128, 512, 2048], "prefill_seqs": [1],
              "decode_modes": ["full", "breakable", "full@flashinfer"],
              "prefill_modes": ["breakable", "tc_piecewise:eager", "breakable@flashinfer"],
              "peer_compile": False, "repeats": 10},
    "full": {"batches": [1, 8, 32, 64, 128, 256], "contexts": [512, 2048], "steps": 30,
             "prefill_tokens": [16, 64, 128, 256, 512, 1024, 2048, 4096],
             "prefill_seqs": [1, 8],
             "decode_modes": ["full", "breakable", "full@flashinfer", "breakable@flashinfer"],
             "prefill_modes": ["breakable", "tc_piecewise:eager", "tc_piecewise:inductor",
                               "breakable@flashinfer"],
             "peer_compile": True, "repeats": 10,
             # The 8B shape: decode only (full graph vs eager), written like the 1B.
             "big_shape": "llama-3.1-8b", "big_batches": [1, 8, 64]},
}


#: The one mode a CPU-only machine measures: no graphs, torch_native attention (its rows
#: are labelled ``eager@torch_native``).
CPU_MODE = "disabled@torch_native"


def environment() -> dict[str, Any]:
    import transformers
    import triton

    cuda = torch.cuda.is_available()
    return {
        "date": dt.date.today().isoformat(),
        "device": device_name(),
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count if cuda
        else None,
        "driver": driver() if cuda else "—", "torch": torch.__version__,
        "cuda": torch.version.cuda, "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(), "git_commit": git_commit(),
    }


def parse_mode(label: str) -> tuple[str, str, str]:
    """``graph_mode[:compiler][@attention]`` -> (graph mode, compiler, attention backend);
    e.g. ``tc_piecewise:inductor``, ``full@flashinfer``. Attention defaults to triton."""
    label, _, attention = label.partition("@")
    mode, _, compiler = label.partition(":")
    return mode, compiler or "eager", attention or "triton"


def eager_label(attention: str) -> str:
    """The label of eager rows: ``eager`` for triton (the default), else ``eager@<name>``."""
    return "eager" if attention == "triton" else f"eager@{attention}"


def build(model_dir: Path, decode_label: str, prefill_label: str, prof: dict[str, Any],
          compile_cache: Path | None = None) -> tuple[Executor, dict[str, Any]]:
    """An executor with the given graph modes (labels as in ``parse_mode``; the attention
    backend comes from the label of the phase being measured), captured; start-up figures
    alongside. ``compile_cache``: tc_piecewise's on-disk artifact cache (cold vs warm)."""
    max_batch, max_ctx = max(prof["batches"]), max(prof["contexts"])
    decode_mode, _, decode_attn = parse_mode(decode_label)
    prefill_mode, compiler, prefill_attn = parse_mode(prefill_label)
    attention = decode_attn if decode_label != "disabled" else prefill_attn
    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    cfg = ExecutorConfig(
        model=ModelConfig(source=str(model_dir), dtype="bfloat16" if cuda else "float32"),
        device="cuda" if cuda else "cpu",
        cache=CacheConfig(kv_tokens=max_batch * (max_ctx + 128) + 16384,
                          max_sequences=max(max_batch, 16), max_context=max(max_ctx, 4096) + 256),
        graphs=GraphConfig(decode_mode=decode_mode, prefill_mode=prefill_mode,  # type: ignore[arg-type]
                           compiler=compiler,  # type: ignore[arg-type]
                           compile_cache_dir=str(compile_cache) if compile_cache else None),
        attention_backend=attention,  # type: ignore[arg-type]
        max_decode_batch=max_batch, max_prefill_tokens=4096)
    ex = Executor(cfg)
    load_s = time.perf_counter() - t0
    phases = ex.startup_phases()
    caps = ex.capture(phases, progress=True) if phases else ()
    info: dict[str, Any] = {"load_s": load_s, "ready_s": time.perf_counter() - t0,
                            "decode_mode": decode_label, "prefill_mode": prefill_mode,
                            "compiler": compiler, "attention": ex.model_info.attention_backend,
                            "boot_s": ex.boot_seconds, "phases": {}}
    for runner in ex.runners.values():
        stats = getattr(getattr(runner, "backend", None), "stats", None)
        if stats is not None:  # tc_piecewise: compile time, disk-cache hits
            info["compile"] = {k: v for k, v in vars(stats).items()
                               if isinstance(v, (int, float, str, bool))}
    for cap in caps:
        info["phases"][cap.phase] = {
            "backend": cap.backend, "capture_s": cap.total_ms / 1e3,
            "graph_memory_bytes": cap.memory_bytes, "buckets": len(cap.buckets),
            "failed": [b.size for b in cap.buckets if not b.ok],
            "first_error": next((b.error for b in cap.buckets if not b.ok), "")}
    return ex, info


def decode_big_shape(prof: dict[str, Any], model_dir: Path, bw_gbs: float
                     ) -> list[dict[str, Any]]:
    """Decode on the large shape at ``big_batches``, context 512: full graph vs eager."""
    name = prof["big_shape"]
    big = {**prof, "batches": prof["big_batches"], "contexts": [512]}
    ex, info = build(model_dir, "full", "disabled", big)
    spec = shapes.spec(name)
    kv_per_tok = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2
    rows = []
    for bs in prof["big_batches"]:
        floor_ms = (shapes.weight_bytes(name) + bs * 512 * kv_per_tok) / (bw_gbs * 1e9) * 1e3
        for use_graph in (False, True):
            row = measure_decode(ex, bs, 512, prof["steps"], use_graph=use_graph)
            rows.append({**row, "mode": "full" if use_graph else "eager", "shape": name,
                         "floor_ms": floor_ms, "load_s": info["load_s"]})
            print(f"decode {name} {rows[-1]['mode']} bs={bs}: {row}", flush=True)
    del ex
    hardware.release_memory()
    return rows


def render(folder: Path) -> int:
    """Re-render a run's report and plots from its ``bench.json`` (see ``--render``)."""
    result = json.loads((folder / "bench.json").read_text())
    for path in sorted(folder.glob("peer-*.json")):
        extra = json.loads(path.read_text())
        key = "peer_8b" if extra.get("shape") == "llama-3.1-8b" else "peer"
        figures = {k: v for k, v in extra.items() if k.startswith("decode_bs1_static_compile")}
        result[key] = {**result.get(key, {}), **figures}
        result.setdefault("followups", []).append(
            {"file": path.name, "shape": extra.get("shape"), "keys": sorted(figures)})
    result["plots"] = [p.name for p in write_plots(result, folder)]
    (folder / "bench.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    ap.add_argument("--out", type=Path, default=Path("results-local"),
                    help="results folder (default: %(default)s, git-ignored)")
    ap.add_argument("--render", type=Path, metavar="DIR",
                    help="only re-render DIR/bench.md and the plots from DIR/bench.json, "
                         "adding HF static+compile figures from DIR/peer-*.json (follow-up "
                         "runs of python -m bench.e2e.peer); measures nothing")
    ap.add_argument("--models", type=Path, default=Path("/tmp/model-executor-bench"))
    ap.add_argument("--no-peer", action="store_true", help="skip HF transformers")
    args = ap.parse_args(argv)
    if args.render is not None:
        return render(args.render)
    prof = PROFILES[args.profile]
    if not torch.cuda.is_available():
        if args.profile != "smoke":
            ap.error(f"profile {args.profile!r} needs a CUDA device; without one, only "
                     "'smoke' runs (eager, torch_native attention)")
        # No graphs and no kernel backends on a CPU: eager rows only, HF eager as the peer.
        prof = {**prof, "decode_modes": [CPU_MODE], "prefill_modes": [CPU_MODE],
                "peer_compile": False}
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"environment": environment(), "profile": args.profile,
                              "startup": [], "decode_table": [], "prefill_table": []}
    bw = hardware.read_bandwidth_gbs()
    flops = hardware.matmul_tflops()
    result["hardware"] = {"read_gbs": bw, "matmul_tflops": flops}
    print(f"hardware: {result['hardware']}", flush=True)
    t0 = time.perf_counter()
    shape = prof.get("shape", "llama-3.2-1b")
    model_dir, spec = shapes.model(shape, args.models)
    result["write_model_s"] = time.perf_counter() - t0
    result["shape"], result["key_context"] = shape, min(prof["contexts"])
    wbytes = shapes.spec_weight_bytes(spec)
    kv_per_tok = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2

    def save() -> None:
        (args.out / "bench.json").write_text(json.dumps(result, indent=2))

    # -- decode: eager vs each graph mode ------------------------------------------------
    # Eager rows once per attention backend (labelled ``eager`` for triton's, else
    # ``eager@<backend>``); a backend that cannot serve here is recorded, not fatal.
    eager_done: set[str] = set()
    for i, mode in enumerate(prof["decode_modes"]):
        try:
            ex, info = build(model_dir, mode, "disabled", prof)
        except (ConfigError, NotImplementedError) as exc:
            result["startup"].append({"decode_mode": mode, "error": str(exc)})
            continue
        result["startup"].append(info)
        attention = parse_mode(mode)[2]
        for ctx in prof["contexts"]:
            for bs in prof["batches"]:
                floor_ms = (wbytes + bs * ctx * kv_per_tok) / (bw * 1e9) * 1e3
                if attention not in eager_done:
                    row = measure_decode(ex, bs, ctx, prof["steps"], use_graph=False)
                    result["decode_table"].append({**row, "mode": eager_label(attention),
                                                   "floor_ms": floor_ms})
                if mode == CPU_MODE:
                    continue
                row = measure_decode(ex, bs, ctx, prof["steps"], use_graph=True)
                result["decode_table"].append({**row, "mode": mode, "floor_ms": floor_ms})
                print(f"decode {mode} bs={bs} ctx={ctx}: {row}", flush=True)
        eager_done.add(attention)
        if i == 0 and torch.cuda.is_available():
            result["kernel_profile"] = decode_kernels(ex, 1, prof["contexts"][0])
        del ex
        hardware.release_memory()
        save()

    # -- prefill: eager vs each graph mode -----------------------------------------------
    prefill_eager_done: set[str] = set()
    # A fresh artifact cache: the first tc_piecewise start-up compiles (cold), a restart of
    # the same configuration loads (warm); both go in the start-up table.
    compile_cache = args.models / f"compile-cache-{os.getpid()}"
    for mode in prof["prefill_modes"]:
        try:
            ex, info = build(model_dir, "disabled", mode, prof, compile_cache)
        except (ConfigError, NotImplementedError) as exc:
            result["startup"].append({"prefill_mode": mode, "error": str(exc)})
            continue
        if parse_mode(mode)[1] == "inductor":
            info["start"] = "cold"
        result["startup"].append(info)
        attention = parse_mode(mode)[2]
        for seqs in prof["prefill_seqs"]:
            for n in prof["prefill_tokens"]:
                if n < seqs:
                    continue
                flops_ms = 2 * spec.num_params() * n / (flops * 1e12) * 1e3
                floor_ms = max(flops_ms, wbytes / (bw * 1e9) * 1e3)
                if attention not in prefill_eager_done:
                    runners = dict(ex.runners)
                    ex.runners.clear()
                    row = measure_prefill(ex, n, seqs, prof["repeats"])
                    ex.runners.update(runners)
                    result["prefill_table"].append({**row, "mode": eager_label(attention),
                                                    "floor_ms": floor_ms})
                if mode == CPU_MODE:
                    continue
                row = measure_prefill(ex, n, seqs, prof["repeats"])
                result["prefill_table"].append({**row, "mode": mode, "floor_ms": floor_ms})
                print(f"prefill {mode} tokens={n} seqs={seqs}: {row}", flush=True)
        prefill_eager_done.add(attention)
        del ex
        hardware.release_memory()
        if parse_mode(mode)[1] == "inductor":  # the restart: warm start-up only
            ex, info = build(model_dir, "disabled", mode, prof, compile_cache)
            result["startup"].append({**info, "start": "warm"})
            del ex
            hardware.release_memory()
        save()

    # -- the 8B shape: decode -----------------------------------------------------------
    if prof.get("big_shape"):
        big_dir = shapes.write_shape(prof["big_shape"], args.models)
        result["decode_8b_table"] = decode_big_shape(prof, big_dir, bw)
        save()
        if not args.no_peer:  # the peer on the same 8B weights: decode only
            result["peer_8b"] = peer.measure(big_dir, 512, [], prof["peer_compile"])
            print(f"peer 8b: {result['peer_8b']}", flush=True)
            save()

    # -- the peer ------------------------------------------------------------------------
    if not args.no_peer:
        result["peer"] = peer.measure(model_dir, prof["contexts"][0],
                                      prof.get("peer_prefill", [128, 2048]),
                                      prof["peer_compile"])
        print(f"peer: {result['peer']}", flush=True)
    save()
    result["plots"] = [p.name for p in write_plots(result, args.out)]
    save()
    md = markdown(result)
    (args.out / "bench.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
