"""Tensor parallelism on several GPUs of one host: TP = 1 against TP = N, one machine, one run.
``python -m bench.e2e.tensor_parallel --shapes llama-3.2-1b,llama-3.1-8b --tp 1,2,2:nccl``

For each shape (random bf16 weights, written to disk or, with ``--load-format random``,
drawn on the GPUs; ``shape@4`` runs a shape at some sizes only) and each ``--tp`` run (a
size and optionally ``:ALGO`` for ``--tp-all-reduce``, default ``auto``), a real
``model-executor serve --tensor-parallel-size N`` (full decode graphs, breakable prefill
graphs, Triton attention) is driven over gRPC: decode at batch 1, 8 and 64 (context 512),
the replay time per step from the server's histogram (rank 0, all-reduces and any wait
for a later rank included) read in ``WINDOWS`` windows; the same batches through a
Session with two steps in flight (``pipelined``: there the replay is the device's time);
prefill of 2048 tokens. Beside them: GPU 0's read bandwidth, the per-rank floor, and per
all-reduce algorithm one captured all-reduce of a layer's activation, sums checked exact.
A size may repeat (``--tp 2,1,2,1,2``): the batch-1 ratio is then the median over starts.
Writes ``tensor_parallel.json`` and ``.md`` to ``--out`` (default ``results-local``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import shapes
from bench.common.meta import git_commit
from bench.common.server import Client, free_port, stop, tokens, wait_ready
from bench.common.shapes import weight_bytes
from bench.common.timing import replay_us
from service.gen.model_executor.v1 import executor_pb2 as pb

BATCHES = (1, 8, 64)
CONTEXT = 512
PREFILL = 2048
STEPS = 40
#: The steps of a batch size are read in this many windows (``replay_ms``).
WINDOWS = 8
#: Timed steps of the pipelined Session per batch size (``pipelined``).
SESSION_STEPS = 80


def _decode_histograms(metrics_port: int) -> dict[str, tuple[float, float]]:
    """(sum, count) so far of the decode phase's graph replays (``replay``) and, under
    tensor parallelism, step deliveries and launch lags (``delivery``, ``lag``)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                  timeout=10).read().decode()
    return decode_histograms(text)


_HISTOGRAMS = (("replay", "graph_replay_seconds"), ("delivery", "tp_step_delivery_seconds"),
               ("lag", "tp_launch_lag_seconds"))


def decode_histograms(text: str) -> dict[str, tuple[float, float]]:
    """``_decode_histograms`` of a scrape's text (a series not exported reads 0, 0)."""
    series = {f'model_executor_{name}_{part}{{phase="decode"}}': (key, i)
              for key, name in _HISTOGRAMS for i, part in enumerate(("sum", "count"))}
    found = {key: [0.0, 0.0] for key, _ in _HISTOGRAMS}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in series:
            key, i = series[name]
            found[key][i] = float(value)
    return {k: (v[0], v[1]) for k, v in found.items()}


def mean_ms(first: dict[str, tuple[float, float]], last: dict[str, tuple[float, float]],
            key: str) -> float | None:
    """Mean of histogram ``key`` (ms) over the steps between two reads; None without any
    (``delivery`` and ``lag`` at TP = 1)."""
    (s0, c0), (s1, c1) = first[key], last[key]
    return (s1 - s0) / (c1 - c0) * 1e3 if c1 > c0 else None


