"""The FP8 GEMM paths against bf16, per projection of a shape and token count.

``python -m bench.kernels.fp8_gemm --shape llama-3.1-8b --tokens 1 --tokens 64`` on an FP8
GPU: per projection and ``M``, bf16 ``F.linear`` (and at one row our bf16 skinny GEMM),
FP8 ``w8a16`` with row and with 128x128 block scales, the activation quantization plus
``torch._scaled_mm`` row-wise and per-tensor (from 8 to 64 rows also plus our FP8 x FP8
kernel at its tuned tile); each a CUDA-graph replay over weight copies that exceed L2
(``bench.common.timing``), beside the FP8 and bf16 read floors measured in the run.
Prints a table; ``--out`` also writes ``fp8_gemm.json``.

``--sweep`` is the **tile tuner**: per projection with the input op the decoder fuses into
it at few rows, row and block scales, each ``--tokens`` up to 64: every candidate tile
checked against the default tile's output and timed, and the cuBLAS FP8 path of the same
work timed; ``--tiles-out executor/quant/tiles.json`` merges the fastest tile per (scales,
rows, N, K, input op, GLU, GPU) with both times (``executor.quant.tiles``), and which
kernel won (``kernel``). Below 8 rows the decoder's MLP runs one of two ways (the
``fp8_glu`` kernel switch), each tuned as its own projections: ``gate_up`` (add + RMSNorm
in) and ``down`` (SiLU-and-mul in), or ``gate_up_glu`` (add + RMSNorm in, the gated
epilogue out: ``glu`` rows) and ``down_plain`` (a plain input); from 8 rows the latter two
are the former's launches and are skipped. At one row the candidates include the
persistent row kernel's tiles; ``--kernel row`` times only those against the w8a16 tile in
use now and its default (a short sweep), ``--kernel w8a16`` only the w8a16 tiles. From 8
rows it also times the FP8 x FP8 kernel's tiles (``dot_kernel``: activation quantization
included, as in cuBLAS FP8's time), and records the fastest tile (``dot_tile``,
``dot_us``) and the fastest of the three paths (``kernel``); the w8a16 kernel is timed
there at its current tile only, unless ``--w8a16-tiles``. Launches take PDL as the server's
``--pdl`` does (``--pdl``, default ``auto``: on where the GPU has it), so a tile is timed as
the step launches it.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import hardware, shapes
from bench.common.switches import KERNEL_SWITCH_MODES
from bench.common.timing import weight_copies, weights_replay_us
from executor.quant.tiles import ADD_RMS_NORM, PLAIN, SILU_MUL


def _paths(m: int, k: int, n: int) -> dict[str, tuple[Callable[[torch.Tensor], object], bool]]:
    """name -> (fn of one weight copy, whether it takes the FP8 copies)."""
    from executor.kernels.skinny import skinny_gemm
    from executor.quant import launch
    from executor.quant.fp8 import FP8_MAX
    from executor.quant.tiles import Fp8Tile

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
        from executor.kernels.skinny.tiles import device_name
        from executor.quant.tiles import default_tile, pick_tile

        out["bf16 skinny"] = (lambda w: skinny_gemm(x, w), False)
        # "fp8 w8a16 rows" above is whichever kernel a launch picks; beside it each kernel
        # on its own tile (tuned, or its default)
        name = device_name(dev)
        w8 = pick_tile(1, n, k, False, 0, name)
        if not isinstance(w8, Fp8Tile):
            w8 = default_tile(1, n, k, False)
        row = pick_tile(1, n, k, False, 0, name, torch.cuda.get_device_properties(dev)
                        .multi_processor_count)
        out["fp8 w8a16 kernel rows"] = (lambda w: launch.w8a16(x, w, rows, None, w8), True)
        if not isinstance(row, Fp8Tile):
            out["fp8 row kernel rows"] = (lambda w: launch.w8a16(x, w, rows, None, row), True)
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
    if 8 <= m <= 64:
        from executor.quant.dot_kernel import fp8_dot

        def dot(w: torch.Tensor) -> object:
            q, s = launch.act_quant(x, None)
            return fp8_dot(q, s, w, rows, None, torch.bfloat16)

        out["fp8 dot rows"] = (dot, True)
    return out


def measure(spec: Any, tokens: list[int]) -> list[dict[str, Any]]:
    dev = torch.device("cuda")
    bw = hardware.read_bandwidth_gbs() * 1e9
    rows = []
    for name, (k, n) in shapes.projections(spec).items():
        if name in ("lm_head", "router"):  # (a router stays bf16)
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


#: The row kernel's (programs per SM, pipeline stages) the sweep tries: the register
#: prefetch (0) on 4 programs, Triton's pipelined loop 2 to 4 deep.
ROW_PIPELINES = ((4, 0), (4, 2), (4, 3), (2, 3), (2, 4), (1, 4))


def candidates(m: int, n: int, k: int, blocks: bool, op: int, kernel: str = "all",
               device: str = "", glu: bool = False) -> list[Any]:
    """The tiles to time: w8a16 ones (``kernel`` "row": only the one ``device`` takes now,
    tuned or default), and at one row the row kernel's (unless ``kernel`` is "w8a16"):
    8 KiB to 64 KiB of weight per column block, 32, 64 or 128 bytes of it per thread (the
    more a thread sums of a row, the less the cross-warp reduction weighs), each with
    the register prefetch on 4 programs per SM and a 2- to 4-stage pipeline on 1, 2 or 4
    programs per SM (``ROW_PIPELINES``; the grid holds as many as fit). ``glu``: the gated
    epilogue's launches, whose block of ``block_n`` columns reads twice as many weight rows
    (the same blocks of weight rows are timed)."""
    from executor.kernels.fast_launch import next_power_of_2
    from executor.quant.tiles import (
        DOT_MIN_ROWS,
        ROW_MAX_K,
        Fp8RowTile,
        Fp8Tile,
        pick_tile,
        valid,
    )

    kp = next_power_of_2(k)
    per = 2 if glu else 1  # weight rows per output column
    tiles: list[Any]
    if kernel == "row":
        tiles = [pick_tile(m, n, k, blocks, op, device, glu=glu)]
    elif m < DOT_MIN_ROWS:
        tiles = [Fp8Tile(bn // per, bk, w, 3) for bn in (2, 4, 8, 16)
                 for bk in (512, 1024, 2048, 4096) for w in (4, 8) if bk <= max(512, kp)]
    else:
        tiles = [Fp8Tile(bn, bk, w) for bn in (32, 64, 128) for bk in (64, 128) for w in (4, 8)]
    if m == 1 and kernel != "w8a16" and kp <= ROW_MAX_K:
        # (bn: weight rows per block)
        tiles += [Fp8RowTile(bn // per, w, p, stages) for bn in (1, 2, 4, 8, 16)
                  for w in (2, 4, 8, 16) for p, stages in ROW_PIPELINES
                  if bn >= per and 8192 <= bn * kp <= 65536
                  and bn * kp // (32 * w) in (32, 64, 128)
                  and stages * bn * kp <= 196608]  # (shared memory: at most 192 KiB)
    return [t for t in tiles if valid(t, m, blocks)]


def _dot_candidates(m: int, n: int, k: int, blocks: bool) -> list[Any]:
    """The FP8 x FP8 kernel's tiles worth timing: 64 or 128 columns per program, K split
    until the programs cover a large GPU's SMs one to about eight times (slices of at least
    512 columns), 128- and 256-column chunks (128 with block scales), the weight rows on
    the MMA's M side; from 32 rows also the activation rows there."""
    from executor.kernels.fast_launch import cdiv
    from executor.quant.tiles import DotTile, default_dot_tile

    tiles = [default_dot_tile(m, n, k, blocks)]
    for bn in (64, 128):
        for split in (1, 2, 4, 8):
            if not 100 <= cdiv(n, bn) * split <= 1100 or k < 512 * split:
                continue
            tiles += [DotTile(bn, bk, split, 4, 0, True) for bk in (128, 256)
                      if not (blocks and bk > 128)]
            if m >= 32:
                tiles.append(DotTile(bn, 128, split, 4 if bn == 64 else 8, 0, False))
    return list(dict.fromkeys(tiles))


