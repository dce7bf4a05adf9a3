"""Decode attention alone: the Triton kernels (split, and reduce or the in-kernel merge) by
batch, context and split count: ``python -m bench.kernels.decode_attention --shape
smollm2-135m``. ``--merge both`` times each several-split case twice: as the launcher picks
(the last split merges where ``splits.split_counters`` serves it) and with the reduction
kernel (``merge=False``).

Each case is ``decode_attention`` as the model calls it (without the fused RoPE; one new
token per sequence, page size 1, each sequence's locations contiguous), ``CALLS`` calls in
one CUDA graph over ``POOLS`` KV pools in turn, PDL off: median microseconds per call over
``REPLAYS`` replays, and the KV bytes read per microsecond. Where the pools together
exceed L2 each call reads from HBM; small cases stay in L2, as a small model's KV of all
layers does across steps. ``--splits shipped`` is the count a decode graph bucket of that
batch picks for ``--max-context`` (``num_kv_splits``). What it cannot show is how a kernel
overlaps its neighbours inside the step under PDL: for that, ``bench.profile.kernel_table``.
``--out DIR`` also writes ``decode_attention-SHAPE.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: Calls captured back to back in one graph, KV pools they rotate over, replays timed.
CALLS, POOLS, REPLAYS = 16, 4, 20


@dataclass(frozen=True)
class Case:
    """One timed configuration (heads of one tensor-parallel rank)."""

    batch: int
    context: int  # tokens per sequence, the new one included
    splits: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def kv_bytes(self) -> int:
        """K and V bytes the call reads (bf16, every cached token once per KV head)."""
        return 2 * 2 * self.batch * (self.context - 1) * self.kv_heads * self.head_dim


def plan(heads: int, kv_heads: int, head_dim: int, batches: list[int], contexts: list[int],
         splits: list[str], max_context: int, num_sms: int) -> list[Case]:
    """The cases to time: every batch x context x split count, ``"shipped"`` resolved to
    what ``num_kv_splits`` gives a bucket of that batch; a context over ``max_context`` or
    a count under 1 or over ``MAX_SPLITS`` is an error (the kernels' own limits)."""
    from executor.attention.triton_kernels.decode import MAX_SPLITS, num_kv_splits

    out: list[Case] = []
    for batch in batches:
        for context in contexts:
            if not 2 <= context <= max_context:
                raise ValueError(f"context {context} outside 2..{max_context}")
            for s in splits:
                n = num_kv_splits(batch, kv_heads, max_context, num_sms) if s == "shipped" \
                    else int(s)
                if not 1 <= n <= MAX_SPLITS:
                    raise ValueError(f"{n} splits outside 1..{MAX_SPLITS}")
                case = Case(batch, context, n, heads, kv_heads, head_dim)
                if case not in out:
                    out.append(case)
    return out


def time_case(case: Case, merge: bool | None = None) -> float:
    """Median microseconds per call of ``case`` on the current CUDA device (``merge``:
    ``decode_attention``'s)."""
    import torch

    from bench.common.timing import weights_replay_us
    from executor.attention.triton_kernels import decode as d

    dev = torch.device("cuda")
    b, ctx, kvh, hd = case.batch, case.context, case.kv_heads, case.head_dim
    gen = torch.Generator(device=dev).manual_seed(0)
    locs = b * ctx + 1  # location 0 is the padding cell

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=gen)

    # Each pool's K and V as one (2, locations, kv_heads, head_dim) tensor: their views
    # share strides, as the kernel requires.
    pools = [rand(2, locs, kvh, hd) for _ in range(POOLS)]
    table = torch.arange(1, locs, device=dev, dtype=torch.int32).view(b, ctx)
    lens = torch.full((b,), ctx, device=dev, dtype=torch.int64)
    slots = torch.arange(b, device=dev)
    new_loc = table[:, ctx - 1].long()
    q, k_new, v_new = rand(b, case.heads, hd), rand(b, kvh, hd), rand(b, kvh, hd)
    out = torch.empty_like(q)
    mid_o = torch.empty(b, case.heads, case.splits, hd, device=dev) if case.splits > 1 \
        else None
    mid_lse = torch.empty(b, case.heads, case.splits, device=dev) if case.splits > 1 else None

    def call(kv: torch.Tensor) -> None:
        d.decode_attention(q, k_new, v_new, kv[0], kv[1], table, slots, lens, new_loc, out,
                           mid_o, mid_lse, hd ** -0.5, merge=merge)

    return weights_replay_us(call, [pools[i % POOLS] for i in range(CALLS)], REPLAYS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--shape", default="llama-3.2-1b", help="a bench.common.shapes name")
    ap.add_argument("--tp", type=int, default=1, help="the heads of one of this many ranks")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--contexts", default="512,2048,4000")
    ap.add_argument("--splits", default="shipped",
                    help="comma-separated counts and/or 'shipped' (default: %(default)s)")
    ap.add_argument("--max-context", type=int, default=4096,
                    help="the bucket's context limit 'shipped' splits for")
    ap.add_argument("--merge", choices=("auto", "off", "both"), default="auto",
                    help="several splits: the launcher's pick, the reduction kernel, or both")
    ap.add_argument("--out", type=Path, help="write decode_attention-SHAPE.json here")
    args = ap.parse_args(argv)

    import torch

    from bench.common import shapes
    from bench.common.meta import git_commit
    from executor.weights.sharding import local_spec

    spec = local_spec(shapes.spec(args.shape), args.tp)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = plan(spec.num_heads, spec.num_kv_heads, spec.head_dim,
                 [int(x) for x in args.batches.split(",")],
                 [int(x) for x in args.contexts.split(",")], args.splits.split(","),
                 args.max_context, sms)
    rows: list[dict[str, Any]] = []
    modes: list[bool | None] = [None, False] if args.merge == "both" else \
        [False] if args.merge == "off" else [None]
    for case in cases:
        for merge in modes if case.splits > 1 else [None]:
            us = time_case(case, merge)
            name = "reduce kernel" if merge is False else "auto"
            rows.append({**asdict(case), "merge": name, "us": us,
                         "tb_s": case.kv_bytes / us / 1e6})
            print(f"batch {case.batch:3} context {case.context:5} splits {case.splits:2} "
                  f"kv_heads {case.kv_heads} [{name}]: {us:7.2f} us  "
                  f"{case.kv_bytes / us / 1e6:5.2f} TB/s", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"shape": args.shape, "tp": args.tp, "device": torch.cuda.get_device_name(),
                "torch": torch.__version__, "max_context": args.max_context,
                "commit": git_commit(),
                "date": datetime.date.today().isoformat(), "calls": CALLS, "pools": POOLS}
        (args.out / f"decode_attention-{args.shape}.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
