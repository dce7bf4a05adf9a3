"""The linear layers of a model shape at a few token counts: which GEMM library is fastest.

``python -m bench.kernels.gemm --shape llama-3.2-1b --tokens 128 --tokens 1 [--autotune]``
on a CUDA machine. For each projection (qkv, o, gate_up, down, lm_head) and token count ``M``:
the time of ``F.linear`` with cuBLAS and with cuBLASLt (``preferred_blas_library``), of
``torch.mm`` on the weight stored transposed (``cublas_nn``), and
with ``--autotune`` the kernel Inductor's max-autotune picks (Triton templates or ATen)
for that static shape. Each time is one CUDA-graph replay of the GEMM over several weight
copies whose sum exceeds the L2 cache, divided by the copies: every call reads its weight
from HBM, as in a forward. Also the weight-read floor at the measured read bandwidth and
the tensor-core floor at the measured dense bf16 rate. Prints a table; ``--out`` also
writes ``gemm.json``.
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

from bench.common import hardware, shapes
from bench.common.shapes import projections
from bench.common.timing import weight_copies, weights_replay_us


def measure(spec: Any, tokens: list[int], autotune: bool) -> list[dict[str, Any]]:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    bw = hardware.read_bandwidth_gbs() * 1e9
    tflops = hardware.matmul_tflops() * 1e12
    rows = []
    for name, (k, n) in projections(spec).items():
        copies = weight_copies(k, n)
        weights = [torch.randn(n, k, device=dev, dtype=dtype) / k**0.5 for _ in range(copies)]
        transposed = [w.t().contiguous() for w in weights]
        for m in tokens:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            row: dict[str, Any] = {
                "proj": name, "M": m, "K": k, "N": n,
                "floor_us": max(k * n * 2 / bw, 2 * m * k * n / tflops) * 1e6,
            }
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                row[f"{lib}_us"] = weights_replay_us(functools.partial(F.linear, x), weights)
            torch.backends.cuda.preferred_blas_library("cublas")
            # The same product with the weight stored (K, N) row-major: another cuBLAS
            # layout (NN instead of TN), so another kernel choice.
            row["cublas_nn_us"] = weights_replay_us(functools.partial(torch.mm, x), transposed)
            if autotune:
                torch._dynamo.reset()
                compiled = torch.compile(F.linear, mode="max-autotune-no-cudagraphs",
                                         dynamic=False)
                row["autotune_us"] = weights_replay_us(functools.partial(compiled, x), weights)
            rows.append(row)
            print(_line(row), flush=True)
        del weights, transposed
    return rows


def _line(row: dict[str, Any]) -> str:
    libs = "  ".join(f"{key[:-3]} {row[key]:7.1f}" for key in row
                     if key.endswith("_us") and key != "floor_us")
    return (f"{row['proj']:8} M={row['M']:<5} K={row['K']:<6} N={row['N']:<6} "
            f"floor {row['floor_us']:6.1f} us  {libs}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(shapes.SHAPES))
    ap.add_argument("--tokens", type=int, action="append", help="M (repeatable); 128, 1")
    ap.add_argument("--autotune", action="store_true", help="also Inductor max-autotune")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.kernels.gemm needs a CUDA device", file=sys.stderr)
        return 2
    rows = measure(shapes.spec(args.shape), args.tokens or [128, 1], args.autotune)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "shape": args.shape}
        (args.out / "gemm.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
