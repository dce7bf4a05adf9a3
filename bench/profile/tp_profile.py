"""Tensor-parallel decode steps seen from every rank: ``python -m bench.profile.tp_profile``.

    python -m bench.profile.tp_profile --model llama-3.1-8b --tp 2 [--batches 1,8,64]

``bench.e2e.tensor_parallel`` times the step on rank 0 only; this says whether the ranks'
kernels are slower at their width or one rank waits for another. The executor runs on
``--tp`` child ranks (rank 0 drives decode steps, the others follow as a server's do). Per
batch, ``--steps`` unprofiled steps give host timestamps on every rank (one monotonic clock
per host: each rank's forward call against rank 0's, the skew), then as many profiled
steps give every rank's kernel table (``bench.profile.kernel_classes``, with
``collective``) and its first collective, where a rank that started early waits for the
last. The floor per rank is weight bytes / N plus its KV bytes over GPU 0's read
bandwidth. Writes ``tp_profile.json``, ``tp_profile.md`` and ``rank*.json`` to ``--out``
(default ``results-local``). On CPU (gloo, ``--model tiny``) only the host timestamps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common.meta import git_commit
from bench.profile.kernel_classes import CLASSES, Kernel, name_class, step_table

TIMEOUT = datetime.timedelta(minutes=10)


def _config(source: str, device: str, contexts: int, load_format: str = "safetensors"
            ) -> Any:
    from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig

    cuda = device.startswith("cuda")
    return ExecutorConfig(
        model=ModelConfig(source=source, dtype="bfloat16" if cuda else "float32",
                          load_format=load_format),  # type: ignore[arg-type]
        device=device,
        cache=CacheConfig(kv_tokens=64 * (contexts + 64), max_sequences=72,
                          max_context=contexts + 64),
        graphs=GraphConfig(decode_mode="full" if cuda else "disabled",
                           prefill_mode="disabled", decode_buckets=(1, 8, 64)),
        attention_backend="triton" if cuda else "torch_native", max_decode_batch=64,
        max_prefill_tokens=8192)


def _profiled(fn: Callable[[], None], cuda: bool) -> list[Kernel]:
    """The device kernels of ``fn`` (``kernel_table.profile_step``); without ``cuda``,
    ``fn`` only runs."""
    if not cuda:
        fn()
        return []
    from bench.profile.kernel_table import profile_step

    return profile_step(fn)


class _Stamps:
    """Per step header (in broadcast order): when it was sent or received and when the
    forward was called, on this rank's ``perf_counter``."""

    def __init__(self, ex: Any) -> None:
        self.headers = 0
        self.sent: dict[int, float] = {}
        self.forward: dict[int, float] = {}
        channel, forward = ex.channel, ex.forward.run
        send = channel.send

        def stamped_send(header: Any, packed: Any = None) -> None:
            self.sent[self.headers] = time.perf_counter()
            self.headers += 1
            send(header, packed)

        def stamped_forward(*args: Any, **kwargs: Any) -> Any:
            self.forward[self.headers - 1] = time.perf_counter()
            return forward(*args, **kwargs)

        channel.send = stamped_send
        ex.forward.run = stamped_forward


def _lead(ex: Any, store: Any, stamps: _Stamps, batches: list[int], steps: int,
          context: int, cuda: bool) -> dict[str, Any]:
    """Rank 0: per batch, warm-up steps, ``steps`` timed ones (no profiler anywhere: the
    host timestamps and rank 0's call time), then ``steps`` profiled ones on every rank.
    Each measured step starts once every other rank waits for it (``ready``); the other
    ranks read the ``profile`` switch before that, so one unmeasured step follows each
    switch."""
    from bench.profile.kernel_table import case_step

    def measured(fn: Callable[[], None], profile: bool) -> dict[str, Any]:
        store.wait([f"ready{stamps.headers}"])
        started = time.perf_counter()
        kernels = _profiled(fn, profile)
        return {"header": stamps.headers - 1, "kernels": kernels,
                "call_us": (time.perf_counter() - started) * 1e6}

    cases: dict[str, Any] = {}
    for batch in batches:
        store.set("profile", "0")
        step = case_step(ex, "decode", batch, context, f"b{batch}")
        for _ in range(5):
            step()
        timed = [measured(step, False) for _ in range(steps)]
        store.set("profile", "1" if cuda else "0")
        step()
        profiled = [measured(step, cuda) for _ in range(steps)]
        cases[str(batch)] = {"timed": timed, "profiled": profiled}
        ex.release([f"b{batch}s{i}" for i in range(batch)])  # case_step's sequences
    return cases


