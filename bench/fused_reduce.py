"""The all-reduce fused into the projections around it, against the all-reduce kernel.

``python -m bench.fused_reduce --shape llama-3.1-8b --world 2 --out DIR`` on ``--world`` GPUs.

Each rank draws its own slices of one layer's four projections at one row (the shape's
per-rank widths, bf16; a fixed seed per rank) and runs the two row-parallel sums of a
layer both ways:

* unfused: o_proj's skinny GEMM, our all-reduce kernel (``--tp-all-reduce triton``), the
  fused add-norm + gate_up GEMM; then down (SiLU-and-mul fused in), all-reduce, qkv;
* fused (``TensorParallel.push_sum``): o_proj and down push their partial rows into the
  reduce sites, gate_up and qkv gather the sums.

Checks, on every rank: the fused outputs and new residuals equal the unfused ones bit for
bit (the same float32 rank-order sum, rounded once; both sides on the classic skinny
kernel, ``--skinny-row-kernel off``), eagerly and replayed three times from
a CUDA graph of ``PAIRS`` layers with new inputs before each replay (a slot of another call,
a stale line or a peer's other call fails it). Times: median µs per layer of each graph.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import torch

from bench import shapes

#: Layers captured back to back in each timed graph.
PAIRS = 32


def _worker(rank: int, world: int, port: int, shape: str, queue: Any) -> None:
    import torch.distributed as dist

    from executor.distributed import group
    from executor.kernels import skinny_gemm as sg
    from executor.timing import replay_us

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    # The fused path's gathering projections run the classic skinny kernel; so must the
    # unfused path's for the comparison to hold bit for bit (by default a one-row gate_up
    # takes the row kernel, whose sums run in another order: within an ulp).
    sg.use_row_kernel(False)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=120))
    tp = group.init(rank, world, device, store, datetime.timedelta(seconds=120), "triton",
                    fuse="on")
    fused = bool(group.all_reduce_choice(tp).get("fused_into_projections"))
    cfg = shapes.SHAPES[shape]
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], \
        cfg["num_key_value_heads"]
    head_dim = hidden // heads
    inter = cfg["intermediate_size"] // world
    q_size = heads * head_dim // world
    qkv_rows = (heads + 2 * kv_heads) * head_dim // world
    gen = torch.Generator(device=device).manual_seed(1234 + rank)

    def rand(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device) * scale).to(torch.bfloat16)

    w_o, w_gu = rand(hidden, q_size, scale=q_size ** -0.5), rand(2 * inter, hidden,
                                                                   scale=hidden ** -0.5)
    w_down, w_qkv = rand(hidden, inter, scale=inter ** -0.5), rand(qkv_rows, hidden,
                                                                    scale=hidden ** -0.5)
    nw1, nw2 = 1 + rand(hidden, scale=0.1), 1 + rand(hidden, scale=0.1)

    def linear(w: torch.Tensor) -> torch.nn.Linear:
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=device,
                              dtype=torch.bfloat16)
        lin.weight.data = w
        return lin

    layer = {"o": linear(w_o), "gu": linear(w_gu), "down": linear(w_down),
             "qkv": linear(w_qkv)}

    def unfused(attn: torch.Tensor, res: torch.Tensor) -> list[torch.Tensor]:
        s = tp.all_reduce(sg.skinny_gemm(attn, w_o))
        gate_up, res1 = sg.skinny_norm_gemm(s, res, nw1, 1e-5, w_gu)
        assert res1 is not None
        s = tp.all_reduce(sg.skinny_gemm(gate_up, w_down, silu_mul=True))
        qkv, res2 = sg.skinny_norm_gemm(s, res1, nw2, 1e-5, w_qkv)
        assert res2 is not None
        return [gate_up, res1, qkv, res2]

    def fused_layer(attn: torch.Tensor, res: torch.Tensor) -> list[torch.Tensor]:
        p = tp.push_sum(attn, layer["o"], 0, layer["gu"], nw1)
        assert p is not None, "the fused path did not take a 1-row o_proj"
        gate_up, res = p.norm_linear(res, nw1, 1e-5, layer["gu"])
        p = tp.push_sum(gate_up, layer["down"], 1, layer["qkv"], nw2, silu_mul=True)
        assert p is not None
        qkv, res2 = p.norm_linear(res, nw2, 1e-5, layer["qkv"])
        return [gate_up, res, qkv, res2]

    result: dict[str, Any] = {"fused_into_projections": fused, "world": world, "shape": shape}
    if fused:
        inputs = [(rand(1, q_size), rand(1, hidden)) for _ in range(PAIRS)]
        ok = all(all(torch.equal(a, b) for a, b in zip(unfused(*i), fused_layer(*i),
                                                        strict=True)) for i in inputs[:4])
        times = {}
        for name, fn in (("unfused", unfused), ("fused", fused_layer)):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(*inputs[0])  # warm-up outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = [fn(*i) for i in inputs]
            for _ in range(3):
                for a, r in inputs:  # new values every replay
                    a.copy_(rand(1, q_size))
                    r.copy_(rand(1, hidden))
                graph.replay()
                torch.cuda.synchronize()
                want = [unfused(*i) for i in inputs]
                ok &= all(all(torch.equal(a, b) for a, b in zip(w, o, strict=True))
                          for w, o in zip(want, outs, strict=True))
            times[name] = replay_us(graph, PAIRS, 18, dist.barrier)
            del graph, outs
        result.update(ok=ok, us_per_layer=times)
    group.shutdown(tp)
    if rank == 0:
        queue.put(result)


def run(shape: str, world: int) -> dict[str, Any]:
    """Rank 0's result: whether the group fused, whether every output matched the unfused
    path bit for bit, and µs per layer (two row-parallel sums) each way."""
    from bench.tensor_parallel import spawn_ranks

    result = spawn_ranks(_worker, world, shape)
    result["device"] = torch.cuda.get_device_name(0)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(shapes.SHAPES))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    result = run(a.shape, a.world)
    text = json.dumps(result, indent=1)
    print(text)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"fused_reduce-{a.shape}-tp{a.world}.json").write_text(text + "\n")
    times = result.get("us_per_layer", {})
    if times:
        print(f"per layer: unfused {times['unfused']:.2f} us, fused {times['fused']:.2f} us "
              f"({times['fused'] / times['unfused']:.2f}x)")
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
