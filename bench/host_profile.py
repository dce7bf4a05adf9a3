"""Where the host time of a graph decode step goes: ``python -m bench.host_profile``.

Uses the embedded tiny model on CUDA, so the graph replay itself is short and the step
time is mostly host work; prints the step and replay medians and a cProfile of the
executor's own functions over many steps.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time

import torch

from executor.api import DecodeItem, PrefillItem
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig


def main() -> int:
    from executor.executor import Executor

    for bs in (1, 64):
        ex = Executor(ExecutorConfig(
            model=ModelConfig(source="tiny", dtype="bfloat16"), device="cuda",
            cache=CacheConfig(kv_tokens=64 * 1024, max_sequences=64, max_context=2048),
            graphs=GraphConfig(decode_mode="full", prefill_mode="disabled"),
            max_decode_batch=64))
        ex.capture(["decode"])
        toks = {}
        for start in range(0, bs, 16):
            res = ex.prefill([PrefillItem(f"s{i}", list(range(1, 200)))
                              for i in range(start, min(bs, start + 16))])
            toks.update({o.seq_id: int(o.token_id) for o in res.outputs})  # type: ignore[arg-type]

        def run(n: int, ex: Executor = ex) -> list[float]:
            nonlocal toks
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                r = ex.decode([DecodeItem(s, t) for s, t in toks.items()])
                times.append((time.perf_counter() - t0) * 1e3)
                toks = {o.seq_id: int(o.token_id) for o in r.outputs}  # type: ignore[arg-type]
            return times

        run(50)
        ex.drain_replay_seconds()
        times = run(300)
        torch.cuda.synchronize()
        replays = ex.drain_replay_seconds()["decode"]
        print(f"bs={bs}: step median {statistics.median(times):.3f} ms, replay median "
              f"{statistics.median(replays) * 1e3:.3f} ms")
        prof = cProfile.Profile()
        prof.enable()
        run(300)
        prof.disable()
        stats = pstats.Stats(prof)
        stats.sort_stats("cumtime").print_stats(r"executor/|torch/cuda|{method|{built-in", 28)
    return 0


if __name__ == "__main__":
    sys.exit(main())
