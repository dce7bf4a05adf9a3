"""Fused layer kernels vs the plain torch ops on a Llama-3.2-1B-shaped bf16 model.

``python -m bench.kernels.layer_kernels [--out DIR]`` on a CUDA machine. The model is built
directly on the GPU with random weights (no checkpoint on disk) over the Triton attention backend; a
decode batch at context 512. For each kernel choice (``torch``, ``auto`` = fused):

* ``step_graph_ms``: one decode step (forward + logits) as one CUDA graph, replayed;
  the median of many replays timed with CUDA events;
* ``kernels_per_step``: CUDA kernels in one eager step (torch.profiler);
* ``layer_eager_ms`` / ``layer_graph_ms``: one decoder layer at batch 1, eager and as a
  CUDA graph.

Also the logits tail (lm_head, then ``.float()``) and the weight-read floor from the
measured read bandwidth. Writes ``kernels.json`` to ``--out`` (default ``results-local``)
and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import hardware, shapes
from bench.common.timing import graph_ms
from executor.attention.base import AttentionShape
from executor.attention.triton_backend import TritonBackend
from executor.forward_batch import ForwardBatch
from executor.kv.manager import Allocation, Extension
from executor.kv.pool import KVPool, ReqToTokenTable
from executor.model.layers import KernelChoice, select_ops
from executor.model.llama import CausalLM

DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
CONTEXT = 512
MAX_CONTEXT = 2048


def build_model(spec: Any) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(spec, max_positions=MAX_CONTEXT)
    model = model.to(DTYPE).to_empty(device=DEVICE)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary.init_tables(DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm weights
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=DEVICE))
            else:
                p.normal_(0.0, p.shape[1] ** -0.5 if "embed" not in name else 1.0,
                          generator=gen)
    return model.eval().requires_grad_(False)


class Rig:
    """KV pool, slot table and attention backend holding ``bs`` sequences of CONTEXT - 1
    cached tokens at scattered locations, and the decode batch appending one to each."""

    def __init__(self, spec: Any, bs: int) -> None:
        self.spec = spec
        locations = (bs + 1) * MAX_CONTEXT
        self.pool = KVPool(spec.num_layers, locations, spec.num_kv_heads, spec.head_dim,
                           DTYPE, DEVICE)
        self.pool.k_buffer.normal_()
        self.pool.v_buffer.normal_()
        self.table = ReqToTokenTable(bs + 1, MAX_CONTEXT, DEVICE)
        perm = torch.randperm(locations, device=DEVICE).to(torch.int32) + 1
        self.table.device_table.copy_(perm.view(bs + 1, MAX_CONTEXT))
        shape = AttentionShape(spec.num_heads, spec.num_kv_heads, spec.head_dim,
                               spec.attn_scale)
        self.attn = TritonBackend(shape, self.pool, self.table)
        exts = tuple(Extension(f"s{i}", i, CONTEXT - 1, 1, False) for i in range(bs))
        out_loc = self.table.device_table[:bs, CONTEXT - 1].to(torch.int64).cpu()
        ids = torch.randint(0, spec.vocab_size, (bs,)).tolist()
        self.batch = ForwardBatch.build("decode", ids, Allocation(exts, out_loc),
                                        list(range(bs)), DEVICE, MAX_CONTEXT)
        self.meta = self.attn.build_metadata(self.batch)


def kernel_counts(fn: Callable[[], object]) -> tuple[int, list[dict[str, Any]]]:
    """Kernel launches of one call of ``fn`` (after a warm-up call) and the largest."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"
               and not e.name.startswith(("Memcpy", "Memset"))]
    counts = Counter(e.name for e in kernels)
    us: Counter[str] = Counter()
    for e in kernels:
        us[e.name] += e.time_range.elapsed_us()
    top = [{"name": n[:90], "count": counts[n], "us_total": round(t, 1)}
           for n, t in us.most_common(10)]
    return len(kernels), top


