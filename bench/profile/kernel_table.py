"""Per-kernel-class GPU time of graph steps beside the floor.

For each case (graph decode at a batch size, breakable-graph prefill of one sequence) on a
random-weight bench shape, each of ``--steps`` executor calls is profiled on its own
(torch profiler), its kernels grouped into classes (``bench.profile.kernel_classes``), and
the medians reported in µs per step with the bytes each class must move and the bandwidth
achieved, beside the floor measured in the same run (``bench.common.hardware``).

    python -m bench.profile.kernel_table --model llama-3.2-1b --out DIR [--label after]
    python -m bench.profile.kernel_table --compare before.json after.json > table.md

Writes ``kernel_table-<model>-<label>.json`` and ``.md`` to ``--out`` (default
``results-local``); ``--compare`` prints the after table with the before µs beside each class.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import switches as bench_switches
from bench.common.meta import git_commit
from bench.profile.kernel_classes import (
    Kernel,
    class_bytes,
    classify,
    floor_ms,
    markdown_case,
    step_table,
)

DEFAULT_CASES = ("decode:1", "decode:8", "decode:64", "prefill:128", "prefill:2048")


def _executor(source: str, attention: str, switches: dict[str, str],
              load_format: str = "safetensors", prefill_graph: str = "breakable",
              quantization: str | None = None) -> Any:
    from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
    from executor.executor import Executor

    # (``load_format`` only where it is not the default: a base tree older than the
    # option, which ``kernel_check.sh`` may measure for "before" tables, knows no such field)
    extra: dict[str, Any] = {} if load_format == "safetensors" else {"load_format": load_format}
    if quantization is not None:
        extra["quantization"] = quantization
    return Executor(ExecutorConfig(
        model=ModelConfig(source=source, dtype="bfloat16", **extra),  # type: ignore[arg-type]
        device="cuda",
        cache=CacheConfig(kv_tokens=96 * 1024, max_sequences=80, max_context=4096),
        graphs=GraphConfig(decode_mode="full", prefill_mode=prefill_graph,
                           decode_buckets=(1, 8, 64), prefill_buckets=(128, 2048)),
        attention_backend=attention, max_decode_batch=64, max_prefill_tokens=8192,
        **switches))


def profile_step(step: Callable[[], None]) -> list[Kernel]:
    """The device kernels (and copies) of one call, sorted by start."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sorted((Kernel(e.name, e.time_range.start, e.time_range.end)
                   for e in prof.events() if e.device_type == DeviceType.CUDA),
                  key=lambda k: k.start_us)


