"""Where the time of a graph step goes: ``python -m bench.profile.host_profile``.

For each case (a phase, a graph mode, a size) on a model: the median wall time of one
``Executor`` call and its GPU time (kernels' summed durations and the idle gaps between
them; ``--kernels N``: the top N kernels and gaps); host time per stage of a call
(validate, allocate, build_batch, metadata, replay, logits, sample, complete, release);
capture memory per bucket and per allocator pool; the executor's Python functions by time
(cProfile). A call whose wall time is well above its GPU time is host-bound. Prints its
report; nothing is written.

    python -m bench.profile.host_profile                  # tiny: decode bs 1 and 64
    python -m bench.profile.host_profile --model llama-3.2-1b --case prefill:breakable:128 \\
        --case decode:full:1 --kernels 15 --warm-first
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import hardware
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


@dataclass
class GpuTime:
    """Device time of one call: kernels' summed durations, the idle time between kernels
    of the same call (gaps under ``_CALL_GAP_US``), the top kernels by time and where the
    idle time sits (which kernel ends and which begins around each gap)."""

    busy_ms: float
    idle_ms: float
    kernels: list[tuple[str, float, float]]  # (name, launches per call, µs per call)
    gaps: list[tuple[str, float, float]]  # ("before -> after", gaps per call, µs per call)


_CALL_GAP_US = 100.0  # a longer device gap is taken as the space between two calls


def _gpu_time(step: Callable[[], None], calls: int = 20) -> GpuTime:
    """Per call: kernel time (device busy time, if kernels never overlap, which holds on
    one stream), idle gaps between its kernels (host not keeping ahead), top kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    idle_us = 0.0
    by_pair: dict[str, list[float]] = {}
    for a, b in itertools.pairwise(kernels):
        gap = b.time_range.start - a.time_range.end
        if 0 < gap < _CALL_GAP_US:
            idle_us += gap
            by_pair.setdefault(f"{_short(a.name)} -> {_short(b.name)}", []).append(gap)
    gaps = sorted(((pair, len(g) / calls, sum(g) / calls) for pair, g in by_pair.items()),
                  key=lambda row: row[2], reverse=True)
    top = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
    table = [(e.key, e.count / calls, e.self_device_time_total / calls)
             for e in top if e.self_device_time_total > 0]
    busy_us = sum(us for _, _, us in table)  # per call
    return GpuTime(busy_us / 1e3, idle_us / calls / 1e3, table, gaps)


def _short(kernel: str) -> str:
    """A kernel name without its template arguments: ``nvjet_sm90_tst_...``, ``_rope_kernel``,
    ``elementwise_kernel``."""
    name = kernel.split("<", 1)[0].split("(", 1)[0]
    return name.rsplit("::", 1)[-1][:40]


def _kernel_table(gpu: GpuTime, rows: int) -> str:
    lines = [f"  {'us/call':>8} {'n/call':>6}  kernel"]
    lines += [f"  {us:8.1f} {n:6.1f}  {name[:110]}" for name, n, us in gpu.kernels[:rows]]
    lines += [f"  {'idle us':>8} {'n/call':>6}  between (kernel that ends -> kernel that starts)"]
    lines += [f"  {us:8.1f} {n:6.1f}  {pair}" for pair, n, us in gpu.gaps[:rows]]
    return "\n".join(lines) + "\n"


