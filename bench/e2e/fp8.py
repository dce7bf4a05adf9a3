"""FP8 against bf16 on one shape, in one process: decode and prefill steps, their ratio,
and each FP8 step over the FP8 floor.

The shape's random bf16 weights are drawn on the GPU (``--load-format random``) and served
twice: as they are, then with ``--quantization fp8`` (e4m3 per output channel). Each case
(``decode:1``, ``decode:64``, ``prefill:2048`` by default) is profiled as
``bench.profile.kernel_table`` does it (kernels + short gaps of graph steps, medians).
Floors: the bytes a step must read at the read bandwidth measured in the same run, the
projections counted at 1 byte per weight for FP8; prefill also its FLOPs at the measured
bf16 (attention, LM head) and FP8 (projections) matmul rates.

    python -m bench.e2e.fp8 --model llama-3.1-8b [--case decode:1 ...] [--out DIR]

Prints the table and writes ``fp8-<model>.json`` and ``.md`` to ``--out``. The kernel
switches (``bench.common.switches``: ``--fp8-glu off`` and the like) apply to both runs, so
two runs with one switch flipped A/B it (give each its own ``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.common import hardware, shapes
from bench.common import switches as bench_switches
from bench.common.meta import git_commit
from bench.profile.kernel_classes import median_classes, step_table
from bench.profile.kernel_table import case_step, profile_step

DEFAULT_CASES = ("decode:1", "decode:64", "prefill:2048")
#: The issue's targets: FP8 step / bf16 step at most this.
TARGETS = {"decode:1": 0.63, "decode:64": 0.80, "prefill:2048": 0.75}


def fp8_matmul_tflops(n: int = 8192) -> float:
    """``torch._scaled_mm`` e4m3 x e4m3 -> bf16 with per-tensor scales (TFLOP/s)."""
    import torch

    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    ms = hardware.time_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one,
                                                   out_dtype=torch.bfloat16), repeats=10)
    return 2 * n**3 / (ms / 1e3) / 1e12


def projection_params(spec: Any) -> int:
    """Weights of every decoder projection (what FP8 stores in one byte)."""
    per_layer = sum(k * n for name, (k, n) in shapes.projections(spec).items()
                    if name != "lm_head")
    return spec.num_layers * per_layer


def floors(spec: Any, phase: str, size: int, context: int, bw: float, bf16_tflops: float,
           fp8_tflops: float, fp8: bool) -> float:
    """The step's floor in ms: bytes read (weights, decode's KV) at ``bw``; prefill the
    larger of that and its FLOPs (projections at the FP8 rate when ``fp8``)."""
    wbytes = shapes.spec_weight_bytes(spec) - (projection_params(spec) if fp8 else 0)
    kv_bytes = 2 * spec.kv_size * 2 * spec.num_layers  # K and V, bf16, per token
    read = wbytes + (size * context * kv_bytes if phase == "decode" else 0)
    read_ms = read / (bw * 1e9) * 1e3
    if phase == "decode":
        return read_ms
    proj = 2 * projection_params(spec) * size
    rest = 2 * (spec.num_params() - projection_params(spec)) * size
    flops_ms = (proj / ((fp8_tflops if fp8 else bf16_tflops) * 1e12)
                + rest / (bf16_tflops * 1e12)) * 1e3
    return max(read_ms, flops_ms)


def _executor(source: str, quantization: str | None, attention: str,
              switches: dict[str, str]) -> Any:
    from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
    from executor.executor import Executor

    return Executor(ExecutorConfig(
        model=ModelConfig(source=source, dtype="bfloat16", load_format="random",
                          quantization=quantization),  # type: ignore[arg-type]
        device="cuda",
        cache=CacheConfig(kv_tokens=96 * 1024, max_sequences=80, max_context=4096),
        graphs=GraphConfig(decode_mode="full", prefill_mode="breakable",
                           decode_buckets=(1, 8, 64), prefill_buckets=(128, 2048)),
        attention_backend=attention, max_decode_batch=64, max_prefill_tokens=8192,
        **switches))  # type: ignore[arg-type]


def measure(model: str, root: Path, cases: list[str], steps: int, context: int,
            attention: str, switches: dict[str, str] | None = None) -> dict[str, Any]:
    import torch

    bw, tflops, fp8_tflops = (hardware.read_bandwidth_gbs(), hardware.matmul_tflops(),
                              fp8_matmul_tflops())
    path, spec = shapes.model(model, root, "random")
    result: dict[str, Any] = {
        "model": model, "device": torch.cuda.get_device_name(), "commit": git_commit(),
        "torch": torch.__version__, "read_bandwidth_gbs": bw, "matmul_tflops": tflops,
        "fp8_matmul_tflops": fp8_tflops, "context": context, "steps": steps,
        "switches": switches or {}, "runs": {}}
    for label, quantization in (("bf16", None), ("fp8", "fp8")):
        ex = _executor(str(path), quantization, attention, switches or {})
        info = ex.model_info
        run: dict[str, Any] = {"weight_format": info.weight_format,
                               "quantization": info.quantization,
                               "kernel_features": list(info.kernel_features),
                               "rank_memory_bytes": list(info.rank_memory_bytes), "cases": {}}
        ex.capture(["decode", "prefill"])
        for n_case, case in enumerate(cases):
            phase, size_s = case.split(":")
            step = case_step(ex, phase, int(size_s), context, f"{label}{n_case}")
            for _ in range(10):
                step()
            tables = [step_table(profile_step(step), spec.num_layers) for _ in range(steps)]
            gpu = [sum(r["us"] for c, r in t.items() if c != "wait") / 1e3 for t in tables]
            floor = floors(spec, phase, int(size_s), context, bw, tflops, fp8_tflops,
                           quantization is not None)
            run["cases"][case] = {"gpu_ms": statistics.median(gpu), "floor_ms": floor,
                                  "classes_us": median_classes(tables)}
            print(f"{label} {case}: {statistics.median(gpu):.3f} ms (floor {floor:.3f} ms)",
                  flush=True)
        result["runs"][label] = run
        ex.close()
        del ex
        hardware.release_memory()
    return result


def markdown(result: dict[str, Any]) -> str:
    bf16, fp8 = result["runs"]["bf16"], result["runs"]["fp8"]
    lines = [f"# FP8 against bf16: {shapes.title(result['model'])} on {result['device']} at "
             f"{result['commit']}", "",
             f"Read bandwidth {result['read_bandwidth_gbs']:.0f} GB/s, bf16 matmul "
             f"{result['matmul_tflops']:.0f} TFLOP/s, FP8 {result['fp8_matmul_tflops']:.0f} "
             f"TFLOP/s (measured in the run); kernels + idle of graph steps, medians of "
             f"{result['steps']}; decode context {result['context']}. FP8: "
             f"{fp8['quantization']} ({fp8['weight_format']}); kernel features: "
             f"{', '.join(fp8.get('kernel_features', [])) or 'none'}.", "",
             "| case | bf16 ms | FP8 ms | FP8 / bf16 | target | FP8 floor ms | FP8 / its floor "
             "| bf16 / its floor |", "|---|---|---|---|---|---|---|---|"]
    for case, f in fp8["cases"].items():
        b = bf16["cases"][case]
        ratio = f["gpu_ms"] / b["gpu_ms"]
        target = TARGETS.get(case)
        mark = "" if target is None else f"<= {target} {'met' if ratio <= target else 'MISSED'}"
        lines.append(f"| {case} | {b['gpu_ms']:.3f} | {f['gpu_ms']:.3f} | {ratio:.3f} | {mark} "
                     f"| {f['floor_ms']:.3f} | {f['gpu_ms'] / f['floor_ms']:.2f}x "
                     f"| {b['gpu_ms'] / b['floor_ms']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--case", action="append", help="decode:BATCH or prefill:TOKENS")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--models", type=Path, default=Path("/tmp/model-executor-bench"))
    ap.add_argument("--out", type=Path, default=Path("results-local"))
    bench_switches.add_arguments(ap)
    args = ap.parse_args(argv)
    result = measure(args.model, args.models, args.case or list(DEFAULT_CASES), args.steps,
                     args.context, args.attention, bench_switches.overrides(args))
    text = markdown(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"fp8-{args.model}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"fp8-{args.model}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