def _dot_runner(x: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
                ) -> Callable[..., torch.Tensor]:
    """``run(w, tile)``: the activation quantization and the FP8 x FP8 kernel."""
    from executor.quant import launch
    from executor.quant.dot_kernel import fp8_dot

    def run(w: torch.Tensor, tile: Any) -> torch.Tensor:
        q, s = launch.act_quant(x, None)
        return fp8_dot(q, s, w, scale, block, x.dtype, tile)

    return run


def _time_dot(x: torch.Tensor, fp8: list[torch.Tensor], scale: torch.Tensor,
              block: tuple[int, int] | None) -> tuple[Any, float, float] | None:
    """(fastest tile, its µs, the default tile's µs) of the FP8 x FP8 kernel, each tile
    checked against the float32 product of the quantized rows and the weight; None if no
    tile ran (the row then names the faster of the other two paths)."""
    from executor.quant import launch
    from executor.quant.fp8 import dequantize

    m, k = x.shape
    n = fp8[0].shape[0]
    q, s = launch.act_quant(x, None)
    want = (q.float() * s) @ dequantize(fp8[0], scale if block else scale.view(-1, 1),
                                         block, torch.float32).T
    run = _dot_runner(x, scale, block)
    times: dict[Any, float] = {}
    tiles = _dot_candidates(m, n, k, block is not None)
    for tile in tiles:
        try:
            got = run(fp8[0], tile).float()
        except Exception as exc:  # a tile this GPU cannot compile
            print(f"skip dot {tile}: {exc!r}"[:200], flush=True)
            continue
        if not torch.allclose(got, want, rtol=2e-2, atol=1e-2 * float(want.abs().max())):
            print(f"skip dot {tile}: wrong result", flush=True)
            continue
        times[tile] = weights_replay_us(functools.partial(run, tile=tile), fp8)
    if not times:
        print(f"no FP8 x FP8 tile ran for ({m}, {n}, {k})", flush=True)
        return None
    best = min(times, key=times.__getitem__)
    return best, times[best], times.get(tiles[0], float("nan"))