class StageClock:
    """Host time per stage of a step, by wrapping the executor's own calls in place.

    Launches return before the GPU finishes, so each stage's time is host work, except
    ``complete``, which waits for the step's device work and the tokens' copy to the host:
    a stage list whose sum before ``complete`` is well below the GPU time is GPU-bound."""

    def __init__(self, ex: Executor) -> None:
        import executor.executor as ex_module

        self.times: dict[str, list[float]] = {}
        runner: Any = ex.runners.get("prefill") or ex.runners.get("decode")  # a GraphRunner
        targets: list[tuple[Any, str, str]] = [
            (ex_module, "validate_prefill", "validate"), (ex_module, "validate_decode", "validate"),
            (ex.kv, "allocate", "allocate"), (ex.forward, "build_batch", "build_batch"),
            (ex.attn, "build_metadata", "metadata"), (ex.attn, "refresh_metadata", "metadata"),
            (ex.model, "compute_logits", "logits"), (ex.sampler, "sample", "sample"),
            (ex, "complete", "complete"), (ex, "release", "release")]
        if runner is not None:
            targets += [(runner.backend, "replay", "replay")]
        for obj, attr, stage in targets:
            setattr(obj, attr, self._timed(getattr(obj, attr), stage))

    def _timed(self, fn: Callable[..., Any], stage: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times.setdefault(stage, []).append(time.perf_counter() - t0)
        return timed

    def report(self, calls: int, call_s: list[float]) -> str:
        per_call = {k: sum(v) / calls * 1e6 for k, v in self.times.items()}
        other = statistics.median(call_s) * 1e6 - sum(per_call.values())
        return "  host stages (us per call): " + ", ".join(
            f"{k} {v:.0f}" for k, v in per_call.items()) + f", other {other:.0f}"


def _reserved_by_pool() -> dict[str, int]:
    """Bytes the caching allocator holds per memory pool: ``default`` and one entry per
    CUDA-graph pool (what the captured graphs keep reserved)."""
    pools: dict[str, int] = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        key = "default" if pool == (0, 0) else f"graph pool {pool}"
        pools[key] = pools.get(key, 0) + seg["total_size"]
    return pools


def profile_case(source: str, case: str, calls: int, attention: str, kernels: int = 0,
                 warm_first: bool = False) -> str:
    phase, mode, size_s = case.split(":")
    size_part, _, seqs_part = size_s.partition("x")
    size, seqs = int(size_part), int(seqs_part or 1)
    ex = _executor(source, phase, mode, size, attention)
    if warm_first:  # one eager step first: lazy kernel loads are not counted as graphs'
        _step_fn(ex, phase, size, seqs)()
        torch.cuda.empty_cache()
    caps = ex.capture(ex.startup_phases())
    pools = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in _reserved_by_pool().items())
    step = _step_fn(ex, phase, size, seqs)
    for _ in range(20):
        step()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    gpu = _gpu_time(step)
    clock = StageClock(ex)
    stage_times = []
    torch.cuda.synchronize()
    ex.drain_replay_seconds()
    for _ in range(calls):
        t0 = time.perf_counter()
        step()
        stage_times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    stages = clock.report(calls, stage_times)
    # A replay whose host issue time reaches its GPU span kept the GPU waiting on the host.
    spans = [s for runs in ex.drain_replay_seconds().values() for s in runs]
    if spans and "replay" in clock.times:
        stages += (f"\n  replay: host issue {statistics.median(clock.times['replay']) * 1e6:.0f} "
                   f"us, GPU span {statistics.median(spans) * 1e6:.0f} us (CUDA events)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(r"executor/|bench/|torch/|triton/|flashinfer/|{", 30)
    head = (f"{case} ({ex.model_info.attention_backend}) on {source}: call median "
            f"{statistics.median(times):.3f} ms, GPU kernel time {gpu.busy_ms:.3f} ms/call "
            f"(idle between its kernels {gpu.idle_ms:.3f} ms), "
            f"{calls} calls profiled (release included for prefill); capture "
            + ", ".join(f"{c.phase} {len(c.buckets)} buckets {c.memory_bytes / 2**20:.0f} MiB "
                        f"{c.total_ms / 1e3:.1f} s" for c in caps)
            + f"\n{stages}\n  reserved after capture: {pools}"
            + "".join(f"\n  {c.phase} MiB per bucket: " + " ".join(
                f"{b.size}:{b.memory_bytes / 2**20:.1f}" for b in reversed(c.buckets))
                for c in caps))
    for runner in ex.runners.values():  # tc_piecewise: did anything recompile?
        backend = getattr(runner, "backend", None)
        if hasattr(backend, "stats"):
            head += (f"\n  compile stats: {vars(backend.stats)}; direct replays "  # type: ignore[union-attr]
                     f"{len(backend.direct_replays())} of {len(backend.captured())}")  # type: ignore[union-attr]
    del ex
    hardware.release_memory()
    table = _kernel_table(gpu, kernels) if kernels else ""
    return head + "\n" + table + buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", default="tiny", help="tiny, or a bench shape name")
    ap.add_argument("--case", action="append",
                    help="phase:mode[/compiler]:size[xSEQS] (repeatable), e.g. "
                         "prefill:tc_piecewise/inductor:512x8")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="also list the N kernels with the most GPU time per call")
    ap.add_argument("--warm-first", action="store_true",
                    help="run one eager step before capturing (as a warmed-up server)")
    ap.add_argument("--attention", default="triton", help="attention backend (or auto)")
    ap.add_argument("--models", type=Path, default=Path("/tmp/model-executor-bench"))
    args = ap.parse_args(argv)
    source = args.model
    if source != "tiny":
        from bench.common import shapes

        source = str(shapes.write_shape(source, args.models))
    cases = args.case or ["decode:full:1", "decode:full:64"]
    heads = []
    for case in cases:
        report = profile_case(source, case, args.calls, args.attention, args.kernels,
                              args.warm_first)
        heads.append("\n".join(line for line in report.splitlines()[:6]
                               if not line.startswith(" ") or "compile stats" in line
                               or "reserved after" in line or "host stages" in line
                               or "replay: host" in line))
        print(report, flush=True)
    print("\n".join(heads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
