"""The skinny GEMM (``executor.kernels.skinny``) against what it replaces, at M = 1, and
the tuner of its tiles.

``python -m bench.kernels.skinny_gemm --shape llama-3.2-1b [--tp N] [--sweep] [--tiles-out
FILE]`` on a CUDA machine (``--tp N``: one of N tensor-parallel ranks' projections). For
each layer projection with the input prologue the model uses (qkv and gate_up:
residual-add + RMSNorm; o: none; down: SiLU-and-mul; a mixture of experts' router:
residual-add + RMSNorm, its experts not here), one decode row: the unfused path
(the norm or SiLU kernel, then cuBLAS ``F.linear``) and the skinny kernel with its tile
(tuned or default), and the persistent row kernel where it takes the shape by default.
``--sweep`` times every tile of a small grid (and the row kernel's, reported only), each
checked against the unfused output first; ``--tiles-out`` merges the best tile per
(prologue, N, K, device) into a JSON file that ``skinny.TILES_FILE`` can be. Times
are CUDA-graph replays over weight copies that exceed L2 (``bench.common.timing``), so
each call reads its weight from HBM; the weight-read floor uses the bandwidth measured here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import hardware, shapes
from bench.common.shapes import projections
from bench.common.switches import KERNEL_SWITCH_MODES
from bench.common.timing import weight_copies, weights_replay_us

# (block_n, block_k, num_warps[, num_stages]) candidates at M = 1; the last ones loop over
# short K chunks with a deeper software pipeline. RMSNorm prologues also try each one
# with ``one_pass`` (``executor/kernels/skinny/kernel.py``).
SWEEP = [(1, 4096, 4), (2, 1024, 4), (2, 2048, 8), (2, 4096, 4), (2, 4096, 8), (4, 1024, 4),
         (4, 2048, 4), (4, 2048, 8), (4, 4096, 8), (8, 512, 4), (8, 1024, 4), (8, 2048, 8),
         (16, 512, 4), (32, 256, 4), (4, 512, 4, 4), (8, 256, 4, 4), (8, 512, 4, 4),
         (16, 256, 4, 4), (16, 512, 8, 4), (32, 128, 4, 5)]
EPS = 1e-5
# (block_n, num_warps, programs_per_sm) candidates of the persistent row kernel
# (``skinny.RowTile``); where K is long, wide blocks spill registers, so those are
# skipped above 128 weight values a thread.
ROW_SWEEP = [(bn, warps, per_sm) for bn in (1, 2, 4, 8) for warps in (4, 8)
             for per_sm in (1, 2, 4)]


def candidates(prologue: int) -> list[tuple[int | bool, ...]]:
    """The sweep's tiles, as ``Tile`` fields, for a projection with this prologue."""
    from executor.kernels import skinny as sg

    out: list[tuple[int | bool, ...]] = [(*c, 3) if len(c) == 3 else c for c in SWEEP]
    if prologue in (sg.RMS_NORM, sg.ADD_RMS_NORM):
        out += [(*c, True) for c in out]
    return out


