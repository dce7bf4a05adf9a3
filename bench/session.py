"""What a scheduler waits per token: unary Decode against a pipelined Session.

``python -m bench.session --model DIR --device cuda --out DIR`` runs, per batch size, in
one process and one server on one machine:

* in-process: the executor's synchronous decode call (host work included) and the median
  graph replay span (CUDA events): the GPU's busy time per step, the yardstick;
* in-process, two steps launched ahead (``launch_decode`` / ``complete``), on fresh
  sequences so their contexts span the same range as the span's steps (until 1256e6f it
  continued the same sequences, so at batch 64 its longer attention made it look slower
  than the span by about 15 %); ``span_ahead_ms`` is those steps' own replay span;
* over gRPC from this process (the server is a ``model-executor serve`` subprocess):
  (a) unary Decode, one call at a time; (b) Session, one step in flight; (c) Session, two
  steps in flight, decode items continuing from the device's last samples
  (``use_last_sampled``), three in flight, and two with ``packed_outputs``; (d) unary
  Decode with ``num_steps`` = 8.

Per token = wall time between the first and last measured answer / steps (a batch gets
one token per sequence per step). Ratios are to the replay span measured in the same run.
Beside each gRPC mode: the CPU time per step of the server process (all its threads, from
``/proc``) and of this process (the client): whether one of them, not the chain between
them, is what limits the rate. ``--py-spy DIR`` also samples the server with ``py-spy``
(when installed) while it serves the two-in-flight Session of each batch, one raw
(collapsed-stack) file per batch plus ``bench.pyspy_summary``'s table of which thread
holds the GIL in which functions, and for how many µs per step.
``--rounds N`` measures each gRPC mode N times, the modes interleaved round by round, and
reports medians (one machine's host speed drifts within minutes).

``--stand-in-span-ms 1:1.27,64:1.63`` runs the same on CPU with a simulated device
(``bench.stand_in``): the tiny model's host path, each step "running" for the span given
for its batch; the span column is then that span. For work on the host and RPC path
without a GPU; its figures belong to the machine it ran on.
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
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import torch

from bench.grpc_overhead import _free_port, _tokens, _wait_ready
from bench.stand_in import StandInExecutor, parse_spans
from executor.api import DecodeItem, PrefillItem
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from executor.executor import Executor
from executor.steps import PendingStep
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc

CTX = 128


def _config(model: str, device: str, batches: list[int], steps: int) -> ExecutorConfig:
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
               stand_in: str | None = None, launch_us: float = 0.0) -> dict[str, Any]:
    if stand_in is not None:
        ex: Executor = StandInExecutor(config, parse_spans(stand_in), launch_us / 1e6)
    else:
        ex = Executor(config)
    if config.is_cuda:
        ex.capture(["decode"])
    vocab = ex.model_info.vocab_size
    out: dict[str, Any] = {}
    for bs in batches:
        ids = [f"p{bs}-{i}" for i in range(bs)]
        res = ex.prefill([PrefillItem(s, _tokens(i, CTX, vocab)) for i, s in enumerate(ids)])
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
        ex.prefill([PrefillItem(s, _tokens(i, CTX, vocab)) for i, s in enumerate(ids)])
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


class PySpy:
    """``py-spy record`` attached to a process for the length of a ``with`` block,
    sampling only the thread that holds the GIL (``--gil``): the samples say who keeps
    the one interpreter busy, ``RATE`` of them a second of it."""

    RATE = 2000

    def __init__(self, pid: int, out: Path) -> None:
        self.pid, self.out = pid, out
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PySpy:
        self.proc = subprocess.Popen(
            ["py-spy", "record", "--pid", str(self.pid), "--rate", str(self.RATE),
             "--format", "raw", "--threads", "--gil", "--nonblocking", "--output",
             str(self.out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # attached before the measured steps
        return self

    def __exit__(self, *_: object) -> None:
        import signal

        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return
        if not self.out.exists():
            print(f"py-spy wrote nothing: {err.decode(errors='replace')[-400:]}",
                  file=sys.stderr)


class Client:
    """The scheduler's side: decode loops over one channel."""

    def __init__(self, target: str, vocab: int) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.ExecutorStub(self.channel)
        self.vocab = vocab
        self.seen: list[Any] = []  # the measured responses' StepInfo and execute_ms

    def diagnostics(self) -> dict[str, Any]:
        """What the server reported for the last run: graph steps and its own time."""
        seen, self.seen = self.seen, []
        return {"graph_steps": sum(s.path == pb.PATH_GRAPH for s, _ in seen) / len(seen),
                "server_execute_ms": statistics.median(ms for _, ms in seen),
                "server_forward_ms": statistics.median(s.forward_ms for s, _ in seen)}

    def admit(self, ids: list[str]) -> list[int]:
        res = self.stub.Prefill(pb.PrefillRequest(items=[
            pb.PrefillItem(seq_id=s, token_ids=_tokens(i, CTX, self.vocab), sample=True)
            for i, s in enumerate(ids)]), timeout=120)
        return [o.token_id for o in res.outputs]

    def unary(self, ids: list[str], toks: list[int], steps: int, num_steps: int = 1
              ) -> float:
        stamps = []
        for _ in range(steps + 10):
            res = self.stub.Decode(pb.DecodeRequest(num_steps=num_steps, items=[
                pb.DecodeItem(seq_id=s, token_id=t) for s, t in zip(ids, toks, strict=True)]),
                timeout=60)
            toks = [o.token_id for o in res.outputs]
            stamps.append(time.perf_counter())
            self.seen.append((res.step, res.execute_ms))
        return (stamps[-1] - stamps[9]) / (steps * num_steps)

    def session(self, ids: list[str], toks: list[int], steps: int, depth: int,
                packed: bool = False) -> float:
        """``depth`` requests outstanding; with depth 1 each carries the tokens just read,
        deeper ones continue from the device's last samples. ``packed``: the answers come
        as flat arrays (``packed_outputs``).

        Deeper ones work as a pipelined scheduler would: the next request is made while
        the window is full (its items do not depend on the answers in flight), and an
        answer frees the window before it is read. Through 6963159 the requests were made
        after the window opened and an answer was read before it freed the window, both on
        the path from one answer to the next launch (about 0.1-0.2 ms at batch 64)."""
        window = threading.Semaphore(depth)
        latest: dict[str, int] = dict(zip(ids, toks, strict=True))
        ahead = pb.DecodeRequest(items=[pb.DecodeItem(seq_id=s, use_last_sampled=True)
                                        for s in ids], packed_outputs=packed)

        def requests() -> Iterator[pb.SessionRequest]:
            for n in range(steps + 10):
                if depth == 1:
                    window.acquire()
                    yield pb.SessionRequest(step=n + 1, decode=pb.DecodeRequest(
                        items=[pb.DecodeItem(seq_id=s, token_id=latest[s]) for s in ids],
                        packed_outputs=packed))
                else:
                    request = pb.SessionRequest(step=n + 1, decode=ahead)
                    window.acquire()
                    yield request

        stamps = []
        for response in self.stub.Session(requests(), timeout=600):
            stamps.append(time.perf_counter())
            if depth > 1:
                window.release()
            if response.WhichOneof("result") != "decode":
                raise RuntimeError(f"session step failed: {response}")
            if packed:
                latest.update(zip(ids, response.decode.packed.token_ids, strict=True))
            else:
                latest.update((o.seq_id, o.token_id) for o in response.decode.outputs)
            self.seen.append((response.decode.step, response.decode.execute_ms))
            if depth == 1:
                window.release()
        return (stamps[-1] - stamps[9]) / steps

    def release(self, ids: list[str]) -> None:
        self.stub.Release(pb.ReleaseRequest(seq_ids=ids), timeout=60)


