"""What a scheduler waits per token: unary Decode against a pipelined Session.

``python -m bench.serving.session_latency --model DIR --device cuda --out DIR`` runs, per
batch size, in one process and one ``model-executor serve`` subprocess: in-process, the
synchronous decode call, the graph replay span (the yardstick) and two steps launched
ahead on fresh sequences (host time per launch and completion); over gRPC, unary Decode,
a Session with 1, 2 and 3 steps in flight (the default depth, 3, also ``packed_outputs``;
deeper ones continue from ``use_last_sampled``), and unary Decode with ``num_steps`` = 8,
each with the server's and the client's CPU time per step. Per token = wall time between
the first and last measured answer / steps; the headline ratio is the default depth's
against the span. ``--rounds N`` interleaves the gRPC modes N times (medians);
``--py-spy DIR`` samples the server during each batch's default-depth Session.
``--stand-in-span-ms 1:1.27,64:1.63`` runs the same on CPU with a simulated device
(``bench.serving.stand_in``; ``--stand-in-graphs``: decode on a graph's host path).
Writes ``session.json``, ``session.md`` and ``session.png`` to ``--out`` (default
``results-local``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common.meta import git_commit
from bench.common.pyspy import PySpy, summarize
from bench.common.server import CTX, Client, free_port, stop, tokens, wait_ready
from bench.serving.stand_in import StandInExecutor, parse_spans
from executor.api import DecodeItem, PrefillItem
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from executor.executor import Executor
from executor.steps import PendingStep


def executor_config(model: str, device: str, batches: list[int], steps: int) -> ExecutorConfig:
    """The executor of the in-process figures; the server is started with the same sizes."""
    cuda = device.startswith("cuda")
    return ExecutorConfig(
        model=ModelConfig(source=model), device=device,
        # In-process, a sequence takes steps + 10 decode steps, then steps launched ahead.
        cache=CacheConfig(kv_tokens=max(batches) * (CTX + 2 * steps + 120) * 2,
                          max_sequences=max(batches) * 2, max_context=CTX + 2 * steps + 120),
        graphs=GraphConfig(decode_mode="full" if cuda else "disabled", prefill_mode="disabled",
                           decode_buckets=tuple(batches) if cuda else None),
        attention_backend="triton" if cuda else "auto", max_decode_batch=max(batches))


def _complete(ex: Executor, step: PendingStep, host_s: list[float]) -> None:
    """Complete ``step``, its host part timed into ``host_s`` apart from the device wait."""
    if step.done is not None:
        step.done.synchronize()
    start = time.perf_counter()
    ex.complete(step)
    host_s.append(time.perf_counter() - start)


def in_process(config: ExecutorConfig, batches: list[int], steps: int,
               stand_in: str | None = None, launch_us: float = 0.0,
               graphs: bool = False) -> dict[str, Any]:
    """Per batch: the synchronous call and replay span, then two steps launched ahead with
    the host time of each launch and completion (on the stand-in device with ``stand_in``
    spans, ``bench.serving.stand_in``)."""
    if stand_in is not None:
        ex: Executor = StandInExecutor(config, parse_spans(stand_in), launch_us / 1e6, graphs)
    else:
        ex = Executor(config)
    if config.is_cuda:
        ex.capture(["decode"])
    vocab = ex.model_info.vocab_size
    out: dict[str, Any] = {}
    for bs in batches:
        ids = [f"p{bs}-{i}" for i in range(bs)]
        res = ex.prefill([PrefillItem(s, tokens(i, CTX, vocab)) for i, s in enumerate(ids)])
        toks = [o.token_id for o in res.outputs]
        ex.drain_replay_seconds()
        times = []
        for step in range(steps + 10):
            t0 = time.perf_counter()
            res = ex.decode([DecodeItem(s, t) for s, t in zip(ids, toks, strict=True)])
            if step >= 10:
                times.append(time.perf_counter() - t0)
            toks = [o.token_id for o in res.outputs]
        if config.is_cuda:
            torch.cuda.synchronize()
        spans = ex.drain_replay_seconds().get("decode", [])
        if isinstance(ex, StandInExecutor):
            spans = [ex.span_s(bs)] * (steps + 10)
        ex.release(ids)
        # Two launched ahead: the next step is launched before the previous completes. On
        # fresh sequences, so the contexts (and the attention's share of the GPU step)
        # run over the same range as the span's steps above and each gRPC mode's.
        ids = [f"a{bs}-{i}" for i in range(bs)]
        ex.prefill([PrefillItem(s, tokens(i, CTX, vocab)) for i, s in enumerate(ids)])
        ex.drain_replay_seconds()
        inflight: deque[PendingStep] = deque()
        items = [DecodeItem(s, None) for s in ids]
        # Host time of each launch and of each completion after its device work is done
        # (the wait for the device timed apart): whether the host keeps up with the GPU.
        launch_s: list[float] = []
        complete_s: list[float] = []

        t0 = time.perf_counter()
        for _ in range(steps):
            l0 = time.perf_counter()
            inflight.append(ex.launch_decode(items))
            launch_s.append(time.perf_counter() - l0)
            if len(inflight) > 1:
                _complete(ex, inflight.popleft(), complete_s)
        while inflight:
            _complete(ex, inflight.popleft(), complete_s)
        ahead = (time.perf_counter() - t0) / steps
        spans_ahead = ex.drain_replay_seconds().get("decode", [])
        ex.release(ids)
        out[str(bs)] = {"call_ms": statistics.median(times) * 1e3,
                        "span_ms": statistics.median(spans[10:]) * 1e3 if spans else None,
                        # the replays of the launched-ahead steps (none on the stand-in)
                        "span_ahead_ms": statistics.median(spans_ahead) * 1e3
                        if spans_ahead else None,
                        "launched_ahead_ms": ahead * 1e3,
                        "launch_host_us": statistics.median(launch_s) * 1e6,
                        "complete_host_us": statistics.median(complete_s) * 1e6}
    del ex
    gc.collect()
    if config.is_cuda:
        torch.cuda.empty_cache()
    return out


def _cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, every thread) of process ``pid``; this one if None."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def over_grpc(config: ExecutorConfig, model: str, device: str, batches: list[int],
              steps: int, vocab: int, stand_in: str | None = None, rounds: int = 1,
              launch_us: float = 0.0, py_spy: Path | None = None,
              graphs: bool = False) -> dict[str, Any]:
    """Each mode ``rounds`` times, the modes interleaved round by round (a host's speed
    drifts within minutes); the median per mode, and every round.
    With ``py_spy``, the first round's default-depth Session of each batch is sampled."""
    port = free_port()
    target = f"127.0.0.1:{port}"
    entry = ["service.cli"] if stand_in is None else \
        ["bench.serving.stand_in", "--span-ms", stand_in, "--launch-host-us", str(launch_us),
         *(["--graphs"] if graphs else []), "--"]
    args = [sys.executable, "-m", *entry, "serve", "--model", model, "--device", device,
            "--port", str(port), "--metrics-port", "-1",
            "--max-sequences", str(config.cache.max_sequences),
            "--max-context", str(config.cache.max_context),
            "--kv-tokens", str(config.cache.kv_tokens),
            "--max-decode-batch", str(max(batches)), "--prefill-graph", "disabled",
            "--session-depth", "3", "--log-level", "WARNING"]
    if config.is_cuda:
        args += ["--attention-backend", "triton", "--decode-graph", "full"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    out: dict[str, Any] = {}
    try:
        wait_ready(target, proc, 900)
        client = Client(target, vocab)
        for bs in batches:
            row: dict[str, Any] = {}
            every: dict[str, list[float]] = {}
            for r in range(rounds):
                runs = _runs(client, steps)
                for name in _MODES:
                    run = runs[name]
                    ids = [f"{name}-{bs}-{r}-{i}" for i in range(bs)]
                    toks = client.admit(ids)
                    spy = PySpy(proc.pid, py_spy / f"pyspy-bs{bs}-{name}.txt") \
                        if py_spy is not None and r == 0 and name == DEFAULT_MODE else None
                    with spy or contextlib.nullcontext():
                        cpu = _cpu_s(proc.pid), _cpu_s()
                        per_token = run(ids, toks)
                        cpu = _cpu_s(proc.pid) - cpu[0], _cpu_s() - cpu[1]
                    every.setdefault(name + "_ms", []).append(per_token * 1e3)
                    # every mode runs steps (+ 10 unmeasured) requests' worth of tokens
                    n = steps + 10 * (8 if name == "unary_num_steps_8" else 1)
                    every.setdefault(name + "_server_cpu_us", []).append(cpu[0] / n * 1e6)
                    every.setdefault(name + "_client_cpu_us", []).append(cpu[1] / n * 1e6)
                    row.update({f"{name}_{k}": v for k, v in client.diagnostics().items()})
                    client.release(ids)
            for key, values in every.items():
                row[key] = statistics.median(values)
                row[key + "_rounds"] = values
            out[str(bs)] = row
    finally:
        stop(proc, 30)
    return out


def _runs(client: Client, steps: int) -> dict[str, Callable[[list[str], list[int]], float]]:
    """Each gRPC mode of ``_MODES`` by name: (sequence ids, their tokens) -> seconds per
    token."""
    return {
        "unary": lambda i, t: client.unary(i, t, steps),
        "session_1": lambda i, t: client.session(i, t, steps, 1),
        "session_2": lambda i, t: client.session(i, t, steps, 2),
        "session_3": lambda i, t: client.session(i, t, steps, 3),
        f"{DEFAULT_MODE}_packed": lambda i, t: client.session(i, t, steps, DEPTH, True),
        "unary_num_steps_8": lambda i, t: client.unary(i, t, steps // 8, 8),
    }


#: Steps in flight of the Session the headline compares with the span: the client's and
#: the server's default depth (``--pipeline`` / ``--session-depth``).
DEPTH = 3
DEFAULT_MODE = f"session_{DEPTH}"
_MODES = ("unary", "session_1", "session_2", "session_3", f"{DEFAULT_MODE}_packed",
          "unary_num_steps_8")


def render(result: dict[str, Any], out: Path) -> str:
    lines = [f"# Session vs unary: per-token time a scheduler sees ({result['device']}, "
             f"commit {result['commit']})", "",
             "| batch | GPU span | in-process call | in-process 2 ahead | (a) unary | "
             "(b) session 1 | session 2 | (c) session 3 | session 3 packed | "
             "(d) num_steps 8 | (c) / span |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for bs, ip in result["in_process"].items():
        g = result["grpc"][bs]
        span = ip["span_ms"]

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.3f} ms"

        ratio = f"{g[DEFAULT_MODE + '_ms'] / span:.2f}x" if span else "-"
        lines.append(f"| {bs} | {ms(span)} | {ms(ip['call_ms'])} | {ms(ip['launched_ahead_ms'])} "
                     f"| {ms(g['unary_ms'])} | {ms(g['session_1_ms'])} | {ms(g['session_2_ms'])}"
                     f" | {ms(g['session_3_ms'])} | {ms(g.get(DEFAULT_MODE + '_packed_ms'))}"
                     f" | {ms(g['unary_num_steps_8_ms'])} | {ratio} |")
    for bs, g in result["grpc"].items():
        spread = g.get(DEFAULT_MODE + "_ms_rounds", [])
        if len(spread) > 1:
            lines.append(f"\nBatch {bs}, (c) in each of {len(spread)} interleaved rounds: "
                         + ", ".join(f"{v:.3f}" for v in spread) + " ms (the table: medians).")
    lines += ["", "CPU time per step of the server process (every thread) and of the client "
              "(this process), by mode, µs (medians over rounds)", "",
              "| batch | " + " | ".join(_MODES) + " |", "|---:|" + "---:|" * len(_MODES)]
    for bs, g in result["grpc"].items():
        if "unary_server_cpu_us" in g:
            lines.append(f"| {bs} | " + " | ".join(
                f"{g[m + '_server_cpu_us']:.0f} / {g[m + '_client_cpu_us']:.0f}"
                for m in _MODES) + " |")
    lines += ["", "In-process, two launched ahead: host time per step (medians; a completion "
              "timed after its device work is done)", "",
              "| batch | launch | complete | together, against the span |",
              "|---:|---:|---:|---:|"]
    for bs, ip in result["in_process"].items():
        if "launch_host_us" in ip:
            host = (ip["launch_host_us"] + ip["complete_host_us"]) / 1e3
            share = f"{host / ip['span_ms']:.2f}x" if ip["span_ms"] else "-"
            lines.append(f"| {bs} | {ip['launch_host_us']:.0f} us | "
                         f"{ip['complete_host_us']:.0f} us | {share} |")
    text = "\n".join(lines) + "\n"
    (out / "session.md").write_text(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        keys = ["unary_ms", "session_1_ms", "session_2_ms", "session_3_ms",
                "unary_num_steps_8_ms"]
        labels = ["(a) unary", "(b) session 1", "session 2", "(c) session 3", "(d) k=8"]
        fig, axes = plt.subplots(1, len(result["grpc"]), figsize=(5 * len(result["grpc"]), 4))
        for ax, (bs, g) in zip(list(axes) if len(result["grpc"]) > 1 else [axes],
                               result["grpc"].items(), strict=True):
            ax.bar(labels, [g[k] for k in keys], color="tab:blue")
            span = result["in_process"][bs]["span_ms"]
            if span:
                ax.axhline(span, color="tab:red", label="GPU span (graph replay)")
                ax.axhline(1.1 * span, color="tab:red", linestyle=":", label="1.10x span")
            ax.set_title(f"batch {bs}")
            ax.set_ylabel("ms per token (per sequence)")
            ax.tick_params(axis="x", rotation=30)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / "session.png", dpi=110)
    except ImportError:
        pass
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", type=Path, default=Path("results-local"))
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every gRPC mode this many times, interleaved; medians")
    ap.add_argument("--stand-in-span-ms", default=None, metavar="BATCH:MS,...",
                    help="CPU with a simulated device (bench.serving.stand_in), "
                    "e.g. 1:1.27,64:1.63")
    ap.add_argument("--in-process-only", action="store_true",
                    help="only the in-process figures (span, launch and completion host "
                    "time), printed as JSON: for A/B of the executor's host path")
    ap.add_argument("--py-spy", type=Path, default=None, metavar="DIR",
                    help="sample the server with py-spy during each batch's default-depth "
                    "Session; raw stacks and a summary into DIR")
    ap.add_argument("--stand-in-launch-us", type=float, default=0.0,
                    help="with --stand-in-span-ms: extra host time per launch, GIL held "
                    "(bench.serving.stand_in --launch-host-us)")
    ap.add_argument("--stand-in-graphs", action="store_true",
                    help="with --stand-in-span-ms: decode steps take a graph replay's host "
                    "path, as on a GPU (bench.serving.stand_in --graphs)")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    config = executor_config(args.model, args.device, batches, args.steps)
    stand_in = args.stand_in_span_ms
    launch_us = args.stand_in_launch_us
    inproc = in_process(config, batches, args.steps, stand_in, launch_us, args.stand_in_graphs)
    if args.in_process_only:
        print(json.dumps(inproc, indent=1))
        return 0
    grpc_rows = over_grpc(config, args.model, args.device, batches, args.steps,
                          _vocab(args.model), stand_in, args.rounds, launch_us,
                          args.py_spy, args.stand_in_graphs)
    if args.py_spy is not None:
        for raw in sorted(args.py_spy.glob("pyspy-*.txt")):
            # sampled over the mode's steps + 10 requests (and a second of idle before)
            table = summarize(raw.read_text(), rate=PySpy.RATE,
                                            steps=args.steps + 10)
            raw.with_suffix(".md").write_text(table)
            print(f"\n{raw.name}\n{table}")
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else \
        f"cpu ({os.cpu_count()} CPUs)" + ("" if stand_in is None else
                                          f", stand-in device {stand_in} ms, "
                                          f"{launch_us:g} us extra host time per launch"
                                          + (", graph host path" if args.stand_in_graphs
                                             else ""))
    result = {"device": device, "commit": git_commit(),
              "model": args.model, "steps": args.steps, "rounds": args.rounds,
              "in_process": inproc, "grpc": grpc_rows}
    (args.out / "session.json").write_text(json.dumps(result, indent=2))
    print(render(result, args.out))
    return 0


def _vocab(model: str) -> int:
    from executor.weights.catalog import resolve_model_source
    from executor.weights.loader import load_hf_config

    return load_hf_config(resolve_model_source(model)).vocab_size


if __name__ == "__main__":
    sys.exit(main())
