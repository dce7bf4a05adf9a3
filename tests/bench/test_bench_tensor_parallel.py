"""``bench.e2e.tensor_parallel``'s plan and report, on CPU (the runs themselves need GPUs)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from bench.e2e.tensor_parallel import (
    BATCHES,
    PREFILL,
    bs1_ratios,
    decode_histograms,
    markdown,
    mean_ms,
    parse_runs,
    replay_ms,
    session_ratios,
)


def test_a_shape_can_keep_only_some_sizes() -> None:
    plan = parse_runs("llama-3.1-8b,llama-3.1-70b@4+8", "1,2,4:nccl,8")
    assert plan == [("llama-3.1-8b", [(1, "auto"), (2, "auto"), (4, "nccl"), (8, "auto")]),
                    ("llama-3.1-70b", [(4, "nccl"), (8, "auto")])]
    assert parse_runs("tiny@3", "1,2") == [("tiny", [])]


def _run(tp: int, algo: str, bs1_ms: float) -> dict[str, object]:
    return {"tp": tp, "all_reduce": algo, "floor_ms": 1.0 / tp,
            **{f"decode_bs{b}": {"replay_ms_median": bs1_ms * (1 + b / 100),
                                 "replay_ms_mean": 9.0, "forward_ms_median": bs1_ms}
               for b in BATCHES},
            f"prefill_{PREFILL}_ms_median": 10.0 / tp}


def test_the_report_gives_every_size_its_ratio_and_all_reduce_table() -> None:
    runs = [_run(1, "auto", 4.0), _run(2, "auto", 3.0), _run(4, "auto", 2.4)]
    result = {"device": "GPU", "gpus": 4, "commit": "abc", "read_gbs": 1000.0, "shapes": {
        "8B": {"runs": runs, "bs1_ratios": bs1_ratios(runs),
               "allreduce_us": {2: {"nccl": {"algorithm": "nccl", "ok": True,
                                             "us": {"1": 10.0}}}}},
        "70B": {"runs": [_run(4, "auto", 13.5)]}}}
    # As written to tensor_parallel.json and read back (the sizes become strings).
    md = markdown(json.loads(json.dumps(result)))
    assert "TP = 2 (auto) / TP = 1: 0.750" in md and "TP = 4 (auto) / TP = 1: 0.600" in md
    assert "across 2 GPUs" in md and "1 rows 10.0" in md
    assert "| 4 (auto) | 0.250 | 2.424 (9.70x)" in md
    assert "## 70B" in md and "13.635 (54.54x)" in md


def test_serve_args_reach_every_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--serve-args`` (``main`` splits them on spaces) follow the run's own flags in
    every server's command line."""
    import bench.e2e.tensor_parallel as tp

    seen: list[list[str]] = []

    def fake_serve(model: Path, size: int, extra: list[str] | None = None) -> None:
        seen.append(list(extra or []))
        raise RuntimeError("stop")  # measure() needs no more of this server

    monkeypatch.setattr(tp, "serve", fake_serve)
    with pytest.raises(RuntimeError, match="stop"):
        tp.measure(Path("m"), 2, 100, "flags/off", "random",
                   ["--prefill-graph", "fixed_grid"])
    assert seen == [["--tp-all-reduce", "flags", "--tp-gemm-send", "off",
                     "--load-format", "random", "--prefill-graph", "fixed_grid"]]


def test_a_slow_step_moves_the_median_only_within_its_window() -> None:
    # (sum s, count) after each window of 5 steps of 3 ms; the third window holds one
    # step of 23 ms, and its replays trail the steps by one (the first read has 4).
    marks, total, count = [(0.0, 0.0)], 0.0, 0
    for w, n in enumerate((4, 5, 5, 5, 5)):
        total += n * 0.003 + (0.020 if w == 2 else 0.0)
        count += n
        marks.append((total, float(count)))
    got = replay_ms(marks)
    assert got["replay_ms_windows"] == pytest.approx([3.0, 3.0, 7.0, 3.0, 3.0])
    assert got["replay_ms_median"] == pytest.approx(3.0)
    assert got["replay_ms_mean"] == pytest.approx((24 * 3 + 20) / 24)
    # a window with no replay recorded yet is left out, not divided by zero
    assert replay_ms([(0.0, 0.0), (0.0, 0.0), (0.006, 2.0)])["replay_ms_windows"] == \
        pytest.approx([3.0])


