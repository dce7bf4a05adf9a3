"""``bench.tensor_parallel``'s plan and report, on CPU (the runs themselves need GPUs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.tensor_parallel import (
    BATCHES,
    PREFILL,
    bs1_ratios,
    decode_histograms,
    markdown,
    mean_ms,
    parse_runs,
    replay_ms,
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
    import bench.tensor_parallel as tp

    seen: list[list[str]] = []

    def fake_serve(model: Path, size: int, extra: list[str] | None = None) -> None:
        seen.append(list(extra or []))
        raise RuntimeError("stop")  # measure() needs no more of this server

    monkeypatch.setattr(tp, "serve", fake_serve)
    with pytest.raises(RuntimeError, match="stop"):
        tp.measure(Path("m"), 2, 100, "triton/off", "random",
                   ["--prefill-graph", "fixed_grid"])
    assert seen == [["--tp-all-reduce", "triton", "--tp-fuse-all-reduce", "off",
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
            _run(1, "auto", 5.452), _run(2, "auto", 3.365), _run(2, "lamport/off", 2.0)]
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