def measure_choice(model: CausalLM, rigs: dict[int, Rig], choice: KernelChoice
                   ) -> dict[str, Any]:
    model.kernels = choice
    out: dict[str, Any] = {"kernels": choice, "steps": {}}
    for bs, rig in rigs.items():
        b = rig.batch

        def step(rig: Rig = rig, b: ForwardBatch = b) -> torch.Tensor:
            return model.compute_logits(model(b.input_ids, b.positions, rig.attn, rig.meta))

        n, top = kernel_counts(step)
        out["steps"][bs] = {"step_graph_ms": graph_ms(step), "kernels_per_step": n,
                            "top_kernels": top}
    # One decoder layer at batch 1, with a residual (any layer after the first).
    rig = rigs[1]
    layer = model.layers[3]
    hidden = torch.randn(1, model.spec.hidden_size, dtype=DTYPE, device=DEVICE)
    residual = torch.randn_like(hidden)
    ops = select_ops(choice, hidden)

    def one_layer() -> object:
        return layer(rig.batch.positions, hidden, residual, rig.attn, rig.meta, ops)

    out["layer_graph_ms"] = graph_ms(one_layer)
    out["layer_eager_ms"] = hardware.time_ms(lambda: [one_layer() for _ in range(50)],
                                             repeats=10) / 50
    out["layer_kernels"] = kernel_counts(one_layer)[0]
    return out


def logits_tail(model: CausalLM) -> dict[str, float]:
    """At batch 1: the lm_head GEMM alone, with a float32 cast after it, and with the GEMM
    writing float32 directly (``out_dtype``, where this torch has it)."""
    h = torch.randn(1, model.spec.hidden_size, dtype=DTYPE, device=DEVICE)
    w = model.lm_head.weight
    res = {"lm_head_ms": graph_ms(lambda: model.lm_head(h)),
           "lm_head_float_ms": graph_ms(lambda: model.lm_head(h).float())}
    try:
        res["mm_out_dtype_f32_ms"] = graph_ms(lambda: torch.mm(h, w.t(), out_dtype=torch.float32))
    except (TypeError, RuntimeError) as exc:
        print(f"mm(out_dtype=float32) unavailable: {exc}")
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", default="results-local")
    parser.add_argument("--batches", default="1,8")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.kernels.layer_kernels needs a CUDA device", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    spec = shapes.spec("llama-3.2-1b")
    model = build_model(spec)
    rigs = {bs: Rig(spec, bs) for bs in (int(b) for b in args.batches.split(","))}
    bandwidth = hardware.read_bandwidth_gbs()
    weight_bytes = shapes.weight_bytes("llama-3.2-1b")
    with torch.inference_mode():
        results: dict[str, Any] = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "read_bandwidth_gbs": bandwidth,
            "floor_ms": weight_bytes / (bandwidth * 1e9) * 1e3,
            "context": CONTEXT,
            "choices": [measure_choice(model, rigs, c) for c in ("torch", "auto")],
            "logits_tail": logits_tail(model),
        }
    (out / "kernels.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results["choices"][1]["steps"], indent=1)[:3000])
    print(f"\n{results['device']}  read {bandwidth:.0f} GB/s  floor "
          f"{results['floor_ms']:.3f} ms/step  tail {results['logits_tail']}")
    print(f"{'kernels':8} {'bs':>3} {'graph ms/step':>14} {'kernels/step':>13}")
    for c in results["choices"]:
        for bs, s in c["steps"].items():
            print(f"{c['kernels']:8} {bs:>3} {s['step_graph_ms']:14.3f} "
                  f"{s['kernels_per_step']:13d}")
    for c in results["choices"]:
        print(f"layer bs1 {c['kernels']:6} graph {c['layer_graph_ms'] * 1e3:7.1f} us  eager "
              f"{c['layer_eager_ms'] * 1e3:7.1f} us  kernels {c['layer_kernels']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