def replay_ms(marks: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """The replay figures of one batch size from the histogram's (sum, count) read before
    the steps and after each window of them: the mean over every step, each window's mean
    (a window holds the replays recorded since the last read: they trail their steps by a
    call or so), and the median of those, which one slow step moves only within its own
    window."""
    (s0, c0), (s1, c1) = marks[0], marks[-1]
    windows = [(b[0] - a[0]) / (b[1] - a[1]) * 1e3 for a, b in itertools.pairwise(marks)
               if b[1] > a[1]]
    return {"replay_ms_mean": (s1 - s0) / max(1.0, c1 - c0) * 1e3,
            "replay_ms_windows": windows,
            "replay_ms_median": statistics.median(windows) if windows else float("nan")}


def bs1_ratios(runs: Sequence[dict[str, Any]],
               figure: Callable[[dict[str, Any]], float | None] | None = None
               ) -> dict[int, dict[str, Any]]:
    """Decode at batch 1, TP = N (the default ``auto`` runs) over TP = 1, for each N run
    beside TP = 1: the median over each side's runs (a size may be run several times,
    interleaved with the others, as ``--tp 2,1,2,1,2`` does), with every run's figure.
    A run's ``figure`` (of its ``decode_bs1``) is by default its unary steps' replay, the
    windows' median (``_step_ms``); runs where it is None are left out."""
    pick = figure or _step_ms

    def figures(tp: int) -> list[float]:
        got = (pick(r["decode_bs1"]) for r in runs
               if r["tp"] == tp and (tp == 1 or r["all_reduce"] == "auto"))
        return [float(v) for v in got if v is not None]

    one = figures(1)
    if not one:
        return {}
    out: dict[int, dict[str, Any]] = {}
    for tp in sorted({r["tp"] for r in runs if r["tp"] > 1}):
        many = figures(tp)
        if many:
            out[tp] = {"ratio": statistics.median(many) / statistics.median(one),
                       "tp1_ms": one, "tpn_ms": many}
    return out


def serve(model: Path, tp: int, extra: list[str] | None = None
          ) -> tuple[subprocess.Popen[bytes], str, int]:
    """A ready ``serve --tensor-parallel-size tp`` of ``model`` (TP = 1 on the first
    visible GPU): the process, its gRPC target and its metrics port."""
    port, metrics = free_port(), free_port()
    env = dict(os.environ)
    if tp == 1:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    args = [sys.executable, "-m", "service.cli", "serve", "--model", str(model), "--device",
            "cuda", "--tensor-parallel-size", str(tp), "--port", str(port), "--metrics-port",
            str(metrics), "--decode-graph", "full", "--prefill-graph", "breakable",
            "--attention-backend", "triton", "--max-sequences", "80", "--max-context",
            str(PREFILL + 64), "--kv-tokens", str(80 * (PREFILL + 64)),
            "--max-prefill-tokens", str(PREFILL), "--max-decode-batch", str(max(BATCHES)),
            "--drain-delay", "0", *(extra or [])]
    # The server's log (JSON lines) goes to a file: a pipe nobody reads could fill up.
    log = open(Path(tempfile.gettempdir()) / f"tp{tp}-serve-{port}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    target = f"127.0.0.1:{port}"
    wait_ready(target, proc, 900)
    return proc, target, metrics


def measure(model: Path, tp: int, vocab: int, all_reduce: str = "auto",
            load_format: str = "safetensors", extra: list[str] | None = None
            ) -> dict[str, Any]:
    """One server's figures; ``all_reduce`` is ``--tp-all-reduce``'s value, optionally
    with ``/on`` or ``/off`` for ``--tp-gemm-send`` (default: the server's);
    ``extra``: more ``serve`` arguments."""
    algo, _, send = all_reduce.partition("/")
    proc, target, metrics = serve(model, tp, ["--tp-all-reduce", algo,
                                              *(["--tp-gemm-send", send] if send else []),
                                              "--load-format", load_format, *(extra or [])])
    out: dict[str, Any] = {"tp": tp, "all_reduce": all_reduce}
    client = Client(target, vocab)  # its stub serves the unary calls too
    stub = client.stub
    try:
        for bs in BATCHES:
            ids = [f"d{bs}-{i}" for i in range(bs)]
            per_call = PREFILL // CONTEXT  # calls of at most --max-prefill-tokens
            for start in range(0, bs, per_call):
                stub.Prefill(pb.PrefillRequest(items=[
                    pb.PrefillItem(seq_id=s, token_ids=tokens(i, CONTEXT, vocab),
                                   sample=True)
                    for i, s in enumerate(ids) if start <= i < start + per_call]),
                    timeout=300)
            decode = pb.DecodeRequest(items=[pb.DecodeItem(seq_id=s, use_last_sampled=True)
                                             for s in ids])
            for _ in range(5):
                stub.Decode(decode, timeout=60)
            marks = [_decode_histograms(metrics)]
            forward = []
            for _ in range(WINDOWS):
                forward += [stub.Decode(decode, timeout=60).step
                            for _ in range(STEPS // WINDOWS)]
                marks.append(_decode_histograms(metrics))
            assert all(s.path == pb.PATH_GRAPH for s in forward), forward[0]
            out[f"decode_bs{bs}"] = {
                **replay_ms([m["replay"] for m in marks]),
                "delivery_ms_mean": mean_ms(marks[0], marks[-1], "delivery"),
                "launch_lag_ms_mean": mean_ms(marks[0], marks[-1], "lag"),
                "forward_ms_median": statistics.median(s.forward_ms for s in forward),
                "session": pipelined(client, metrics, ids)}
            stub.Release(pb.ReleaseRequest(seq_ids=ids), timeout=60)
        times = []
        for r in range(4):
            res = stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(
                seq_id=f"pf{r}", token_ids=tokens(100 + r, PREFILL, vocab), sample=True)]),
                timeout=300)
            times.append(res.step.forward_ms)
            out["prefill_path"] = pb.Path.Name(res.step.path)
            stub.Release(pb.ReleaseRequest(seq_ids=[f"pf{r}"]), timeout=60)
        out[f"prefill_{PREFILL}_ms_median"] = statistics.median(times[1:])
    finally:
        client.channel.close()
        stop(proc)
    return out


def pipelined(client: Client, metrics_port: int, ids: list[str]) -> dict[str, Any]:
    """Decode ``ids`` through one Session with two steps in flight, each continuing from
    the device's last samples, as a pipelined scheduler runs them
    (``Client.session``; ``SESSION_STEPS`` timed after 10 untimed): the
    wall time per token between the client's answers, and over the whole session the
    replays' mean (its first step, which has none ahead of it, included), delivery and
    launch lag. A step launched while the one before still runs on the device is not
    waited for by the GPU, on any rank, so here the replay is the device's time alone.
    ``measure`` runs it on the sequences its unary steps left: contexts of 557 to 647
    tokens against their 512 to 557, the same at every TP size."""
    first = _decode_histograms(metrics_port)
    per_token_s = client.session(ids, [0] * len(ids), SESSION_STEPS, 2)
    last = _decode_histograms(metrics_port)
    client.seen.clear()
    return {"per_token_ms": per_token_s * 1e3,
            "replay_ms_mean": mean_ms(first, last, "replay"),
            "delivery_ms_mean": mean_ms(first, last, "delivery"),
            "launch_lag_ms_mean": mean_ms(first, last, "lag")}


def _allreduce_worker(rank: int, world: int, port: int, sizes: list[int], hidden: int,
                      queue: Any) -> None:
    """One rank: for each algorithm, the all-reduce of (rows, hidden) bf16 through
    ``TensorParallel.all_reduce``, checked against the exact sum eagerly and inside a CUDA
    graph (and ``all_gather`` of the same input, captured between all-reduces), then
    timed as a captured run of ``GRAPH_REPEATS`` back-to-back all-reduces (as in a decode
    graph: no launch gaps, no skew between the ranks' host threads)."""
    import datetime

    import torch.distributed as dist

    from executor import distributed
    from executor.distributed import group

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    result: dict[str, Any] = {}
    # one store for every algorithm's group (a port per group could be taken meanwhile)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=120))
    for algo in distributed.ALL_REDUCE_CHOICES:
        tp = distributed.init(rank, world, device, dist.PrefixStore(algo, store),
                        datetime.timedelta(seconds=120), algo)  # type: ignore[arg-type]
        name = group.all_reduce_algorithm(tp)
        times: dict[str, float] = {}
        ok = True
        for rows in sizes:
            # integers stay exact in bf16 sums: rank r holds r + 1 + (i % 7) - 3, its zeros
            # as -0.0 (the push kernel's "not arrived" mark, which it must not wait on)
            base = (torch.arange(rows * hidden, device=device) % 7 - 3).view(rows, hidden)
            x = (base + rank + 1).to(torch.bfloat16)
            x[x == 0] = -0.0
            want = (base * world + world * (world + 1) // 2).to(torch.bfloat16)
            # (the NCCL path reduces its input in place: each call gets its own copy)
            ok &= bool(torch.equal(tp.all_reduce(x.clone()), want))
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                tp.all_reduce(x.clone())  # warm-up outside the capture
            torch.cuda.current_stream().wait_stream(side)
            # each call of the graph its own values (x + i, still exact), so a call that
            # read a slot or a peer's data of another call fails the check
            inputs = [x.clone() for _ in range(GRAPH_REPEATS)]
            with torch.cuda.graph(graph):
                outs = [tp.all_reduce(c) for c in inputs]
            for _ in range(3):
                for i, c in enumerate(inputs):  # NCCL's path sums its input in place
                    c.copy_(x + i)
                graph.replay()
                torch.cuda.synchronize()
                ok &= all(bool(torch.equal(o, want + world * i)) for i, o in enumerate(outs))
            times[str(rows)] = replay_us(graph, GRAPH_REPEATS, 18, dist.barrier)
            del graph, outs
            # the all-gather (the LM head's logits) of the same input, eager and captured
            # between all-reduces: every rank's x in rank order
            every = torch.cat([(base + r + 1).to(torch.bfloat16) for r in range(world)])
            ok &= bool(torch.equal(tp.all_gather(x), every))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                mixed = [tp.all_gather(x), tp.all_reduce(x.clone()), tp.all_gather(x + 1)]
            for _ in range(2):
                graph.replay()
                torch.cuda.synchronize()
                ok &= (bool(torch.equal(mixed[0], every)) and bool(torch.equal(mixed[1], want))
                       and bool(torch.equal(mixed[2], every + 1)))
            del graph, mixed
        result[algo] = {"algorithm": name, "ok": ok, "us": times,
                        "choice": distributed.all_reduce_choice(tp),
                        "send": _send_check(tp, rank, hidden)}
        distributed.shutdown(tp)
    if rank == 0:
        queue.put(result)


#: All-reduces per captured graph in ``allreduce_us``.
GRAPH_REPEATS = 32
#: The row-parallel projection of ``_send_check``: the 8B's o_proj input at TP = 2.
SEND_K = 2048


def _send_check(tp: Any, rank: int, hidden: int) -> dict[str, Any]:
    """A one-row row-parallel projection and its all-reduce, through
    ``TensorParallel.linear_all_reduce`` (where the push all-reduce runs it, the skinny
    GEMM sends its output into the all-reduce's buffers) against the projection then
    ``all_reduce``: whether the send path ran, the same bits eagerly and from a graph of
    ``GRAPH_REPEATS`` pairs (each with its own input), and each graph's µs per pair."""
    from executor.distributed import group
    from executor.kernels import skinny

    device = torch.device("cuda", rank)
    gen = torch.Generator(device=device).manual_seed(rank)
    layer = torch.nn.Linear(SEND_K, hidden, bias=False, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_(0, SEND_K ** -0.5, generator=gen)
    inputs = [torch.randn(1, SEND_K, generator=gen, device=device, dtype=torch.bfloat16)
              for _ in range(GRAPH_REPEATS)]

    def plain(x: torch.Tensor) -> torch.Tensor:
        return tp.all_reduce(skinny.linear(layer, x))

    def sent(x: torch.Tensor) -> torch.Tensor:
        return tp.linear_all_reduce(layer, x, lambda: skinny.linear(layer, x))

    probe = torch.empty(1, hidden, device=device, dtype=torch.bfloat16)
    ok = all(bool(torch.equal(plain(x), sent(x))) for x in inputs[:4])
    graphs, outs = {}, {}
    for label, fn in (("plain", plain), ("send", sent)):
        graphs[label] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[label]):
            outs[label] = [fn(x) for x in inputs]
    for _ in range(3):
        for x in inputs:
            x.normal_(generator=gen)
        for graph in graphs.values():
            graph.replay()
        torch.cuda.synchronize()
        ok &= all(bool(torch.equal(a, b)) for a, b in zip(outs["plain"], outs["send"],
                                                          strict=True))
    import torch.distributed as dist

    us = {label: replay_us(graph, GRAPH_REPEATS, 18, dist.barrier)
          for label, graph in graphs.items()}
    sends = tp.push_path(probe) is not None and \
        "tp_projections_send" in group.projection_features(tp)
    return {"sends": sends, "ok": ok, "us_per_pair": us}


def allreduce_us(world: int, hidden: int, sizes: list[int] | None = None
                 ) -> dict[str, Any]:
    """Per algorithm (``ALL_REDUCE_CHOICES``: nccl, symm_mem, flags, push, auto): what it
    resolved to (and, for "auto", its start-up probe times and the one-shot kernel's size limit),
    whether every sum was exact (eager and in a graph) and the median µs of one all-reduce
    of (rows, hidden) bf16 inside a captured graph, by rows."""
    return spawn_ranks(_allreduce_worker, world, sizes or [*BATCHES, PREFILL], hidden)


#: How long ``spawn_ranks`` waits for its ranks to exit after the result (a clean exit,
#: process groups left, takes seconds) before it stops them.
RANK_EXIT_S = 60.0


def spawn_ranks(worker: Callable[..., None], world: int, *args: Any) -> dict[str, Any]:
    """Run ``worker(rank, world, port, *args, queue)`` in ``world`` spawned processes
    (``port``: a free one for their store) and return what rank 0 puts on ``queue``.

    The ranks get a bounded wait to exit, then SIGTERM and SIGKILL: a rank stuck in its
    group's teardown must not outlive the call (multiprocessing joins non-daemon children
    at interpreter exit, which would hang the caller, a pytest run say)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        result: dict[str, Any] = queue.get(timeout=600)
    finally:
        deadline = time.monotonic() + RANK_EXIT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            for stop in (p.terminate, p.kill):
                if p.is_alive():
                    stop()
                    p.join(5)
    return result


def _step_ms(got: dict[str, Any]) -> float:
    """A batch size's step figure: the median of its windows' means."""
    return float(got["replay_ms_median"])


def _session_figure(key: str) -> Callable[[dict[str, Any]], float | None]:
    """A batch size's ``pipelined`` figure ``key``; None for a run without a Session."""
    def figure(got: dict[str, Any]) -> float | None:
        session = got.get("session")
        return None if session is None or session.get(key) is None else float(session[key])
    return figure


#: The batch-1 ratios through the Session: what the client waits per token, and the
#: device's replay when every rank's step is launched ahead of it.
SESSION_RATIOS = (("per_token", "wall time per token at the client", "per_token_ms"),
                  ("replay", "replay per step on rank 0", "replay_ms_mean"))


def session_ratios(runs: Sequence[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """``bs1_ratios`` of the pipelined Session's figures (``SESSION_RATIOS``)."""
    out = {name: bs1_ratios(runs, _session_figure(key)) for name, _, key in SESSION_RATIOS}
    return {name: got for name, got in out.items() if got}


def _ratio_line(what: str, tp: int | str, got: dict[str, Any]) -> str:
    spread = "".join(
        f"; TP = {n} runs {min(v):.3f}-{max(v):.3f} ms" for n, v
        in ((1, got["tp1_ms"]), (tp, got["tpn_ms"])) if len(v) > 1)
    return (f"{what}, TP = {tp} (auto) / TP = 1: {got['ratio']:.3f} "
            f"(medians over {len(got['tpn_ms'])} and {len(got['tp1_ms'])}"
            f" runs{spread}; target for the 8B at TP = 2: <= 0.6).")


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Tensor parallelism ({result['device']} x{result['gpus']}, commit "
             f"{result['commit']})", "",
             f"HBM read bandwidth (GPU 0): {result['read_gbs']:.0f} GB/s. Decode at context "
             f"{CONTEXT}; replay = graph replay per step on rank 0 (all-reduces included), "
             f"the median of {WINDOWS} windows' means; floor = weight bytes per rank / "
             "bandwidth.", ""]
    for shape, runs in result["shapes"].items():
        lines += [f"## {shape}", "",
                  "| TP | floor ms | " + " | ".join(f"bs{b} replay ms (x floor)"
                                                    for b in BATCHES)
                  + f" | prefill {PREFILL} ms |",
                  "|---:|---:|" + "---:|" * len(BATCHES) + "---:|"]
        for run in runs["runs"]:
            floor = run["floor_ms"]
            steps = [_step_ms(run[f"decode_bs{b}"]) for b in BATCHES]
            cells = [f"{ms:.3f} ({ms / floor:.2f}x)" for ms in steps]
            label = run["tp"] if run["tp"] == 1 else f"{run['tp']} ({run['all_reduce']})"
            lines.append(f"| {label} | {floor:.3f} | " + " | ".join(cells)
                         + f" | {run[f'prefill_{PREFILL}_ms_median']:.2f} |")
        for key, what in (("delivery", "Step delivery, from rank 0 starting to send a "
                           "decode step to the last other rank having it"),
                          ("launch_lag", "Launch lag, how much later than rank 0 the last "
                           "other rank launched a decode step")):
            means = [(run, [run[f"decode_bs{b}"].get(f"{key}_ms_mean") for b in BATCHES])
                     for run in runs["runs"] if run["tp"] > 1]
            means = [(run, v) for run, v in means if any(x is not None for x in v)]
            if means:
                lines += ["", f"{what} (mean, ms, batch " + "/".join(str(b) for b in BATCHES)
                          + "): " + "; ".join(
                              f"TP = {run['tp']} ({run['all_reduce']}) "
                              + " / ".join("-" if x is None else f"{x:.3f}" for x in v)
                              for run, v in means) + "."]
        for tp, got in runs.get("bs1_ratios", {}).items():
            lines += ["", _ratio_line("Decode batch 1", tp, got)]
        piped = [run for run in runs["runs"] if "session" in run["decode_bs1"]]
        if piped:
            lines += ["", "Through a Session with two steps in flight, each continuing from "
                      "the device's last samples (as a pipelined scheduler runs): wall ms "
                      "per token at the client / replay ms per step on rank 0 (mean) / "
                      "launch lag ms (mean).", "",
                      "| TP | " + " | ".join(f"bs{b}" for b in BATCHES) + " |",
                      "|---:|" + "---|" * len(BATCHES)]
            for run in piped:
                label = run["tp"] if run["tp"] == 1 else f"{run['tp']} ({run['all_reduce']})"
                cells = [" / ".join("-" if v is None else f"{v:.3f}" for v in (
                    session.get("per_token_ms"), session.get("replay_ms_mean"),
                    session.get("launch_lag_ms_mean")))
                    for session in (run[f"decode_bs{b}"].get("session", {}) for b in BATCHES)]
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
        for name, what, _ in SESSION_RATIOS:
            for tp, got in runs.get("bs1_session_ratios", {}).get(name, {}).items():
                lines += ["", _ratio_line(f"Decode batch 1 through the Session, {what}",
                                          tp, got)]
        for tp, ar in runs.get("allreduce_us", {}).items():
            lines += ["", f"All-reduce of one (rows, hidden) bf16 activation across "
                      f"{tp} GPUs inside a CUDA graph, µs (two per layer):", ""]
            for algo, got in ar.items():
                lines.append(f"- `--tp-all-reduce {algo}` ({got['algorithm']}, sums exact: "
                             f"{got['ok']}): " + ", ".join(
                                 f"{k} rows {v:.1f}" for k, v in got["us"].items()))
                send = got.get("send")
                if send:
                    lines.append(
                        f"  - one-row projection ({SEND_K} -> hidden) + all-reduce, µs per "
                        f"pair: {send['us_per_pair']['plain']:.1f} as two calls, "
                        f"{send['us_per_pair']['send']:.1f} through `linear_all_reduce` "
                        f"(the GEMM {'sends' if send['sends'] else 'does not send'}; "
                        f"same bits: {send['ok']})")
        lines.append("")
    return "\n".join(lines)


def parse_runs(shapes_arg: str, tp: str) -> list[tuple[str, list[tuple[int, str]]]]:
    """``--shapes`` and ``--tp`` -> each shape with its (size, all-reduce) runs: a shape
    written ``name@4+8`` keeps only the runs of those sizes."""
    variants = [(int(t.split(":")[0]), t.split(":")[1] if ":" in t else "auto")
                for t in tp.split(",")]
    out = []
    for item in shapes_arg.split(","):
        shape, _, only = item.partition("@")
        sizes = {int(n) for n in only.split("+")} if only else None
        out.append((shape, [v for v in variants if sizes is None or v[0] in sizes]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b",
                    help="comma-separated; shape@4+8 runs that shape at the --tp runs of "
                    "sizes 4 and 8 only (llama-3.1-70b@4: its weights fit only there)")
    ap.add_argument("--tp", default="1,2,2:nccl",
                    help="runs, comma-separated: a TP size, optionally :auto, :nccl, "
                    ":symm_mem, :flags or :push (--tp-all-reduce; default auto), then /on "
                    "or /off for --tp-gemm-send (2:auto/off); a size may repeat "
                    "(2,1,2,1,2): the batch-1 ratio is then the median over its runs")
    ap.add_argument("--load-format", choices=("safetensors", "random"), default="safetensors",
                    help="random: write only each shape's config.json and let the server "
                    "draw the weights on the GPUs (serve --load-format random)")
    ap.add_argument("--no-all-reduce-table", action="store_true",
                    help="skip the all-reduce timings (about 30 s per TP size)")
    ap.add_argument("--serve-args", default="",
                    help="more arguments for every server, space-separated "
                    "('--weight-prefetch on')")
    ap.add_argument("--models", type=Path, default=Path("/tmp/model-executor-bench"))
    ap.add_argument("--out", type=Path, default=Path("results-local"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.e2e.tensor_parallel needs CUDA GPUs")
    from bench.common.hardware import read_bandwidth_gbs

    plan = parse_runs(a.shapes, a.tp)
    sizes = [size for _, runs in plan for size, _ in runs] or [1]
    if max(sizes) > torch.cuda.device_count():
        raise SystemExit(f"TP {max(sizes)} needs {max(sizes)} GPUs; "
                         f"{torch.cuda.device_count()} here")
    read_gbs = read_bandwidth_gbs()
    torch.cuda.empty_cache()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0),
                              "gpus": torch.cuda.device_count(), "read_gbs": read_gbs,
                              "commit": git_commit(),
                              "serve_args": a.serve_args,
                              "shapes": {}}
    a.out.mkdir(parents=True, exist_ok=True)
    result["load_format"] = a.load_format
    for shape, variants in plan:
        started = time.perf_counter()
        model, s = shapes.model(shape, a.models, a.load_format)
        runs = []
        for tp, algo in variants:
            run = measure(model, tp, s.vocab_size, algo, a.load_format, a.serve_args.split())
            run["floor_ms"] = weight_bytes(shape) / tp / (read_gbs * 1e9) * 1e3
            runs.append(run)
            print(json.dumps({shape: run}), flush=True)
        entry: dict[str, Any] = {"runs": runs, "seconds": time.perf_counter() - started}
        ratios = bs1_ratios(runs)
        if ratios:
            entry["bs1_ratios"] = ratios
        piped = session_ratios(runs)
        if piped:
            entry["bs1_session_ratios"] = piped
        if not a.no_all_reduce_table:
            entry["allreduce_us"] = {tp: allreduce_us(tp, s.hidden_size)
                                     for tp in sorted({r["tp"] for r in runs
                                                       if r["tp"] > 1
                                                       and r["all_reduce"] == "auto"})}
        result["shapes"][shape] = entry
        (a.out / "tensor_parallel.json").write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (a.out / "tensor_parallel.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
