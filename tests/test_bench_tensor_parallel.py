"""``bench.tensor_parallel``'s plan and report, on CPU (the runs themselves need GPUs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.tensor_parallel import BATCHES, PREFILL, markdown, parse_runs


def test_a_shape_can_keep_only_some_sizes() -> None:
    plan = parse_runs("llama-3.1-8b,llama-3.1-70b@4+8", "1,2,4:nccl,8")
    assert plan == [("llama-3.1-8b", [(1, "auto"), (2, "auto"), (4, "nccl"), (8, "auto")]),
                    ("llama-3.1-70b", [(4, "nccl"), (8, "auto")])]
    assert parse_runs("tiny@3", "1,2") == [("tiny", [])]


def _run(tp: int, algo: str, bs1_ms: float) -> dict[str, object]:
    return {"tp": tp, "all_reduce": algo, "floor_ms": 1.0 / tp,
            **{f"decode_bs{b}": {"replay_ms_mean": bs1_ms * (1 + b / 100),
                                 "forward_ms_median": bs1_ms} for b in BATCHES},
            f"prefill_{PREFILL}_ms_median": 10.0 / tp}


def test_the_report_gives_every_size_its_ratio_and_all_reduce_table() -> None:
    result = {"device": "GPU", "gpus": 4, "commit": "abc", "read_gbs": 1000.0, "shapes": {
        "8B": {"runs": [_run(1, "auto", 4.0), _run(2, "auto", 3.0), _run(4, "auto", 2.4)],
               "bs1_ratios": {2: 0.75, 4: 0.6},
               "allreduce_us": {2: {"nccl": {"algorithm": "nccl", "ok": True,
                                             "us": {"1": 10.0}}}}},
        "70B": {"runs": [_run(4, "auto", 13.5)]}}}
    # As written to tensor_parallel.json and read back (the sizes become strings).
    md = markdown(json.loads(json.dumps(result)))
    assert "TP = 2 (auto) / TP = 1: 0.75" in md and "TP = 4 (auto) / TP = 1: 0.60" in md
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
