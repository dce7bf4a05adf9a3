"""The FP8 GEMM paths against bf16, per projection of a shape and token count.

``python -m bench.kernels.fp8_gemm --shape llama-3.1-8b --tokens 1 --tokens 64`` on an FP8
GPU. For each projection (qkv, o, gate_up, down) and ``M``: bf16 ``F.linear`` (cuBLAS) and,
at one row, our bf16 skinny GEMM; FP8 ``w8a16`` with row scales and with 128x128 block
scales (``executor.quant.launch``); the activation quantization plus ``torch._scaled_mm``
row-wise and per-tensor (what ``gemm.prepare`` runs above ``SKINNY_MAX_ROWS`` rows). Each
time is one CUDA-graph replay over weight copies that exceed L2, divided by the copies
(``bench.common.timing``), beside the FP8 and bf16 weight-read floors at the read bandwidth
measured in the run. The numbers say where ``SKINNY_MAX_ROWS`` and the tiles should sit.
Prints a table; ``--out`` also writes ``fp8_gemm.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import hardware, shapes
from bench.common.timing import weight_copies, weights_replay_us


def _paths(m: int, k: int, n: int) -> dict[str, tuple[Callable[[torch.Tensor], object], bool]]:
    """name -> (fn of one weight copy, whether it takes the FP8 copies)."""
    from executor.kernels.skinny import skinny_gemm
    from executor.quant import launch
    from executor.quant.fp8 import FP8_MAX

    dev = torch.device("cuda")
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    rows = torch.full((n,), 1 / FP8_MAX, device=dev)
    blocks = torch.full((-(-n // 128), -(-k // 128)), 1 / FP8_MAX, device=dev)
    one = torch.ones(1, device=dev)
    out: dict[str, tuple[Callable[[torch.Tensor], object], bool]] = {
        "bf16 cuBLAS": (lambda w: F.linear(x, w), False),
        "fp8 w8a16 rows": (lambda w: launch.w8a16(x, w, rows, None), True),
        "fp8 w8a16 blocks": (lambda w: launch.w8a16(x, w, blocks, (128, 128)), True),
    }
    if m == 1:
        out["bf16 skinny"] = (lambda w: skinny_gemm(x, w), False)
    if k % 16 == 0 and n % 16 == 0:
        def rowwise(w: torch.Tensor) -> object:
            q, s = launch.act_quant(x, None)
            return torch._scaled_mm(q, w.t(), scale_a=s, scale_b=rows.view(1, -1),
                                    out_dtype=torch.bfloat16)

        def per_tensor(w: torch.Tensor) -> object:
            q, _ = launch.act_quant(x, one)
            return torch._scaled_mm(q, w.t(), scale_a=one, scale_b=one,
                                    out_dtype=torch.bfloat16)

        out["fp8 scaled_mm rowwise"] = (rowwise, True)
        out["fp8 scaled_mm per-tensor"] = (per_tensor, True)
    return out


def measure(spec: Any, tokens: list[int]) -> list[dict[str, Any]]:
    dev = torch.device("cuda")
    bw = hardware.read_bandwidth_gbs() * 1e9
    rows = []
    for name, (k, n) in shapes.projections(spec).items():
        if name == "lm_head":
            continue
        bf16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
                for _ in range(weight_copies(k, n))]
        fp8 = [(torch.randn(n, k, device=dev) * 64).to(torch.float8_e4m3fn)
               for _ in range(weight_copies(k, n, 1))]
        for m in tokens:
            row: dict[str, Any] = {"proj": name, "k": k, "n": n, "m": m,
                                   "floor_bf16_us": 2 * k * n / bw * 1e6,
                                   "floor_fp8_us": k * n / bw * 1e6}
            for label, (fn, takes_fp8) in _paths(m, k, n).items():
                row[label] = weights_replay_us(fn, fp8 if takes_fp8 else bf16)
            rows.append(row)
            print(json.dumps({k2: round(v, 2) if isinstance(v, float) else v
                              for k2, v in row.items()}), flush=True)
        del bf16, fp8
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    labels = [k for k in rows[0] if k.startswith(("bf16", "fp8"))]
    labels += sorted({k for r in rows for k in r if k.startswith(("bf16", "fp8"))} - set(labels))
    head = "| proj | M | fp8 floor µs | bf16 floor µs | " + " | ".join(labels) + " |"
    lines = [head, "|" + "---|" * (4 + len(labels))]
    for r in rows:
        cells = [f"{r[label]:.1f}" if label in r else "" for label in labels]
        lines.append(f"| {r['proj']} ({r['k']}->{r['n']}) | {r['m']} | "
                     f"{r['floor_fp8_us']:.1f} | {r['floor_bf16_us']:.1f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--tokens", type=int, action="append")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = measure(shapes.spec(args.shape), args.tokens or [1, 8, 64, 2048])
    print(table(rows))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8_gemm.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