def over_grpc(config: ExecutorConfig, model: str, device: str, batches: list[int],
              steps: int, vocab: int, stand_in: str | None = None, rounds: int = 1,
              launch_us: float = 0.0, py_spy: Path | None = None) -> dict[str, Any]:
    """Each mode ``rounds`` times, the modes interleaved round by round (host speed
    drifts within minutes on the lent machines); the median per mode, and every round.
    With ``py_spy``, the first round's two-in-flight Session of each batch is sampled."""
    port = _free_port()
    target = f"127.0.0.1:{port}"
    entry = ["service.cli"] if stand_in is None else \
        ["bench.stand_in", "--span-ms", stand_in, "--launch-host-us", str(launch_us), "--"]
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
        _wait_ready(target, proc, 900)
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
                        if py_spy is not None and r == 0 and name == "session_2" else None
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
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def _runs(client: Client, steps: int) -> dict[str, Callable[[list[str], list[int]], float]]:
    """Each gRPC mode of ``_MODES`` by name: (sequence ids, their tokens) -> seconds per
    token."""
    return {
        "unary": lambda i, t: client.unary(i, t, steps),
        "session_1": lambda i, t: client.session(i, t, steps, 1),
        "session_2": lambda i, t: client.session(i, t, steps, 2),
        "session_3": lambda i, t: client.session(i, t, steps, 3),
        "session_2_packed": lambda i, t: client.session(i, t, steps, 2, True),
        "unary_num_steps_8": lambda i, t: client.unary(i, t, steps // 8, 8),
    }


_MODES = ("unary", "session_1", "session_2", "session_3", "session_2_packed",
          "unary_num_steps_8")


def render(result: dict[str, Any], out: Path) -> str:
    lines = [f"# Session vs unary: per-token time a scheduler sees ({result['device']}, "
             f"commit {result['commit']})", "",
             "| batch | GPU span | in-process call | in-process 2 ahead | (a) unary | "
             "(b) session 1 | (c) session 2 | session 3 | session 2 packed | "
             "(d) num_steps 8 | (c) / span |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for bs, ip in result["in_process"].items():
        g = result["grpc"][bs]
        span = ip["span_ms"]

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.3f} ms"

        ratio = f"{g['session_2_ms'] / span:.2f}x" if span else "-"
        lines.append(f"| {bs} | {ms(span)} | {ms(ip['call_ms'])} | {ms(ip['launched_ahead_ms'])} "
                     f"| {ms(g['unary_ms'])} | {ms(g['session_1_ms'])} | {ms(g['session_2_ms'])}"
                     f" | {ms(g['session_3_ms'])} | {ms(g.get('session_2_packed_ms'))}"
                     f" | {ms(g['unary_num_steps_8_ms'])} | {ratio} |")
    for bs, g in result["grpc"].items():
        spread = g.get("session_2_ms_rounds", [])
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
        labels = ["(a) unary", "(b) session 1", "(c) session 2", "session 3", "(d) k=8"]
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
                    help="CPU with a simulated device (bench.stand_in), e.g. 1:1.27,64:1.63")
    ap.add_argument("--in-process-only", action="store_true",
                    help="only the in-process figures (span, launch and completion host "
                    "time), printed as JSON: for A/B of the executor's host path")
    ap.add_argument("--py-spy", type=Path, default=None, metavar="DIR",
                    help="sample the server with py-spy during each batch's two-in-flight "
                    "Session; raw stacks and a summary into DIR")
    ap.add_argument("--stand-in-launch-us", type=float, default=0.0,
                    help="with --stand-in-span-ms: extra host time per launch, GIL held "
                    "(bench.stand_in --launch-host-us)")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    config = _config(args.model, args.device, batches, args.steps)
    stand_in = args.stand_in_span_ms
    launch_us = args.stand_in_launch_us
    inproc = in_process(config, batches, args.steps, stand_in, launch_us)
    if args.in_process_only:
        print(json.dumps(inproc, indent=1))
        return 0
    grpc_rows = over_grpc(config, args.model, args.device, batches, args.steps,
                          _vocab(args.model), stand_in, args.rounds, launch_us,
                          args.py_spy)
    if args.py_spy is not None:
        from bench import pyspy_summary

        for raw in sorted(args.py_spy.glob("pyspy-*.txt")):
            # sampled over the mode's steps + 10 requests (and a second of idle before)
            table = pyspy_summary.summarize(raw.read_text(), rate=PySpy.RATE,
                                            steps=args.steps + 10)
            raw.with_suffix(".md").write_text(table)
            print(f"\n{raw.name}\n{table}")
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else \
        f"cpu ({os.cpu_count()} CPUs)" + ("" if stand_in is None else
                                          f", stand-in device {stand_in} ms, "
                                          f"{launch_us:g} us extra host time per launch")
    result = {"device": device, "commit": os.environ.get("MODEL_EXECUTOR_COMMIT", "unknown"),
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