def _follow(ex: Any, store: Any, stamps: _Stamps, cuda: bool) -> dict[int, list[Kernel]]:
    """Another rank: the follower's loop, each header received under the profiler while
    rank 0's ``profile`` switch is on."""
    from executor import follower
    from executor.distributed.protocol import CaptureHeader, ForkHeader, StepHeader

    channel = ex.channel
    kernels: dict[int, list[Kernel]] = {}
    received = [0]
    while True:
        index = received[0]
        out: dict[str, Any] = {}

        def one(index: int = index, out: dict[str, Any] = out) -> None:
            store.set(f"ready{index}", "1")  # rank 0 waits for it before a measured step
            header, packed = channel.receive()
            received[0] += 1
            stamps.sent[index] = time.perf_counter()  # received, on this rank
            stamps.headers = index + 1
            out["header"] = header
            if isinstance(header, StepHeader):
                follower.follow_step(ex, header, packed)
            elif isinstance(header, CaptureHeader):
                ex.capture(header.phases, header.force)
            elif isinstance(header, ForkHeader):
                follower.follow_fork(ex, header)

        # NOTE: never a profiler around graph capture (the switch is off until after it).
        profile = cuda and store.check(["profile"]) and store.get("profile") == b"1"
        kernels[index] = _profiled(one, profile)
        if not isinstance(out["header"], (StepHeader, CaptureHeader, ForkHeader)):
            return kernels


def rank_main(rank: int, size: int, port: int, source: str, device: str, batches: list[int],
              steps: int, context: int, out: str, load_format: str = "safetensors") -> None:
    """One rank's process: build the shard, lead or follow, write ``rank{rank}.json``."""
    import torch
    import torch.distributed as dist

    from executor import distributed
    from executor.executor import Executor

    cuda = device == "cuda"
    dev = f"cuda:{rank}" if cuda else "cpu"
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=TIMEOUT)
    tp = distributed.init(rank, size, torch.device(dev), dist.PrefixStore("tp", store), TIMEOUT)
    ex = Executor(_config(source, dev, context, load_format), tp)
    stamps = _Stamps(ex)
    result: dict[str, Any] = {"rank": rank}
    if rank == 0:
        if cuda:
            ex.capture(["decode"])
        result["cases"] = _lead(ex, store, stamps, batches, steps, context, cuda)
        ex.close()
    else:
        result["kernels"] = _follow(ex, store, stamps, cuda)
    result["sent"], result["forward"] = stamps.sent, stamps.forward
    tmp = Path(out, f"rank{rank}.json.tmp")  # whole or absent: the parent polls for it
    tmp.write_text(json.dumps(result, default=lambda k: k.__dict__))
    tmp.rename(Path(out, f"rank{rank}.json"))
    dist.barrier(group=tp.control_group)  # no rank tears down under another's last call
    distributed.shutdown(tp)


def _first_collective(kernels: list[dict[str, Any]]) -> float:
    for k in kernels:
        if name_class(k["name"]) == "collective":
            return float(k["end_us"] - k["start_us"])
    return 0.0


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def summarize(ranks: list[dict[str, Any]], num_layers: int) -> dict[str, Any]:
    """Medians per batch and rank: host timestamps of the timed steps; the kernel table
    and the first collective of the profiled ones. ``ranks``: the ``rank{r}.json``
    contents, rank 0 first."""
    lead = ranks[0]
    out: dict[str, Any] = {}
    for batch, case in lead["cases"].items():
        per_rank: list[dict[str, Any]] = []
        for r, data in enumerate(ranks):
            skews, to_forward = [], []
            for step in case["timed"]:
                h = str(step["header"])
                skews.append((data["forward"][h] - lead["forward"][h]) * 1e6)
                # rank 0: the step's broadcast -> its forward; others: received -> forward
                to_forward.append((data["forward"][h] - data["sent"][h]) * 1e6)
            tables, first = [], []
            for step in case["profiled"]:
                raw = step["kernels"] if r == 0 else data["kernels"].get(str(step["header"]), [])
                if raw:
                    tables.append(step_table([Kernel(k["name"], k["start_us"], k["end_us"])
                                              for k in raw], num_layers))
                    first.append(_first_collective(raw))
            names = sorted({c for t in tables for c in t}, key=CLASSES.index)
            classes = {c: {"us": statistics.median(t.get(c, {"us": 0.0})["us"] for t in tables),
                           "n": statistics.median(t.get(c, {"n": 0.0})["n"] for t in tables)}
                       for c in names}
            per_rank.append({
                "classes": classes,
                "busy_us": sum(v["us"] for c, v in classes.items() if c not in ("idle", "wait")),
                "span_us": _median([sum(v["us"] for v in t.values()) for t in tables]),
                "first_collective_us": _median(first),
                "forward_after_rank0_us": _median(skews),
                "to_forward_us": _median(to_forward),
                "call_us": _median([s["call_us"] for s in case["timed"]]) if r == 0 else 0.0})
        out[batch] = per_rank
    return out


