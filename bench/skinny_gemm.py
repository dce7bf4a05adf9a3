"""The skinny GEMM (``executor.kernels.skinny_gemm``) against cuBLAS at decode batch sizes.

``python -m bench.skinny_gemm --shape llama-3.2-1b [--sweep] [--out DIR]`` on a CUDA
machine. For each layer projection (qkv, o, gate_up, down) and ``M`` rows up to
``MAX_ROWS``: cuBLAS (``F.linear``) and the skinny kernel with its default tile; for the
down projection also SiLU-and-mul then cuBLAS against the fused skinny launch. With
``--sweep``, at ``M = 1`` every tile of a small grid, and the best. Times are CUDA-graph
replays over weight copies that exceed the L2 cache (``bench.gemm.replay_us``), so each
call reads its weight from HBM; the weight-read floor uses the bandwidth measured here.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench import hardware, shapes
from bench.gemm import _L2_BYTES, projections, replay_us

SWEEP = [(bn, bk, w) for bn in (2, 4, 8, 16, 32) for bk in (256, 512, 1024, 2048, 4096)
         for w in (4, 8) if 2048 <= bn * bk <= 16384]


def measure(spec: Any, sweep: bool) -> list[dict[str, Any]]:
    from executor.kernels.activation import silu_and_mul
    from executor.kernels.skinny_gemm import MAX_ROWS, Tile, default_tile, skinny_gemm

    dev, dtype = torch.device("cuda"), torch.bfloat16
    bw = hardware.read_bandwidth_gbs() * 1e9
    rows = []
    for name, (k, n) in projections(spec).items():
        if name == "lm_head":
            continue
        copies = max(2, -(-_L2_BYTES // (k * n * 2)) + 1)
        weights = [torch.randn(n, k, device=dev, dtype=dtype) / k**0.5 for _ in range(copies)]
        for m in range(1, MAX_ROWS + 1):
            x = torch.randn(m, k, device=dev, dtype=dtype)
            tile = default_tile(m, n, k)
            row: dict[str, Any] = {"proj": name, "M": m, "K": k, "N": n,
                                   "floor_us": k * n * 2 / bw * 1e6,
                                   "cublas_us": replay_us(functools.partial(F.linear, x), weights),
                                   "skinny_us": replay_us(functools.partial(skinny_gemm, x),
                                                          weights),
                                   "tile": [tile.block_n, tile.block_k, tile.num_warps]}
            if name == "down":
                gate_up = torch.randn(m, 2 * k, device=dev, dtype=dtype)
                row["silu_cublas_us"] = replay_us(
                    lambda w, g=gate_up: F.linear(silu_and_mul(g), w), weights)
                row["silu_skinny_us"] = replay_us(
                    lambda w, g=gate_up: skinny_gemm(g, w, silu_mul=True), weights)
            if sweep and m == 1:
                best = None
                for bn, bk, warps in SWEEP:
                    us = replay_us(functools.partial(skinny_gemm, x, tile=Tile(bn, bk, warps)),
                                   weights)
                    if best is None or us < best[0]:
                        best = (us, [bn, bk, warps])
                assert best is not None
                row["sweep_best_us"], row["sweep_best_tile"] = best
            rows.append(row)
            print(_line(row), flush=True)
        del weights
    return rows


def _line(row: dict[str, Any]) -> str:
    times = "  ".join(f"{key[:-3]} {row[key]:6.1f}" for key in row
                      if key.endswith("_us") and key != "floor_us")
    extra = f" best tile {row['sweep_best_tile']}" if "sweep_best_tile" in row else ""
    return (f"{row['proj']:8} M={row['M']:<2} K={row['K']:<6} N={row['N']:<6} "
            f"floor {row['floor_us']:6.1f} us  {times}  tile {row['tile']}{extra}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(shapes.SHAPES))
    ap.add_argument("--sweep", action="store_true", help="also a tile sweep at M = 1")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.skinny_gemm needs a CUDA device", file=sys.stderr)
        return 2
    rows = measure(shapes.spec(args.shape), args.sweep)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "shape": args.shape}
        (args.out / f"skinny_gemm-{args.shape}.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