def case_step(ex: Any, phase: str, size: int, context: int, tag: str) -> Callable[[], None]:
    """A callable running one step of the case: decode keeps ``size`` sequences of about
    ``context`` tokens going; prefill admits one ``size``-token sequence and releases it."""
    import torch

    from executor.api import DecodeItem, PrefillItem

    vocab = ex.model_info.vocab_size
    gen = torch.Generator().manual_seed(size)
    if phase == "prefill":
        ids = torch.randint(0, vocab, (size,), generator=gen).tolist()
        count = [0]

        def prefill() -> None:
            count[0] += 1
            seq = f"{tag}p{count[0]}"
            ex.prefill([PrefillItem(seq, ids)])
            ex.release([seq])

        return prefill
    toks: dict[str, int] = {}
    per_call = max(1, 8192 // context)
    for start in range(0, size, per_call):
        items = [PrefillItem(f"{tag}s{i}", torch.randint(0, vocab, (context - 16,),
                                                         generator=gen).tolist())
                 for i in range(start, min(size, start + per_call))]
        toks.update({o.seq_id: int(o.token_id) for o in ex.prefill(items).outputs})

    def decode() -> None:
        out = ex.decode([DecodeItem(s, t) for s, t in toks.items()])
        toks.update({o.seq_id: int(o.token_id) for o in out.outputs})

    return decode


def measure(model: str, models_root: Path, cases: list[str], steps: int, context: int,
            attention: str, switches: dict[str, str] | None = None,
            load_format: str = "safetensors", prefill_graph: str = "breakable"
            ) -> dict[str, Any]:
    import torch

    from bench.common import hardware, shapes

    bw = hardware.read_bandwidth_gbs()
    tflops = hardware.matmul_tflops()
    path, spec = shapes.model(model, models_root, load_format)
    source = str(path)
    wbytes = shapes.weight_bytes(model)
    ex = _executor(source, attention, switches or {}, load_format, prefill_graph)
    ex.capture(["decode", "prefill"])
    result: dict[str, Any] = {
        "model": model, "device": torch.cuda.get_device_name(),
        "commit": git_commit(),
        "torch": torch.__version__, "read_bandwidth_gbs": bw, "matmul_tflops": tflops,
        "attention": ex.model_info.attention_backend, "prefill_graph": prefill_graph,
        "context": context, "steps": steps,
        "cases": {}}
    for n_case, case in enumerate(cases):
        phase, size_s = case.split(":")
        size = int(size_s)
        step = case_step(ex, phase, size, context, f"c{n_case}")
        for _ in range(10):  # warm: graphs replayed, kernels loaded
            step()
        profiles = [profile_step(step) for _ in range(steps)]
        tables = [step_table(kernels, spec.num_layers) for kernels in profiles]
        classes: dict[str, dict[str, float]] = {}
        names = sorted({c for t in tables for c in t})
        nbytes = class_bytes(spec, phase, size, context if phase == "decode" else 0,
                             size if phase == "decode" else 1)
        for cls in names:
            row = {"us": statistics.median(t.get(cls, {"us": 0.0})["us"] for t in tables),
                   "n": statistics.median(t.get(cls, {"n": 0.0})["n"] for t in tables)}
            if cls in nbytes:
                row["bytes"] = nbytes[cls]
            classes[cls] = row
        busy = sum(r["us"] for c, r in classes.items() if c not in ("idle", "wait"))
        floor, bound = floor_ms(spec, phase, size, context, bw, tflops, wbytes)
        spans = [sum(r["us"] for r in t.values()) for t in tables]
        result["cases"][case] = {
            "phase": phase, "size": size, "floor_ms": floor, "floor_by": bound,
            "span_ms": statistics.median(spans) / 1e3, "busy_ms": busy / 1e3,
            "idle_ms": classes.get("idle", {"us": 0.0})["us"] / 1e3,
            "kernels_per_step": sum(r["n"] for c, r in classes.items()
                                    if c not in ("idle", "wait")),
            "classes": classes, "small_kernels": small_kernels(profiles[-1], spec.num_layers)}
        c = result["cases"][case]
        gpu_ms = c["busy_ms"] + c["idle_ms"]
        print(f"{case}: kernels + idle {gpu_ms:.3f} ms, floor {floor:.3f} ms ({bound}), "
              f"{gpu_ms / floor:.2f}x, {c['kernels_per_step']:.0f} kernels, call span "
              f"{c['span_ms']:.3f} ms", flush=True)
    return result


#: Classes whose kernels the JSON lists by name (``small_kernels``): what is neither a
#: projection nor attention, so a reader can tell which launch an ``other`` row holds.
NAMED_CLASSES = ("norm", "rope", "silu", "other", "copy")


def small_kernels(kernels: list[Kernel], num_layers: int) -> list[dict[str, Any]]:
    """One step's kernels of ``NAMED_CLASSES`` in launch order: class, name, microseconds."""
    return [{"class": cls, "name": k.name[:160], "us": round(k.us, 2)}
            for k, cls in zip(kernels, classify(kernels, num_layers), strict=True)
            if cls in NAMED_CLASSES]


def markdown(result: dict[str, Any], before: dict[str, Any] | None = None) -> str:
    lines = [f"# Kernel table: {result['model']} on {result['device']} at {result['commit']}",
             "", f"Read bandwidth {result['read_bandwidth_gbs']:.0f} GB/s, bf16 matmul "
             f"{result['matmul_tflops']:.0f} TFLOP/s (measured in the run); attention "
             f"{result['attention']}; prefill graphs "
             f"{result.get('prefill_graph', 'breakable')}; decode context "
             f"{result['context']}; medians of "
             f"{result['steps']} profiled steps."
             + (f" Before: {before['commit']} (same machine, bandwidth "
                f"{before['read_bandwidth_gbs']:.0f} GB/s)." if before else ""), ""]
    for name, case in result["cases"].items():
        old = before["cases"].get(name) if before else None
        lines.append(markdown_case(name, case, old))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--case", action="append", help="decode:BATCH or prefill:TOKENS")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--models", type=Path, default=Path("/tmp/model-executor-bench"))
    ap.add_argument("--out", type=Path, default=Path("results-local"))
    ap.add_argument("--label", default="run")
    ap.add_argument("--load-format", choices=("safetensors", "random"), default="safetensors",
                    help="random: write only the shape's config.json and draw the weights "
                    "on the GPU (no minutes spent writing the 8B shape)")
    ap.add_argument("--prefill-graph", choices=("breakable", "fixed_grid", "tc_piecewise"),
                    default="breakable", help="prefill graph mode (default: %(default)s)")
    bench_switches.add_arguments(ap)
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args(argv)
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        print(markdown(after, before))
        return 0
    result = measure(args.model, args.models, args.case or list(DEFAULT_CASES), args.steps,
                     args.context, args.attention, bench_switches.overrides(args),
                     args.load_format, args.prefill_graph)
    text = markdown(result)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"kernel_table-{args.model}-{args.label}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