def _runner(x: torch.Tensor, op: int, res: torch.Tensor, nw: torch.Tensor,
            scale: torch.Tensor, block: tuple[int, int] | None, glu: bool = False
            ) -> Callable[..., torch.Tensor]:
    """``run(w, tile)``: the launch the sweep times, with ``op`` fused in (``glu``: and
    the gated epilogue)."""
    from executor.quant import launch

    def run(w: torch.Tensor, tile: Any) -> torch.Tensor:
        norm = op == ADD_RMS_NORM
        if glu:
            return launch.w8a16_glu(x, w, scale, block, op, res if norm else None,
                                    nw if norm else None, 1e-5, tile)[0]
        if op == PLAIN:
            return launch.w8a16(x, w, scale, block, tile)
        return launch.w8a16_fused(x, w, scale, block, op, res if norm else None,
                                  nw if norm else None, 1e-5, tile)[0]

    return run


def _unfused_scaled_mm(x: torch.Tensor, op: int, res: torch.Tensor, nw: torch.Tensor,
                       scale: torch.Tensor, glu: bool = False) -> Callable[[torch.Tensor], object]:
    """The cuBLAS FP8 path of the same work: the input op's own kernel, the activation
    quantization, ``torch._scaled_mm`` row-wise (``glu``: then SiLU-and-mul)."""
    from executor import kernels
    from executor.quant import launch

    def run(w: torch.Tensor) -> object:
        a = x
        if op == ADD_RMS_NORM:
            a = kernels.add_rms_norm(x, res, nw, 1e-5)[0]
        elif op == SILU_MUL:
            a = kernels.silu_and_mul(x)
        q, s = launch.act_quant(a, None)
        y = torch._scaled_mm(q, w.t(), scale_a=s, scale_b=scale.view(1, -1),
                             out_dtype=torch.bfloat16)
        return kernels.silu_and_mul(y) if glu else y

    return run


#: The sweep's projections: name -> (the weight's projection in ``shapes.projections``,
#: the input op the decoder fuses into it below 8 rows, the gated epilogue). ``gate_up_glu``
#: and ``down_plain`` are the MLP with the ``fp8_glu`` switch on, below 8 rows only.
PROJECTIONS: dict[str, tuple[str, int, bool]] = {
    "qkv": ("qkv", ADD_RMS_NORM, False), "o": ("o", PLAIN, False),
    "gate_up": ("gate_up", ADD_RMS_NORM, False), "down": ("down", SILU_MUL, False),
    "gate_up_glu": ("gate_up", ADD_RMS_NORM, True), "down_plain": ("down", PLAIN, False)}