def _cases(k: int, proj: str
           ) -> tuple[int, Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """``(prologue, unfused(w), fused(w, tile), check(got, w))`` for one projection at
    M = 1; ``check`` raises where a one-pass tile's output is more than an ulp off the
    float32 norm-and-product (other tiles are checked against ``unfused``)."""
    from executor import kernels
    from executor.kernels import skinny as sg

    dev, dt = torch.device("cuda"), torch.bfloat16
    if proj in ("qkv", "gate_up", "router"):
        x = torch.randn(1, k, device=dev, dtype=dt)
        res = torch.randn(1, k, device=dev, dtype=dt) * 3
        nw = (1 + 0.2 * torch.randn(k, device=dev)).to(dt)
        s32 = kernels.add_rms_norm(x, res, nw, EPS)[1].float()
        normed32 = s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + EPS) * nw.float()

        def check(got: torch.Tensor, w: torch.Tensor) -> None:
            ref32 = normed32 @ w.float().T
            err = (got.float() - ref32).abs()
            if not bool((err <= 2**-7 * ref32.abs() + 1e-3).all()):
                raise AssertionError(f"one-pass product off by {float(err.max()):.3g}")

        return (sg.ADD_RMS_NORM,
                lambda w: F.linear(kernels.add_rms_norm(x, res, nw, EPS)[0], w),
                lambda w, tile=None: sg.skinny_norm_gemm(x, res, nw, EPS, w, tile=tile)[0],
                check)
    if proj == "down":
        g = torch.randn(1, 2 * k, device=dev, dtype=dt) * 2
        return (sg.SILU_MUL, lambda w: F.linear(kernels.silu_and_mul(g), w),
                lambda w, tile=None: sg.skinny_gemm(g, w, silu_mul=True, tile=tile), _no_check)
    x = torch.randn(1, k, device=dev, dtype=dt)
    return (sg.PLAIN, lambda w: F.linear(x, w),
            lambda w, tile=None: sg.skinny_gemm(x, w, tile=tile), _no_check)


def _no_check(got: torch.Tensor, w: torch.Tensor) -> None:
    raise AssertionError("only RMSNorm prologues have one-pass tiles")


def row_candidates(k: int) -> list[tuple[int, int, int]]:
    """The row kernel's sweep at inner size ``k``: tiles holding at most 128 weight values
    a thread (block_n rows of the whole next-power-of-two row, over the warps' threads)."""
    from executor.kernels.fast_launch import next_power_of_2

    return [c for c in ROW_SWEEP if c[0] * next_power_of_2(k) <= 128 * 32 * c[1]]


def measure(spec: Any, sweep: bool) -> list[dict[str, Any]]:
    from executor.kernels.skinny import RowTile, Tile, pick_tile, row_tile, sm_count

    dev, dtype = torch.device("cuda"), torch.bfloat16
    bw = hardware.read_bandwidth_gbs() * 1e9
    rows = []
    for name, (k, n) in projections(spec).items():
        if name == "lm_head":
            continue
        copies = weight_copies(k, n)
        weights = [torch.randn(n, k, device=dev, dtype=dtype) / k**0.5 for _ in range(copies)]
        prologue, unfused, fused, check = _cases(k, name)
        tile = pick_tile(prologue, 1, n, k, torch.cuda.get_device_name())
        row: dict[str, Any] = {
            "proj": name, "prologue": prologue, "n": n, "k": k,
            "floor_us": k * n * 2 / bw * 1e6, "unfused_us": weights_replay_us(unfused, weights),
            "skinny_us": weights_replay_us(functools.partial(fused, tile=tile), weights),
            "tile": list(dataclasses.astuple(tile))}
        default_row = row_tile(prologue, 1, n, k, sms=sm_count(dev))
        if default_row is not None:  # a default launch takes the persistent row kernel
            row.update(row_us=weights_replay_us(functools.partial(fused, tile=default_row),
                                                weights),
                       row_tile=list(dataclasses.astuple(default_row)))
        if sweep:
            ref = unfused(weights[0])
            results: dict[str, float | str] = {}
            for cand in candidates(prologue):
                t, label = Tile(*cand), json.dumps(list(cand))  # type: ignore[arg-type]
                try:
                    if t.one_pass:
                        check(fused(weights[0], t), weights[0])
                    else:
                        torch.testing.assert_close(fused(weights[0], t), ref, atol=2e-3,
                                                   rtol=2**-6)
                    results[label] = weights_replay_us(functools.partial(fused, tile=t), weights)
                except Exception as exc:  # a wrong or failing candidate is reported, not used
                    results[label] = f"{type(exc).__name__}: {str(exc)[:200]}"
            timed = {c: us for c, us in results.items() if isinstance(us, float)}
            best = min(timed, key=lambda c: timed[c])
            row.update(sweep=results, best_tile=json.loads(best), best_us=timed[best])
            rows_timed: dict[str, float | str] = {}
            for cand in row_candidates(k):  # the row kernel's tiles, checked the same way
                label = json.dumps(list(cand))
                try:
                    torch.testing.assert_close(fused(weights[0], RowTile(*cand)), ref,
                                               atol=2e-3, rtol=2**-6)
                    rows_timed[label] = weights_replay_us(
                        functools.partial(fused, tile=RowTile(*cand)), weights)
                except Exception as exc:  # reported, not used
                    rows_timed[label] = f"{type(exc).__name__}: {str(exc)[:200]}"
            ok = {c: us for c, us in rows_timed.items() if isinstance(us, float)}
            if ok:
                best_row = min(ok, key=lambda c: ok[c])
                row.update(row_sweep=rows_timed, best_row_tile=json.loads(best_row),
                           best_row_us=ok[best_row])
        rows.append(row)
        print(_line(row), flush=True)
        del weights
    return rows