def markdown(result: dict[str, Any]) -> str:
    n = result["tp"]
    lines = [f"# Tensor-parallel decode per rank: {result['model']}, TP = {n}, on "
             f"{result['device']} at {result['commit']}", "",
             f"Read bandwidth {result['read_bandwidth_gbs']:.0f} GB/s (GPU 0); floor per "
             f"rank = weight bytes / {n} + the rank's KV, over it. Medians of "
             f"{result['steps']} profiled steps, context {result['context']}. µs per step.",
             ""]
    for batch, ranks in result["batches"].items():
        floor = result["floor_us"][batch]
        lines += [f"## Batch {batch} (floor per rank {floor:.0f} µs)", "",
                  "| | " + " | ".join(f"rank {r}" for r in range(len(ranks))) + " |",
                  "|---|" + "---:|" * len(ranks)]
        rows = [("rank 0's decode call (host, unprofiled)", lambda r: r["call_us"]),
                ("forward called after rank 0's (host, unprofiled)",
                 lambda r: r["forward_after_rank0_us"]),
                ("step sent/received -> forward (host, unprofiled)",
                 lambda r: r["to_forward_us"]),
                ("kernels + idle (profiled)", lambda r: r["busy_us"] + r["classes"].get(
                    "idle", {"us": 0.0})["us"]),
                ("whole span with waits (profiled)", lambda r: r["span_us"]),
                ("first collective, the embedding's (profiled)",
                 lambda r: r["first_collective_us"])]
        for name, get in rows:
            lines.append(f"| {name} | " + " | ".join(f"{get(r):.1f}" for r in ranks) + " |")
        classes = [c for c in CLASSES if any(c in r["classes"] for r in ranks)]
        for c in classes:
            cells = [r["classes"].get(c) for r in ranks]
            lines.append(f"| {c} | " + " | ".join(
                f"{v['us']:.1f} ({v['n']:.0f})" if v else "" for v in cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _join(procs: list[Any], results: list[Path], grace_s: float = 10.0) -> None:
    """Wait for the ranks; once every one wrote its results, give them ``grace_s`` to
    leave their process groups, then stop them (a hung teardown loses nothing)."""
    written_at = None
    while any(p.is_alive() for p in procs):
        if written_at is None and all(f.is_file() for f in results):
            written_at = time.monotonic()
        if written_at is not None and time.monotonic() - written_at > grace_s:
            for p in procs:
                if p.is_alive():
                    p.kill()
        time.sleep(0.2)
    for p in procs:
        p.join()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--models", type=Path, default=Path("/tmp/model-executor-bench"))
    ap.add_argument("--out", type=Path, default=Path("results-local"))
    ap.add_argument("--load-format", choices=("safetensors", "random"), default="safetensors",
                    help="random: write only the shape's config.json and draw the weights "
                    "on the devices")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from bench.common import shapes
    from executor.distributed.spawn import spawn_context
    from executor.weights.sharding import local_spec

    path, spec = shapes.model(args.model, args.models, args.load_format)
    batches = [int(b) for b in args.batches.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    bandwidth = 0.0
    if args.device == "cuda":
        from bench.common import hardware

        bandwidth = hardware.read_bandwidth_gbs()
        hardware.release_memory()
    store = dist.TCPStore("127.0.0.1", 0, args.tp + 1, is_master=True, timeout=TIMEOUT,
                          wait_for_workers=False)
    for r in range(args.tp):  # a rank that fails must not leave an older run's file
        Path(args.out, f"rank{r}.json").unlink(missing_ok=True)
    ctx = spawn_context()
    procs = [ctx.Process(target=rank_main, args=(r, args.tp, store.port, str(path),
                                                 args.device, batches, args.steps,
                                                 args.context, str(args.out), args.load_format))
             for r in range(args.tp)]
    for p in procs:
        p.start()
    _join(procs, [Path(args.out, f"rank{r}.json") for r in range(args.tp)])
    written = [Path(args.out, f"rank{r}.json").is_file() for r in range(args.tp)]
    if not all(written):
        print(f"a rank failed: exit codes {[p.exitcode for p in procs]}", file=sys.stderr)
        return 1
    if any(p.exitcode != 0 for p in procs):  # after its results: in the groups' teardown
        print(f"note: exit codes {[p.exitcode for p in procs]} after every rank wrote its "
              "results", file=sys.stderr)
    ranks = [json.loads(Path(args.out, f"rank{r}.json").read_text()) for r in range(args.tp)]
    local = local_spec(spec, args.tp)
    kv_per_token = 2 * local.kv_size * 2 * local.num_layers
    weights = shapes.spec_weight_bytes(spec) / args.tp
    result = {
        "model": args.model, "tp": args.tp, "steps": args.steps, "context": args.context,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "commit": git_commit(),
        "read_bandwidth_gbs": bandwidth,
        "floor_us": {str(b): (weights + b * args.context * kv_per_token)
                     / (bandwidth * 1e9) * 1e6 if bandwidth else 0.0 for b in batches},
        "batches": summarize(ranks, spec.num_layers)}
    (args.out / "tp_profile.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (args.out / "tp_profile.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