FEW_ROWS_ONLY = ("gate_up_glu", "down_plain")


def sweep(spec: Any, tokens: list[int], scales: tuple[str, ...] = ("rows", "blocks"),
          kernel: str = "all", w8a16_tiles: bool = False,
          only: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The fastest valid tile per projection (``PROJECTIONS``), scales (``rows``: per
    channel, ``blocks``: 128x128) and row count (see the docstring); ``kernel``: which
    kernels' tiles; ``only``: these projections (a mixture of experts' dense ones: ``qkv``,
    ``o``)."""
    from executor.kernels.skinny.tiles import device_name
    from executor.quant.tiles import (
        DOT_MIN_ROWS,
        Fp8RowTile,
        default_tile,
        pick_tile,
        rows_bucket,
    )

    dev = torch.device("cuda")
    bw = hardware.read_bandwidth_gbs() * 1e9
    weights = shapes.projections(spec)
    unknown = set(only) - set(PROJECTIONS)
    if unknown:
        raise SystemExit(f"unknown projections {sorted(unknown)}; known: {list(PROJECTIONS)}")
    out = []
    for name, (proj, fused_op, glu) in PROJECTIONS.items():
        if proj not in weights or (only and name not in only):
            continue
        k, n = weights[proj]
        fp8 = [(torch.randn(n, k, device=dev) * 64).to(torch.float8_e4m3fn)
               for _ in range(weight_copies(k, n, 1))]
        for blocks in [kind == "blocks" for kind in scales]:
            scale = torch.rand((-(-n // 128), -(-k // 128)) if blocks else (n,),
                               device=dev) / 448 + 1e-3
            block = (128, 128) if blocks else None
            for m in [t for t in tokens if t <= 64]:
                if m >= DOT_MIN_ROWS and name in FEW_ROWS_ONLY:
                    continue  # (no input op, no epilogue: the plain projection's rows)
                op = fused_op if m < DOT_MIN_ROWS else PLAIN
                x = torch.randn(m, 2 * k if op == SILU_MUL else k, device=dev).to(torch.bfloat16)
                res = torch.randn(m, k, device=dev).to(torch.bfloat16)
                nw = torch.ones(k, device=dev, dtype=torch.bfloat16)

                run = _runner(x, op, res, nw, scale, block, glu)
                default = default_tile(m, n, k, blocks, op, glu)
                want = run(fp8[0], default).float()
                times: dict[Any, float] = {
                    default: weights_replay_us(functools.partial(run, tile=default), fp8)}
                dot = m >= DOT_MIN_ROWS
                tiles = candidates(m, n, k, blocks, op, kernel, device_name(dev), glu) \
                    if not dot or w8a16_tiles else \
                    [pick_tile(m, n, k, blocks, op, device_name(dev))]  # (the current one)
                for tile in tiles:
                    if tile in times:
                        continue
                    try:
                        got = run(fp8[0], tile).float()
                    except Exception as exc:  # a tile this GPU cannot compile
                        print(f"skip {tile}: {exc!r}"[:200], flush=True)
                        continue
                    atol = 1e-2 * float(want.abs().max())
                    if not torch.allclose(got, want, rtol=2e-2, atol=atol):
                        print(f"skip {tile}: wrong result", flush=True)
                        continue
                    times[tile] = weights_replay_us(functools.partial(run, tile=tile), fp8)
                best = min(times, key=times.__getitem__)
                by_kernel = {kind: min((t for c, t in times.items()
                                        if isinstance(c, Fp8RowTile) == (kind == "row")),
                                       default=None) for kind in ("row", "w8a16")}
                cublas = None
                if not blocks and k % 16 == 0 and n % 16 == 0:
                    cublas = weights_replay_us(_unfused_scaled_mm(x, op, res, nw, scale, glu),
                                               fp8)
                row = {"device": device_name(dev), "scales": "blocks" if blocks else "rows",
                       "m": rows_bucket(m), "n": n, "k": k, "input_op": op,
                       **({"glu": True} if glu else {}),
                       "kernel": "row" if isinstance(best, Fp8RowTile) else "w8a16",
                       "tile": _tile_list(best),
                       "us": round(times[best], 2), "default_us": round(times[default], 2),
                       "floor_us": round(k * n / bw * 1e6, 2)}
                for kind, us in by_kernel.items():  # each kernel's best, where timed
                    if us is not None and m == 1:
                        row[f"{kind}_us"] = round(us, 2)
                if cublas is not None:  # what gemm.prepare's cuBLAS FP8 path costs here
                    row["scaled_mm_us"] = round(cublas, 2)
                if dot:  # the FP8 x FP8 kernel, and the fastest of the three paths
                    paths = {"w8a16": times[best]}
                    got_dot = _time_dot(x, fp8, scale, block)
                    if got_dot is not None:
                        dtile, dus, ddefault = got_dot
                        row.update(dot_tile=[dtile.block_n, dtile.block_k, dtile.split_k,
                                             dtile.num_warps, dtile.num_stages, dtile.swap_ab],
                                   dot_us=round(dus, 2), dot_default_us=round(ddefault, 2))
                        paths["dot"] = dus
                    if cublas is not None:
                        paths["scaled_mm"] = cublas
                    row["kernel"] = min(paths, key=paths.__getitem__)
                print(json.dumps(row), flush=True)
                out.append(row)
        del fp8
        torch.cuda.empty_cache()
    return out


def _tile_list(tile: Any) -> list[int]:
    """A tile as the tile file stores it (``executor.quant.tiles._tile`` reads it back)."""
    if hasattr(tile, "programs_per_sm"):  # Fp8RowTile
        return [tile.block_n, tile.num_warps, tile.programs_per_sm, tile.num_stages]
    return [tile.block_n, tile.block_k, tile.num_warps, tile.num_stages]


def merge_tiles(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` into the tile file at ``path``, replacing rows of the same key."""
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["device"], r["scales"], r["m"], r["n"], r["k"], r["input_op"],
                bool(r.get("glu", False)))

    old = json.loads(path.read_text())["tiles"] if path.is_file() else []
    new = {key(r): r for r in old}
    new.update({key(r): r for r in rows})
    path.write_text(json.dumps({"tiles": sorted(new.values(), key=key)}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--tokens", type=int, action="append")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--sweep", action="store_true", help="tune the w8a16 tiles")
    ap.add_argument("--tiles-out", type=Path, help="with --sweep: merge the best tiles here")
    ap.add_argument("--scales", choices=("rows", "blocks", "both"), default="both",
                    help="with --sweep: per-channel scales, 128x128 block scales, or both")
    ap.add_argument("--kernel", choices=("all", "row", "w8a16"), default="all",
                    help="with --sweep: every candidate; the row kernel's against the w8a16 "
                         "tile in use now; or the w8a16 kernel's only")
    ap.add_argument("--w8a16-tiles", action="store_true",
                    help="with --sweep: from 8 rows also search the w8a16 tiles")
    ap.add_argument("--projections", default="",
                    help="with --sweep: a comma list of projections to tune (qkv, o, gate_up, "
                         "down, gate_up_glu, down_plain: the MLP below 8 rows with the gated "
                         "epilogue); default all (a mixture of experts' MLP is its experts: "
                         "qkv,o)")
    ap.add_argument("--pdl", choices=KERNEL_SWITCH_MODES, default="auto",
                    help="programmatic dependent launch of our kernels (as the server's "
                         "--pdl): tiles are timed the way the decode step launches them")
    args = ap.parse_args(argv)
    from executor.kernels.switches import KernelSwitches

    with KernelSwitches.resolve(args.pdl, "auto", torch.device("cuda")):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.sweep:
        kinds = ("rows", "blocks") if args.scales == "both" else (args.scales,)
        tuned = sweep(shapes.spec(args.shape), args.tokens or [1], kinds, args.kernel,
                      args.w8a16_tiles, tuple(filter(None, args.projections.split(","))))
        if args.tiles_out:
            merge_tiles(args.tiles_out, tuned)
        return 0
    rows = measure(shapes.spec(args.shape), args.tokens or [1, 8, 64, 2048])
    print(table(rows))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8_gemm.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
