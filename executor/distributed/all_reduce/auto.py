"""``--tp-all-reduce auto``: time every algorithm at start-up and share the sizes out.

Every path that can be set up, and NCCL, is timed inside a CUDA graph (as a decode graph
runs them: no launch gaps, the ranks meeting at each call) at ``AUTO_PROBE_BYTES``. The
ranks agree on the slowest rank's time for each (algorithm, size); ``size_plan`` gives each
size to the fastest and everything from the first size NCCL wins at to NCCL.
``all_reduce_choice`` is the report Health and the start-up log show.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from executor.distributed import collectives
from executor.distributed.all_reduce.paths import AllReducePath
from executor.distributed.collectives import collective
from executor.distributed.group import TensorParallel, all_reduce_algorithm
from executor.timing import replay_us

#: What "auto" times the algorithms at: (1, 8, 64) rows of a 4096-wide bf16 activation.
AUTO_PROBE_BYTES = (8 * 1024, 64 * 1024, 512 * 1024)
#: All-reduces per captured graph, and timed replays, of one probe.
_PROBE_REPEATS, _PROBE_REPLAYS = 16, 12


def size_plan(sizes: Sequence[int], times_us: Mapping[str, Sequence[float]]
              ) -> list[tuple[str, int]]:
    """"auto"'s plan from probe times by algorithm (``"nccl"`` among them) at ``sizes``
    (ascending, bytes): ``(algorithm, up to bytes)`` ranges of the one-shot algorithms,
    smallest sizes first. At each size the fastest wins, a tie going to NCCL; from the
    first size NCCL wins at, everything larger goes to NCCL (the one-shot kernels read
    every peer's whole input, which scales worst)."""
    plan: list[tuple[str, int]] = []
    for i, size in enumerate(sizes):
        best = min(times_us, key=lambda algo: (times_us[algo][i], algo != "nccl"))
        if best == "nccl":
            break
        if plan and plan[-1][0] == best:
            plan[-1] = (best, size)
        else:
            plan.append((best, size))
    return plan


def choose(tp: TensorParallel, nccl_us: list[float], paths: dict[str, AllReducePath]
           ) -> tuple[AllReducePath, ...]:
    """Time each of ``paths`` (set up on every rank) alone and return the paths of the plan
    against them and NCCL (``nccl_us``, timed before any path was set up), each sized to
    its range; the probe times and the plan go to the group's report."""
    st = collectives.state(tp.device_group_name)
    assert st is not None
    times = {"nccl": nccl_us}
    for algo, path in paths.items():
        st.paths = (path,)
        times[algo] = probe_us(tp)
    st.paths = ()
    algos = list(times)
    local = torch.tensor([times[a] for a in algos], dtype=torch.float64, device=tp.device)
    with collective("agreement"):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=st.group)
    slowest = {a: [float(t) for t in row] for a, row in zip(algos, local.tolist(), strict=True)}
    plan = size_plan(AUTO_PROBE_BYTES, slowest)
    st.report.update(probe_bytes=list(AUTO_PROBE_BYTES),
                     **{f"{a}_us": [round(t, 2) for t in times[a]] for a in algos},
                     slowest_rank_us=slowest,
                     plan=[{"algorithm": a, "up_to_bytes": b} for a, b in plan])
    lows = [0] + [b for _, b in plan[:-1]]
    return tuple(paths[a].sized(lo, hi) for (a, hi), lo in zip(plan, lows, strict=True))


def probe_us(tp: TensorParallel) -> list[float]:
    """This rank's median µs of one all-reduce of each ``AUTO_PROBE_BYTES`` through the
    group's current paths, inside a CUDA graph."""
    times = []
    for nbytes in AUTO_PROBE_BYTES:
        inputs = [torch.zeros(nbytes // 2, dtype=torch.bfloat16, device=tp.device)
                  for _ in range(_PROBE_REPEATS)]
        side = torch.cuda.Stream(tp.device)
        side.wait_stream(torch.cuda.current_stream(tp.device))
        with torch.cuda.stream(side):
            tp.all_reduce(inputs[0])  # warm-up outside the capture
        torch.cuda.current_stream(tp.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for x in inputs:
                tp.all_reduce(x)
        times.append(replay_us(graph, _PROBE_REPEATS, _PROBE_REPLAYS - 2))
        del graph
    return times


def all_reduce_choice(tp: TensorParallel) -> dict[str, object]:
    """What was asked, what runs (``all_reduce_algorithm``), the largest size a one-shot
    path takes, whether projections send, and, under "auto", this rank's probe times by
    algorithm and the plan made from the slowest rank's."""
    out: dict[str, object] = {"algorithm": all_reduce_algorithm(tp)}
    st = collectives.state(tp.device_group_name)
    if st is not None:
        out.update(st.report)
        if st.paths:
            out["one_shot_max_bytes"] = max(p.max_bytes for p in st.paths)
    return out
