"""Where the host time of a graph step goes: ``python -m bench.host_profile``.

For each case (a phase, a graph mode, a size) on a model: the median wall time of one
``Executor`` call, the GPU time of the same call (the sum of its kernels' durations from
the torch profiler), and the executor's own Python functions by cumulative time (cProfile
over many calls). A step whose wall time is well above its GPU time is host-bound: the
cProfile lines say where that host time goes.

    python -m bench.host_profile                          # tiny: decode bs 1 and 64
    python -m bench.host_profile --model llama-3.2-1b --case prefill:breakable:128 \\
        --case decode:full:1
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from executor.api import DecodeItem, PrefillItem
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from executor.executor import Executor


def _executor(source: str, phase: str, mode: str, size: int, attention: str) -> Executor:
    mode, _, compiler = mode.partition("/")
    graphs = GraphConfig(decode_mode=mode if phase == "decode" else "disabled",  # type: ignore[arg-type]
                         prefill_mode=mode if phase == "prefill" else "disabled",  # type: ignore[arg-type]
                         compiler=compiler or "eager")  # type: ignore[arg-type]
    ex = Executor(ExecutorConfig(
        model=ModelConfig(source=source, dtype="bfloat16"), device="cuda",
        cache=CacheConfig(kv_tokens=64 * 1024, max_sequences=max(64, size),
                          max_context=4096),
        graphs=graphs, attention_backend=attention,  # type: ignore[arg-type]
        max_decode_batch=max(64, size), max_prefill_tokens=max(4096, size)))
    return ex


def _step_fn(ex: Executor, phase: str, size: int, seqs: int) -> Callable[[], None]:
    """One call of the case; decode keeps ``size`` sequences going, prefill admits and
    releases ``seqs`` sequences sharing ``size`` tokens."""
    vocab = ex.model_info.vocab_size
    if phase == "prefill":
        tokens = torch.randint(0, vocab, (size,), generator=torch.Generator().manual_seed(0))
        ids = tokens.tolist()
        per = [size // seqs + (1 if i < size % seqs else 0) for i in range(seqs)]
        parts = [ids[sum(per[:i]) : sum(per[: i + 1])] for i in range(seqs)]
        counter = [0]

        def prefill() -> None:
            counter[0] += 1
            items = [PrefillItem(f"p{counter[0]}-{i}", part) for i, part in enumerate(parts)]
            ex.prefill(items)
            ex.release([it.seq_id for it in items])

        return prefill
    toks: dict[str, int] = {}
    for start in range(0, size, 16):
        res = ex.prefill([PrefillItem(f"s{i}", list(range(1, 200)))
                          for i in range(start, min(size, start + 16))])
        toks.update({o.seq_id: int(o.token_id) for o in res.outputs})  # type: ignore[arg-type]

    def decode() -> None:
        r = ex.decode([DecodeItem(s, t) for s, t in toks.items()])
        toks.update({o.seq_id: int(o.token_id) for o in r.outputs})  # type: ignore[arg-type]

    return decode


def _gpu_ms(step: Callable[[], None], calls: int = 20) -> float:
    """Median per call of the summed kernel time (device busy time, if kernels never
    overlap, which holds on one stream)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / calls / 1e3


def profile_case(source: str, case: str, calls: int, attention: str) -> str:
    phase, mode, size_s = case.split(":")
    size_part, _, seqs_part = size_s.partition("x")
    size, seqs = int(size_part), int(seqs_part or 1)
    ex = _executor(source, phase, mode, size, attention)
    caps = ex.capture(ex.startup_phases())
    step = _step_fn(ex, phase, size, seqs)
    for _ in range(20):
        step()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    gpu = _gpu_ms(step)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(r"executor/|bench/|torch/|triton/|flashinfer/|{", 30)
    head = (f"{case} ({ex.model_info.attention_backend}) on {source}: call median "
            f"{statistics.median(times):.3f} ms, GPU kernel time {gpu:.3f} ms/call, "
            f"{calls} calls profiled (release included for prefill); capture "
            + ", ".join(f"{c.phase} {len(c.buckets)} buckets {c.memory_bytes / 2**20:.0f} MiB "
                        f"{c.total_ms / 1e3:.1f} s" for c in caps))
    for runner in ex.runners.values():  # tc_piecewise: did anything recompile?
        backend = getattr(runner, "backend", None)
        if hasattr(backend, "stats"):
            head += (f"\n  compile stats: {vars(backend.stats)}; direct replays "  # type: ignore[union-attr]
                     f"{len(backend.direct_replays())} of {len(backend.captured())}")  # type: ignore[union-attr]
    del ex
    torch.cuda.empty_cache()
    return head + "\n" + buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", default="tiny", help="tiny, or a bench shape name")
    ap.add_argument("--case", action="append",
                    help="phase:mode[/compiler]:size[xSEQS] (repeatable), e.g. "
                         "prefill:tc_piecewise/inductor:512x8")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--attention", default="triton", help="attention backend (or auto)")
    ap.add_argument("--models", type=Path, default=Path("/tmp/model-executor-bench"))
    args = ap.parse_args(argv)
    source = args.model
    if source != "tiny":
        from bench import shapes

        source = str(shapes.write_shape(source, args.models))
    cases = args.case or ["decode:full:1", "decode:full:64"]
    heads = []
    for case in cases:
        report = profile_case(source, case, args.calls, args.attention)
        heads.append("\n".join(line for line in report.splitlines()[:2]
                               if not line.startswith(" ") or "compile stats" in line))
        print(report, flush=True)
    print("\n".join(heads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
