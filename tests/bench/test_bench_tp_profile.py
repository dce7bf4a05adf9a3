"""``bench.profile.tp_profile``: every rank's view of tensor-parallel decode steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.profile.tp_profile import main, markdown, summarize

NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def _kernels(first_wait: float) -> list[dict[str, Any]]:
    """A one-layer step on one rank: the embedding's all-reduce (waiting ``first_wait``
    us), qkv, attention, o + all-reduce, gate_up, down + all-reduce, the LM head."""
    names = [NCCL, "_skinny_gemm_kernel", "_decode_split_kernel", "_skinny_gemm_kernel",
             NCCL, "_skinny_gemm_kernel", "_skinny_gemm_kernel", NCCL, "nvjet_lm_head"]
    out: list[dict[str, Any]] = []
    t = 0.0
    for n in names:
        us = first_wait if not out else 10.0
        out.append({"name": n, "start_us": t, "end_us": t + us})
        t += us + 1.0
    return out


def test_summary_sets_each_rank_beside_rank_0() -> None:
    """Rank 1 launched 300 us after rank 0: rank 0's first all-reduce waited for it."""
    timed: list[dict[str, Any]] = [{"header": h, "kernels": [], "call_us": 900.0 + h}
                                   for h in (1, 2, 3)]
    profiled = [{"header": h, "kernels": _kernels(300.0 + h)} for h in (4, 5, 6)]
    lead = {"cases": {"1": {"timed": timed, "profiled": profiled}},
            "sent": {str(h): 1.0 + h for h in range(1, 7)},
            "forward": {str(h): 1.0001 + h for h in range(1, 7)}}
    other = {"kernels": {str(h): _kernels(10.0) for h in (4, 5, 6)},
             "sent": {str(h): 1.0002 + h for h in range(1, 7)},
             "forward": {str(h): 1.0004 + h for h in range(1, 7)}}
    rank0, rank1 = summarize([lead, other], num_layers=1)["1"]
    assert rank0["first_collective_us"] == 305.0  # the median step's wait
    assert rank1["first_collective_us"] == 10.0
    assert rank0["call_us"] == 902.0
    assert rank0["forward_after_rank0_us"] == 0.0
    assert rank1["forward_after_rank0_us"] == pytest.approx(300.0, abs=1e-3)
    assert rank0["to_forward_us"] == pytest.approx(100.0, abs=1e-3)  # sent -> forward
    assert rank1["to_forward_us"] == pytest.approx(200.0, abs=1e-3)  # received -> forward
    assert rank0["classes"]["collective"] == {"us": 325.0, "n": 3}
    assert rank1["classes"]["collective"] == {"us": 30.0, "n": 3}
    for r in (rank0, rank1):
        assert [r["classes"][c]["n"] for c in ("qkv", "o", "gate_up", "down", "lm_head")] \
            == [1, 1, 1, 1, 1]
        assert r["classes"]["idle"]["us"] == 8.0  # 1 us between each of 9 kernels
    text = markdown({"model": "m", "tp": 2, "device": "d", "commit": "c",
                     "read_bandwidth_gbs": 1.0, "steps": 3, "context": 8,
                     "floor_us": {"1": 50.0}, "batches": {"1": [rank0, rank1]}})
    assert "| first collective, the embedding's (profiled) | 305.0 | 10.0 |" in text
    assert "| rank 0's decode call (host, unprofiled) | 902.0 | 0.0 |" in text
    assert "| collective | 325.0 (3) | 30.0 (3) |" in text


def test_tp_profile_runs_two_gloo_ranks_on_cpu(tmp_path: Path) -> None:
    """The real flow on CPU: two ranks, the tiny model, rank 0 leading decode steps that
    the other follows; the host timestamps line up step by step."""
    assert main(["--model", "tiny", "--tp", "2", "--device", "cpu", "--batches", "1,3",
                 "--steps", "2", "--context", "40", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "tp_profile.json").read_text())
    assert set(result["batches"]) == {"1", "3"}
    for ranks in result["batches"].values():
        rank0, rank1 = ranks
        assert rank0["forward_after_rank0_us"] == 0.0 and rank0["call_us"] > 0
        assert rank0["to_forward_us"] > 0 and rank1["to_forward_us"] > 0
        assert rank0["classes"] == {} and rank1["classes"] == {}  # no CUDA kernels here
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    measured = [s["header"] for case in rank0["cases"].values()
                for part in ("timed", "profiled") for s in case[part]]
    assert len(measured) == 8 and measured == sorted(set(measured))
    assert all(rank0["cases"][b]["timed"][0]["call_us"] > 0 for b in ("1", "3"))
    # every header rank 0 sent, rank 1 received, in the same order
    assert set(rank1["sent"]) == set(rank0["sent"])
    assert all(rank1["sent"][h] >= rank0["sent"][h] for h in rank0["sent"])