def _line(row: dict[str, Any]) -> str:
    best = (f"  best {row['best_us']:6.1f} tile {row['best_tile']}" if "best_us" in row else "")
    if "row_us" in row:
        best += f"  row {row['row_us']:6.1f} {row['row_tile']}"
    if "best_row_us" in row:
        best += f"  best row {row['best_row_us']:6.1f} {row['best_row_tile']}"
    bad = [c for sweep in ("sweep", "row_sweep")
           for c, us in row.get(sweep, {}).items() if not isinstance(us, float)]
    return (f"{row['proj']:8} N={row['n']:<6} K={row['k']:<6} floor {row['floor_us']:6.1f} us"
            f"  unfused {row['unfused_us']:6.1f}  skinny {row['skinny_us']:6.1f} tile "
            f"{row['tile']}{best}" + (f"  FAILED {bad}" if bad else ""))


def write_tiles(path: Path, rows: list[dict[str, Any]], device: str) -> None:
    """Merge the best tiles into ``path`` (rows of other shapes or other GPUs kept)."""
    old = json.loads(path.read_text())["tiles"] if path.is_file() else []
    keep = {(r["prologue"], r["n"], r["k"], r.get("device", "")): r for r in old}
    for r in rows:
        keep[(r["prologue"], r["n"], r["k"], device)] = {
            "prologue": r["prologue"], "n": r["n"], "k": r["k"], "tile": r["best_tile"],
            "us": round(r["best_us"], 2), "unfused_us": round(r["unfused_us"], 2),
            "proj": r["proj"], "device": device}
    path.write_text(json.dumps({"tiles": sorted(keep.values(), key=lambda r: (
        r["prologue"], r["n"], r["k"], r.get("device", "")))}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(shapes.SHAPES))
    ap.add_argument("--tp", type=int, default=1,
                    help="the projections of one of this many tensor-parallel ranks")
    ap.add_argument("--sweep", action="store_true", help="time a grid of tiles, keep the best")
    ap.add_argument("--tiles-out", type=Path, help="merge the best tiles into this JSON")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--pdl", choices=KERNEL_SWITCH_MODES, default="auto",
                    help="programmatic dependent launch of the skinny kernels (as --pdl)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.kernels.skinny_gemm needs a CUDA device", file=sys.stderr)
        return 2
    from executor.kernels.switches import KernelSwitches

    switches = KernelSwitches.resolve(args.pdl, "auto", torch.device("cuda"))
    pdl_on = switches.pdl
    from executor.weights.sharding import local_spec

    with switches:
        rows = measure(local_spec(shapes.spec(args.shape), args.tp),
                       args.sweep or args.tiles_out is not None)
    device = torch.cuda.get_device_name()
    if args.tiles_out is not None:
        write_tiles(args.tiles_out, rows, device)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"device": device, "torch": torch.__version__, "shape": args.shape,
                "tp": args.tp, "pdl": pdl_on}
        (args.out / f"skinny_gemm-{args.shape}-tp{args.tp}.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