def test_the_ratio_is_the_median_over_repeated_runs_of_the_default_algorithm() -> None:
    runs = [_run(2, "auto", 3.32), _run(1, "auto", 5.437), _run(2, "auto", 3.309),
            _run(1, "auto", 5.452), _run(2, "auto", 3.365), _run(2, "push/off", 2.0)]
    for r, ms in zip(runs, (3.32, 5.437, 3.309, 5.452, 3.365, 2.0), strict=True):
        r["decode_bs1"] = {"replay_ms_median": ms, "replay_ms_mean": 9.0}  # the median counts
    got = bs1_ratios(runs)
    assert list(got) == [2]
    assert got[2]["ratio"] == pytest.approx(3.32 / ((5.437 + 5.452) / 2))
    assert got[2]["tpn_ms"] == [3.32, 3.309, 3.365]  # not the off run
    md = markdown({"device": "GPU", "gpus": 2, "commit": "abc", "read_gbs": 1000.0,
                   "shapes": {"8B": {"runs": runs, "bs1_ratios": got}}})
    assert "TP = 2 (auto) / TP = 1: 0.610 (medians over 3 and 2 runs; TP = 1 runs " \
        "5.437-5.452 ms; TP = 2 runs 3.309-3.365 ms" in md
    assert bs1_ratios([_run(2, "auto", 3.0)]) == {}  # no TP = 1 run: no ratio


def test_the_launch_lag_is_read_from_the_scrape_and_reported_per_run() -> None:
    def scrape(replay: tuple[float, float], lag: tuple[float, float] | None) -> str:
        lines = [f'model_executor_graph_replay_seconds_sum{{phase="decode"}} {replay[0]}',
                 f'model_executor_graph_replay_seconds_count{{phase="decode"}} {replay[1]}',
                 'model_executor_graph_replay_seconds_sum{phase="prefill"} 99.0']
        if lag is not None:
            for name, (total, n) in (("tp_launch_lag_seconds", lag),
                                     ("tp_step_delivery_seconds", (lag[0] / 2, lag[1]))):
                lines += [f'model_executor_{name}_sum{{phase="decode"}} {total}',
                          f'model_executor_{name}_count{{phase="decode"}} {n}']
        return "\n".join(lines) + "\n"

    first = decode_histograms(scrape((1.0, 10.0), (0.001, 10.0)))
    last = decode_histograms(scrape((1.2, 50.0), (0.003, 50.0)))
    assert first == {"replay": (1.0, 10.0), "lag": (0.001, 10.0), "delivery": (0.0005, 10.0)}
    assert mean_ms(first, last, "lag") == pytest.approx(0.05)  # 2 ms over 40 steps
    assert mean_ms(first, last, "delivery") == pytest.approx(0.025)
    tp1 = decode_histograms(scrape((1.0, 10.0), None))  # one process: no such series
    assert tp1["lag"] == (0.0, 0.0) and mean_ms(tp1, tp1, "lag") is None

    runs = [_run(1, "auto", 4.0), _run(2, "auto", 3.0)]
    for b in BATCHES:
        for key in ("launch_lag_ms_mean", "delivery_ms_mean"):
            runs[0][f"decode_bs{b}"][key] = None  # type: ignore[index]
        runs[1][f"decode_bs{b}"]["launch_lag_ms_mean"] = 0.05 * b  # type: ignore[index]
        runs[1][f"decode_bs{b}"]["delivery_ms_mean"] = 0.01  # type: ignore[index]
    md = markdown({"device": "GPU", "gpus": 2, "commit": "abc", "read_gbs": 1000.0,
                   "shapes": {"8B": {"runs": runs}}})
    assert "launched a decode step (mean, ms, batch 1/8/64): TP = 2 (auto) 0.050 / 0.400 / " \
        "3.200." in md
    assert "having it (mean, ms, batch 1/8/64): TP = 2 (auto) 0.010 / 0.010 / 0.010." in md


def _piped(run: dict[str, object], per_token: float, replay: float) -> None:
    for b in BATCHES:
        run[f"decode_bs{b}"]["session"] = {  # type: ignore[index]
            "per_token_ms": per_token, "replay_ms_mean": replay,
            "launch_lag_ms_mean": None if run["tp"] == 1 else 0.004, "delivery_ms_mean": None}


