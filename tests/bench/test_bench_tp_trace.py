"""``bench.profile.tp_trace``: traces of a served tensor-parallel step on every rank, and their
report (on CPU: gloo, the local control channel)."""

from __future__ import annotations

import os
from pathlib import Path

from bench.profile.tp_trace.__main__ import COLUMNS, group, read, report, rows
from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.helpers.serving import ROOT, ServeProcess


def _write(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def test_each_rank_0_gets_its_own_ranks_and_every_step_its_moments(tmp_path: Path) -> None:
    us = 1000  # the traces are in ns
    # server A (rank 0 pid 10, rank 1 pid 11): a capture message, then two decode steps
    # of one sequence and one prefill of two; server B (pid 20/21) later, one step.
    _write(tmp_path / "trace-10.txt", [
        f"S0 {0 * us}", f"S1 {5 * us}",  # not a step: no phase
        f"F0 {50 * us}", f"F1 {60 * us}",  # ... so this forward is not one
        f"S0 {1000 * us}", f"S1 {1030 * us} decode 1", f"P0 {1040 * us}",
        f"P1 {1050 * us}", f"F0 {1100 * us}", f"F1 {1150 * us}",
        f"S0 {2000 * us}", f"S1 {2040 * us} decode 1", f"F0 {2120 * us}",
        f"F1 {2170 * us}",
        f"S0 {3000 * us}", f"S1 {3010 * us} prefill 2", f"F0 {3100 * us}",
        f"F1 {3900 * us}"])
    _write(tmp_path / "trace-11.txt", [
        f"R0 {0 * us}", f"R1 {7 * us}",
        f"R0 {900 * us}", f"R1 {1060 * us} decode 1", f"P0 {1061 * us}",
        f"P1 {1120 * us}", f"F0 {1121 * us}", f"F1 {1170 * us}",
        f"R0 {1200 * us}", f"R1 {2050 * us} decode 1", f"P0 {2051 * us}",
        f"P1 {2100 * us}", f"F0 {2101 * us}", f"F1 {2140 * us}",
        f"R0 {2200 * us}", f"R1 {3020 * us} prefill 2", f"P1 {3050 * us}",
        f"F0 {3060 * us}", f"F1 {3950 * us}"])
    _write(tmp_path / "trace-20.txt", [f"S0 {9000 * us}", f"S1 {9010 * us} decode 4",
                                       f"F0 {9050 * us}", f"F1 {9090 * us}"])
    _write(tmp_path / "trace-21.txt", [f"R1 {9030 * us} decode 4", f"P1 {9040 * us}",
                                       f"F0 {9041 * us}", f"F1 {9080 * us}"])
    _write(tmp_path / "trace-30.txt", [f"F0 {100 * us}", f"F1 {200 * us}"])  # TP = 1
    ranks = [r for p in sorted(tmp_path.glob("*.txt")) if (r := read(p))]
    assert sorted(r.pid for r in ranks) == ["10", "11", "20", "21"]
    leaders = group(ranks)
    assert [(r.pid, [f.pid for f in r.followers]) for r in leaders] == \
        [("10", ["11"]), ("20", ["21"])]
    got = rows(leaders[0])
    assert sorted(got) == [("decode", 1), ("prefill", 2)]
    first = dict(zip(COLUMNS, got[("decode", 1)][0], strict=True))
    assert first == {"rank 0 sent": 30, "rank 0 forward call": 100,
                     "rank 0 forward return": 150, "others received": 60,
                     "others unpacked": 120, "others forward call": 121,
                     "others forward return": 170, "lag": 20}
    assert got[("decode", 1)][1][-1] == -30  # rank 1 returned first on the second step
    md = report(tmp_path)
    assert "## rank 0 pid 10 (other ranks: 11)" in md
    # medians of the two decode steps: (30, 40) -> 35, lag (20, -30) -> -5
    assert "| decode | 1 | 2 | 35.0 | 110.0 | 160.0 | 55.0 | 110.0 | 111.0 | 155.0 | -5.0 |" \
        in md
    assert "| decode | 4 | 1 | 10.0 |" in md


def test_a_served_tp2_step_is_traced_on_both_ranks(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    trace.mkdir()
    path = os.pathsep.join([str(ROOT / "bench" / "profile" / "tp_trace"), str(ROOT)])
    server = ServeProcess(["--model", "tiny", "--kv-tokens", "256", "--max-context", "64",
                           "--max-sequences", "4", "--drain-delay", "0",
                           "--tensor-parallel-size", "2"],
                          env={"MODEL_EXECUTOR_TP_TRACE": str(trace), "PYTHONPATH": path})
    try:
        server.wait_ready()
        ids = ["a", "b"]
        server.stub.Prefill(pb.PrefillRequest(items=[
            pb.PrefillItem(seq_id=s, token_ids=[3 + i, 9, 27], sample=True)
            for i, s in enumerate(ids)]), timeout=60)
        for _ in range(6):
            server.stub.Decode(pb.DecodeRequest(items=[
                pb.DecodeItem(seq_id=s, use_last_sampled=True) for s in ids]), timeout=60)
    finally:
        assert server.stop(10) == 0, "".join(server.lines)[-3000:]
    ranks = [r for p in sorted(trace.glob("trace-*.txt")) if (r := read(p))]
    assert len(ranks) == 2, sorted(p.name for p in trace.iterdir())
    (leader,) = group(ranks)
    assert len(leader.followers) == 1
    got = rows(leader)
    assert len(got[("prefill", 2)]) == 1 and len(got[("decode", 2)]) == 6
    for step in got[("decode", 2)]:
        at = dict(zip(COLUMNS, step, strict=True))
        # one host clock: rank 1 has a step only after rank 0 began sending it, unpacks
        # it before its forward, and each forward returns after it was called
        assert 0 < at["others received"] <= at["others unpacked"] <= at["others forward call"]
        assert at["others forward call"] <= at["others forward return"]
        assert 0 < at["rank 0 sent"] <= at["rank 0 forward call"] <= at["rank 0 forward return"]
    assert "| decode | 2 | 6 |" in report(trace)
