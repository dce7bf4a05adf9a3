"""How close is a mixture-of-experts model to its floors? Decode at batch 1 against its
active-weight floor, decode at batch 64 against the floor of the experts it touched, and
a 2048-token prefill against its FLOPs floor, on random weights (bf16, one GPU).

    python -m bench.e2e.moe [--model qwen3-30b-a3b] [--cases decode:1,decode:64,prefill:2048]
                            [--quantization fp8]

The model is a catalog shape served with ``--load-format random`` (no checkpoint). Each
case's steps are profiled as ``bench.profile.kernel_table`` does (graph steps, kernels +
idle on the GPU). Floors use the read bandwidth and matmul rate measured in the same run
(``bench.common.hardware``): decode reads the attention, norms, routers and LM head plus,
per sparse layer, the experts its tokens were routed to (``top_k`` at batch 1; at larger
batches the distinct experts counted on an eager probe of the same batch), and each
sequence's KV. Prints a summary table; writes ``moe-<model>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import hardware
from bench.common.meta import git_commit
from bench.common.shapes import moe_step_weight_bytes
from bench.profile.kernel_classes import floor_ms, median_classes, step_table
from bench.profile.kernel_table import _executor, case_step, profile_step


def experts_touched(ex: Any, step: Callable[[], None]) -> list[int]:
    """Distinct experts each sparse layer routes one ``step``'s tokens to, counted on an
    eager run of that step (a graph replay runs no Python, so the routing is recorded on
    the eager path: every graph-or-eager decision answers eager meanwhile)."""
    from executor.api import FallbackReason
    from executor.graphs.dispatch import Decision
    from executor.kernels.moe import decode
    from executor.kernels.moe import route as routing

    counts: list[int] = []
    route, routed, decide = routing.route_align, decode.routed, ex.forward.decide

    def counting(logits: Any, *args: Any) -> Any:
        weights, ids, aligned = route(logits, *args)
        counts.append(int(ids.unique().numel()))
        return weights, ids, aligned

    def counting_decode(*args: Any, **kwargs: Any) -> Any:  # (routing inside its kernels)
        out, weights, ids = routed(*args, **kwargs)
        counts.append(int(ids.unique().numel()))
        return out, weights, ids

    routing.route_align = counting  # type: ignore[assignment]
    decode.routed = counting_decode  # type: ignore[assignment]
    ex.forward.decide = lambda phase, size: Decision(None, FallbackReason.DISABLED)
    try:
        step()
    finally:
        routing.route_align = route  # type: ignore[assignment]
        decode.routed = routed  # type: ignore[assignment]
        ex.forward.decide = decide
    return counts


def measure(model: str, cases: list[str], steps: int, context: int,
            quantization: str | None = None) -> dict[str, Any]:
    import torch

    bw, tflops = hardware.read_bandwidth_gbs(), hardware.matmul_tflops()
    ex = _executor(model, "triton", {}, "random", "breakable", quantization)
    ex.capture(["decode", "prefill"])
    spec = ex.spec
    assert spec.moe is not None, f"{model} is not a mixture of experts"
    sparse = sum(spec.moe.sparse(i) for i in range(spec.num_layers))
    out: dict[str, Any] = {"model": model, "device": torch.cuda.get_device_name(),
                           "commit": git_commit(), "read_bandwidth_gbs": bw,
                           "matmul_tflops": tflops, "context": context,
                           "quantization": quantization or "", "cases": {}}
    for n, case in enumerate(cases):
        phase, size = case.split(":")[0], int(case.split(":")[1])
        step = case_step(ex, phase, size, context, f"m{n}")
        for _ in range(10):
            step()
        tables = [step_table(profile_step(step), spec.num_layers) for _ in range(steps)]
        gpu_ms = statistics.median(sum(r["us"] for c, r in t.items() if c != "wait")
                                   for t in tables) / 1e3
        moe_ms = statistics.median(t.get("moe", {"us": 0.0})["us"] for t in tables) / 1e3
        # one token reads exactly top_k experts per layer; a batch, those it touched
        touched = [spec.moe.top_k] * sparse if phase == "decode" and size == 1 \
            else experts_touched(ex, step)
        wbytes = moe_step_weight_bytes(spec, touched, fp8=quantization is not None)
        floor, bound = floor_ms(spec, phase, size, context if phase == "decode" else 0, bw,
                                tflops, wbytes)
        out["cases"][case] = {"gpu_ms": gpu_ms, "moe_kernels_ms": moe_ms, "floor_ms": floor,
                              "floor_by": bound, "weight_bytes": wbytes,
                              "experts_touched_mean": statistics.mean(touched),
                              "ratio": gpu_ms / floor, "classes_us": median_classes(tables)}
    return out


def table(result: dict[str, Any]) -> str:
    fmt = f" {result['quantization']}" if result.get("quantization") else ""
    lines = [f"{result['model']}{fmt} on {result['device']} (commit {result['commit']}): read "
             f"{result['read_bandwidth_gbs']:.0f} GB/s, matmul {result['matmul_tflops']:.0f} "
             f"TFLOP/s, decode context {result['context']}",
             "| case | kernels + idle ms | fused MoE ms | floor ms (by) | x floor "
             "| experts/layer |",
             "|---|---:|---:|---:|---:|---:|"]
    for case, c in result["cases"].items():
        lines.append(f"| {case} | {c['gpu_ms']:.3f} | {c['moe_kernels_ms']:.3f} | "
                     f"{c['floor_ms']:.3f} ({c['floor_by']}) | {c['ratio']:.2f} | "
                     f"{c['experts_touched_mean']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b", help="a catalog random shape")
    ap.add_argument("--cases", default="decode:1,decode:64,prefill:2048")
    ap.add_argument("--steps", type=int, default=20, help="profiled steps per case")
    ap.add_argument("--context", type=int, default=512, help="decode context per sequence")
    ap.add_argument("--quantization", choices=("fp8",),
                    help="serve the random weights quantized at load (FP8 experts too)")
    ap.add_argument("--out", type=Path, default=Path("results-local"))
    args = ap.parse_args(argv)
    result = measure(args.model, args.cases.split(","), args.steps, args.context,
                     args.quantization)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"-{args.quantization}" if args.quantization else ""
    (args.out / f"moe-{args.model}{tag}.json").write_text(json.dumps(result, indent=2))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