def test_the_session_gives_its_own_ratios_and_table() -> None:
    runs = [_run(2, "auto", 3.3), _run(1, "auto", 5.4), _run(2, "auto", 3.2),
            _run(1, "auto", 5.5), _run(2, "push/off", 9.0)]
    for run, (per_token, replay) in zip(runs, ((3.4, 3.1), (5.6, 5.4), (3.5, 3.0),
                                                (5.8, 5.5), (9.0, 9.0)), strict=True):
        _piped(run, per_token, replay)
    got = session_ratios(runs)
    assert got["per_token"][2]["ratio"] == pytest.approx(3.45 / 5.7)
    assert got["replay"][2]["ratio"] == pytest.approx(3.05 / 5.45)
    assert got["replay"][2]["tpn_ms"] == [3.1, 3.0]  # the default algorithm's runs only
    md = markdown(json.loads(json.dumps({
        "device": "GPU", "gpus": 2, "commit": "abc", "read_gbs": 1000.0,
        "shapes": {"8B": {"runs": runs, "bs1_ratios": bs1_ratios(runs),
                          "bs1_session_ratios": got}}})))
    assert "| 2 (auto) | 3.400 / 3.100 / 0.004 |" in md and "| 1 | 5.600 / 5.400 / - |" in md
    assert "through the Session, wall time per token at the client, TP = 2 (auto) / TP = 1: " \
        "0.605 (medians over 2 and 2 runs; TP = 1 runs 5.600-5.800 ms; TP = 2 runs " \
        "3.400-3.500 ms" in md
    assert "through the Session, replay per step on rank 0, TP = 2 (auto) / TP = 1: 0.560" in md
    # runs without a Session (older results, or a server that failed before it) give none
    assert session_ratios([_run(2, "auto", 3.0), _run(1, "auto", 5.0)]) == {}


def test_the_pipelined_session_is_timed_with_every_step_answered_by_the_other_rank() -> None:
    """``pipelined`` against a real ``serve --tensor-parallel-size 2`` on CPU (gloo, the
    local control channel): the client's time per token, and each of the session's steps
    (10 untimed + ``SESSION_STEPS``) answered by rank 1 with its receipt and launch."""
    from urllib.parse import urlparse

    from bench.common.server import Client
    from bench.e2e.tensor_parallel import SESSION_STEPS, _decode_histograms, pipelined
    from service.gen.model_executor.v1 import executor_pb2 as pb
    from tests.helpers.serving import ServeProcess

    server = ServeProcess(["--model", "tiny", "--kv-tokens", "512", "--max-context", "128",
                           "--max-sequences", "4", "--drain-delay", "0",
                           "--tensor-parallel-size", "2", "--metrics-port", "0"])
    try:
        server.wait_ready()
        port = urlparse(str(server.events("serving")[0]["metrics"])).port
        assert port is not None
        ids = ["a", "b"]
        server.stub.Prefill(pb.PrefillRequest(items=[
            pb.PrefillItem(seq_id=s, token_ids=[3 + i, 9, 27, 81], sample=True)
            for i, s in enumerate(ids)]), timeout=60)
        before = _decode_histograms(port)
        client = Client(server.target, 256)
        try:
            got = pipelined(client, port, ids)
        finally:
            client.channel.close()
        after = _decode_histograms(port)
        assert after["delivery"][1] - before["delivery"][1] == SESSION_STEPS + 10
        assert after["lag"][1] - before["lag"][1] == SESSION_STEPS + 10
        assert got["per_token_ms"] > 0 and got["delivery_ms_mean"] > 0
        assert got["launch_lag_ms_mean"] is not None and got["launch_lag_ms_mean"] >= 0
        assert got["replay_ms_mean"] is None  # no graphs on CPU
        assert client.seen == []
        # the sequences went on from the Session's last samples: 4 + 1 + 90 tokens each
        out = server.stub.Decode(pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id=s, use_last_sampled=True) for s in ids]), timeout=60)
        assert [o.seq_len for o in out.outputs] == [4 + SESSION_STEPS + 10 + 1] * 2
    finally:
        server.stop(10)


def _stuck_worker(rank: int, world: int, port: int, queue: Any) -> None:
    """Rank 0 reports; every rank then hangs, as one stuck in its group's teardown."""
    if rank == 0:
        queue.put({"ok": True})
    time.sleep(3600)


def test_spawn_ranks_stops_ranks_that_do_not_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that never exits is stopped (SIGTERM, then SIGKILL) after a bounded wait:
    none outlives the call, so the caller's own exit does not wait for it."""
    import multiprocessing

    from bench.e2e import tensor_parallel

    monkeypatch.setattr(tensor_parallel, "RANK_EXIT_S", 1.0)
    started = time.monotonic()
    assert tensor_parallel.spawn_ranks(_stuck_worker, 2) == {"ok": True}
    assert time.monotonic() - started < 60
    assert not [p for p in multiprocessing.active_children()
                if p.name.startswith(("Process", "SpawnProcess"))]
