"""The benchmark end to end on a CPU-only machine: ``python -m bench.e2e.run --profile smoke``.

Without CUDA the smoke profile measures what a CPU can run (eager steps with torch_native
attention, HF transformers eager on the same weights) through the same entry point, tables
and plots as the GPU profiles, so the benchmark pipeline is exercised by the CPU suite.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.e2e.run import CPU_MODE, main

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="with CUDA the smoke profile measures graphs: "
                                       "bench/scripts/gpu_check.sh smoke")


def test_smoke_profile_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["--profile", "smoke", "--out", str(out), "--models", str(tmp_path / "m")]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["shape"] == "tiny" and result["environment"]["device"].startswith("CPU")
    assert result["hardware"]["read_gbs"] > 0 and result["hardware"]["matmul_tflops"] > 0
    decode = result["decode_table"]
    assert sorted((r["batch"], r["context"]) for r in decode) == [(1, 128), (8, 128)]
    assert all(r["mode"] == "eager@torch_native" and r["paths"] == ["eager"]
               and r["step_ms_median"] > 0 for r in decode)
    pre = result["prefill_table"]
    assert sorted((r["tokens"], r["sequences"]) for r in pre) == [
        (16, 1), (16, 2), (128, 1), (128, 2)]
    assert all(r["ms_median"] > 0 and r["paths"] == ["eager"] for r in pre)
    assert [s["decode_mode"] for s in result["startup"]][:1] == [CPU_MODE]
    peer = result["peer"]
    assert peer["decode_bs1_eager_ms"] > 0 and set(peer["prefill_eager_ms"]) == {"16", "128"}
    md = (out / "bench.md").read_text()
    assert "embedded tiny model" in md and "| tiny decode bs1 (ctx 128) |" in md
    assert all((out / name).stat().st_size > 1000 for name in result["plots"])


def test_gpu_profiles_refuse_to_run_without_cuda(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--profile", "quick", "--out", str(tmp_path)])
    assert "needs a CUDA device" in capsys.readouterr().err


def test_host_profile_stage_clock_times_every_stage_of_a_step() -> None:
    from bench.profile.host_profile import StageClock, _step_fn
    from executor.config import ExecutorConfig, ModelConfig
    from executor.executor import Executor

    ex = Executor(ExecutorConfig(model=ModelConfig(source="tiny"), device="cpu"))
    step = _step_fn(ex, "prefill", 24, 2)
    clock = StageClock(ex)
    for _ in range(3):
        step()
    assert {"validate", "allocate", "build_batch", "metadata", "logits", "sample",
            "complete", "release"} <= set(clock.times)
    assert len(clock.times["sample"]) == 3 and all(t > 0 for t in clock.times["build_batch"])
    stats = ex.kv_stats()  # the wrapped release still frees every sequence
    assert stats.free_tokens == stats.total_tokens and stats.active_sequences == 0
    assert clock.report(3, [1.0] * 3).startswith("  host stages (us per call): validate ")


def test_kv_primitives_bench_runs_on_cpu(tmp_path: Path) -> None:
    """``bench.e2e.kv_primitives`` on the tiny model: forks use fewer KV tokens than full
    prefills, a perfect drafter gets every draft accepted, and speculative decoding gives
    Decode's tokens (float32: the verify path and the decode path agree exactly here)."""
    from bench.e2e.kv_primitives import main as kv_main

    assert kv_main(["--device", "cpu", "--out", str(tmp_path), "--children", "3", "--prefix",
                    "40", "--suffix", "3", "--rounds", "2", "--spec-tokens", "10",
                    "--spec-k", "4"]) == 0
    result = json.loads((tmp_path / "kv_primitives.json").read_text())
    shared = result["shared_prefix"]
    assert (shared["full_kv_tokens"], shared["fork_kv_tokens"]) == (3 * 43, 40 + 3 * 3)
    runs = {r["drafter"]: r for r in result["speculative"]["runs"]}
    assert runs["perfect"]["verify_calls"] == 2  # the prefill gives 1 token, each call 4 + 1
    assert runs["half"]["accepted_drafts_per_call"] < runs["perfect"]["accepted_drafts_per_call"]
    assert all(r["tokens_matching_reference"] == 11 for r in runs.values())
    assert "| 4 | perfect |" in (tmp_path / "kv_primitives.md").read_text()
