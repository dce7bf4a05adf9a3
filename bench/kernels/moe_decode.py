"""The MoE decode path's kernels against the grouped path and their floor, and the RoPE
kernel's head split, at decode sizes (random bf16 or FP8 weights, one GPU).

    python -m bench.kernels.moe_decode [--shape qwen3-30b-a3b|mixtral] [--tokens 1,2,4]
                                       [--weights bf16|fp8-channel|fp8-block]
                                       [--sweep] [--out DIR]

Per token count: one MoE layer's experts as the decode path (``moe.decode.routed``, the
input norm fused) and as the grouped path it replaces at those sizes (the norm kernel,
``route_align``, the two grouped GEMMs and the sum), each call on its own copy of the
experts (copies together exceed L2, so weights stream from HBM as in a forward), against
the bytes of the experts routed to over the measured read bandwidth (``--weights``: bf16
experts, or e4m3 with per-channel or 128x128 block scales: 1 byte a weight plus the
scales in the floor), the default tiles also with the other weight stream (chunks
prefetched in registers or through Triton's pipelined loop, ``DecodeTiles.stages``).
``--sweep`` times the decode path's tiles at the first token count (gate_up's, then
down's with gate_up's best) and prints the fastest. Then ``rope_qk`` (q/k norm + RoPE,
32 q and 4 KV heads of 128) at one token: the head split against one program per kind of
head. Prints a table; writes ``moe_decode.json`` (``moe_decode_<weights>.json`` for FP8)
under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import hardware
from bench.common.meta import git_commit
from bench.common.timing import L2_BYTES, capture, replay_us

#: (experts, top_k, hidden, expert width)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336)}
DEVICE = torch.device("cuda")


def _per_call_us(fn: Callable[[int], object], calls: int) -> float:
    graph = capture(lambda: [fn(i) for i in range(calls)])
    try:
        return replay_us(graph, calls, 50, warmup=5)
    finally:
        del graph


def _timed(fn: Callable[[int], object], calls: int, tiles: Any
           ) -> list[tuple[float, dict[str, Any]]]:
    """``[(us per call, tiles)]``, or nothing (and a line saying why) where the tiles do
    not fit the GPU (a pipelined loop's shared memory) or do not compile."""
    import triton

    try:
        return [(_per_call_us(fn, calls), dataclasses.asdict(tiles))]
    except (triton.runtime.errors.OutOfResources, triton.CompilationError) as e:
        first = (str(e).splitlines() or [""])[0][:120]
        print(f"        skipped {tiles}: {type(e).__name__}: {first}")
        return []


def kernel_us(fn: Callable[[int], object], calls: int) -> dict[str, float]:
    """Mean device time per call of each kernel ``fn`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            for i in range(calls):
                fn(i)
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / e.count for e in prof.key_averages()
            if e.device_time_total > 0}


def _scale_shapes(weights: str, experts: int, hidden: int, inter: int
                  ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The scales' shapes of ``w_gate_up`` and ``w_down`` (None: bf16 weights)."""
    if weights == "fp8-channel":
        return (experts, 2 * inter), (experts, hidden)
    if weights == "fp8-block":
        rows, cols = -(-2 * inter // 128), -(-hidden // 128)
        return (experts, rows, cols), (experts, cols, -(-inter // 128))
    return None


def _expert_copy(weights: str, experts: int, hidden: int, inter: int
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, Any]]:
    """One copy of the experts: ``(w_gate_up, w_down)`` and the kernels' FP8 keywords."""
    shapes = _scale_shapes(weights, experts, hidden, inter)
    w13 = torch.randn(experts, 2 * inter, hidden, device=DEVICE, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=DEVICE, dtype=torch.bfloat16) * 0.02
    if shapes is None:
        return (w13, w2), {}
    # random e4m3 values and scales: the timing does not depend on them
    fp8 = torch.float8_e4m3fn
    return ((w13 * 50).to(fp8), (w2 * 50).to(fp8)), {
        "w13_scale": torch.rand(shapes[0], device=DEVICE) * 1e-3,
        "w2_scale": torch.rand(shapes[1], device=DEVICE) * 1e-3,
        "block": (128, 128) if weights == "fp8-block" else None}


def expert_bytes(weights: str, hidden: int, inter: int) -> int:
    """Bytes one expert's weights and scales take."""
    shapes = _scale_shapes(weights, 1, hidden, inter)
    if shapes is None:
        return 3 * hidden * inter * 2
    return 3 * hidden * inter + 4 * sum(int(torch.Size(s).numel()) for s in shapes)


def moe_case(shape: tuple[int, int, int, int], tokens: int, bw_gbs: float, sweep: bool,
             weights: str = "bf16") -> dict[str, Any]:
    from executor import kernels
    from executor.kernels.moe import decode, fused, scales
    from executor.kernels.moe import route as routing

    experts, top_k, hidden, inter = shape
    one_expert = expert_bytes(weights, hidden, inter)
    # the routed experts of all copies together exceed L2 twice over
    copies = max(2, -(-2 * L2_BYTES // (min(tokens * top_k, experts) * one_expert)) + 1)
    drawn = [_expert_copy(weights, experts, hidden, inter) for _ in range(copies)]
    w = [d[0] for d in drawn]
    fp8 = [d[1] for d in drawn]
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    logits = torch.randn(tokens, experts, device=DEVICE, dtype=torch.bfloat16)
    nw = torch.ones(hidden, device=DEVICE, dtype=torch.bfloat16)

    def run_decode(tiles: decode.DecodeTiles | None) -> Callable[[int], object]:
        return lambda i: decode.routed(x, logits, *w[i % copies], top_k, True, True, nw, 1e-6,
                                       tiles, **fp8[i % copies])

    def grouped(i: int) -> object:
        normed = kernels.rms_norm(x, nw, 1e-6)
        tiles = fused._tiles(normed, w[i % copies][0], tokens * top_k)
        route_w, _, aligned = routing.route_align(logits, top_k, True, True, tiles.block_m)
        return fused.grouped_experts(normed, *w[i % copies], route_w, top_k, aligned, tiles,
                                     **fp8[i % copies])

    touched = int(routing.route_topk(logits, top_k, True, True)[1].unique().numel())
    floor_us = touched * one_expert / (bw_gbs * 1e3)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    mode = {"bf16": scales.NONE, "fp8-channel": scales.CHANNEL,
            "fp8-block": scales.BLOCKS}[weights]
    default = decode.pick_tiles(tokens, top_k, hidden, inter, torch.bfloat16, sms, mode)
    # reduction chunks swept (gate_up's, down's): bf16's; block scales also shorter ones
    # inside one 128-column block (the default: wider chunks are split into their blocks);
    # per-channel FP8 rows are half the bytes, so gate_up's twice as long too (down's
    # accumulators are top_k times wider already)
    chunks = {scales.NONE: ((128, 256), (64, 128, 256)),
              scales.BLOCKS: ((64, 128, 256), (32, 64, 128, 256)),
              scales.CHANNEL: ((128, 256, 512), (64, 128, 256))}[mode]
    # the chunks prefetched in registers (0) or through Triton's pipelined loop
    # (``DecodeTiles.stages``)
    stages = (0, 3, 4)
    out: dict[str, Any] = {"tokens": tokens, "weights": weights, "floor_us": floor_us,
                           "decode_us": _per_call_us(run_decode(None), copies),
                           "grouped_us": _per_call_us(grouped, copies),
                           "kernels_us": kernel_us(run_decode(None), copies),
                           "tiles": dataclasses.asdict(default)}
    # the default tiles with the other weight stream: pipelined (3 stages) where the
    # default prefetches in registers, in registers where it pipelines
    other = 3 if default.stages == 0 else 0
    alt = dataclasses.replace(default, stages=other, stages_down=other)
    for us, _ in _timed(run_decode(alt), copies, alt):
        out["other_stream"] = {"stages": other, "us": us}
    if sweep:
        timed = []
        for bn, bk, nw_, st in itertools.product((8, 16, 32), chunks[0], (4, 8), stages):
            t = dataclasses.replace(default, block_n=bn, block_k=bk, num_warps=nw_, stages=st)
            timed += _timed(run_decode(t), copies, t)
        best_up = min(timed, key=lambda r: r[0])[1]
        for bn, bk, nw_, st in itertools.product((4, 8, 16), chunks[1], (4, 8), stages):
            t = dataclasses.replace(decode.DecodeTiles(**best_up), block_n_down=bn,
                                    block_k_down=bk, num_warps_down=nw_, stages_down=st)
            timed += _timed(run_decode(t), copies, t)
        out["sweep_best"] = min(timed, key=lambda r: r[0])
    return out


def rope_case() -> dict[str, Any]:
    from executor.kernels import rope

    heads, kv_heads, head_dim, calls = 32, 4, 128, 48
    qkv = torch.randn(1, (heads + 2 * kv_heads) * head_dim, device=DEVICE, dtype=torch.bfloat16)
    q = qkv[:, :heads * head_dim].view(1, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(1, kv_heads, head_dim)
    emb = torch.outer(torch.arange(4096, device=DEVICE, dtype=torch.float32),
                      torch.rand(head_dim // 2, device=DEVICE)).repeat(1, 2)
    cos, sin = emb.cos(), emb.sin()
    pos = torch.tensor([300], device=DEVICE)
    qw = torch.ones(head_dim, device=DEVICE, dtype=torch.bfloat16)
    def call(block: int | None) -> Callable[[int], object]:
        return lambda _: rope._launch(q, k, pos, cos, sin, qw, qw, 1e-6, head_block=block)

    return {"split_us": _per_call_us(call(None), calls),
            "one_block_us": _per_call_us(call(heads), calls)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--weights", default="bf16", choices=("bf16", "fp8-channel", "fp8-block"),
                    help="the experts' format: bf16, or e4m3 with per-channel or 128x128 "
                         "block scales")
    ap.add_argument("--sweep", action="store_true",
                    help="time the decode path's tiles at the first token count")
    ap.add_argument("--out", type=Path, default=Path("results-local"))
    args = ap.parse_args(argv)
    bw = hardware.read_bandwidth_gbs(2**30)
    result: dict[str, Any] = {"shape": args.shape, "weights": args.weights,
                              "device": torch.cuda.get_device_name(),
                              "commit": git_commit(), "read_bandwidth_gbs": bw,
                              "moe": [moe_case(SHAPES[args.shape], int(t), bw,
                                               args.sweep and n == 0, args.weights)
                                      for n, t in enumerate(args.tokens.split(","))],
                              "rope": rope_case()}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "moe_decode" if args.weights == "bf16" else f"moe_decode_{args.weights}"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(f"{args.shape} ({args.weights} experts) on {result['device']}, read {bw:.0f} GB/s")
    print("tokens  decode us  grouped us  floor us  decode/floor  tiles")
    for c in result["moe"]:
        print(f"{c['tokens']:>6}  {c['decode_us']:9.1f}  {c['grouped_us']:10.1f}  "
              f"{c['floor_us']:8.1f}  {c['decode_us'] / c['floor_us']:12.2f}  {c['tiles']}")
        print("        kernels: " + ", ".join(f"{k} {v:.1f} us"
                                               for k, v in c["kernels_us"].items()))
        if c.get("other_stream"):
            o = c["other_stream"]
            how = "pipelined weight stream" if o["stages"] else "prefetch in registers"
            print(f"        stages={o['stages']} ({how}): {o['us']:.1f} us")
        if "sweep_best" in c:
            print(f"        sweep best {c['sweep_best'][0]:.1f} us: {c['sweep_best'][1]}")
    r = result["rope"]
    print(f"rope_qk 1 token 32+4 heads: split {r['split_us']:.1f} us, one block per kind "
          f"{r['one_block_us']:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
