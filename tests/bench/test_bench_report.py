"""The benchmark's report and plots render from a result (no GPU needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.common.plots import write_plots
from bench.common.report import markdown


def result() -> dict[str, Any]:
    dec = []
    for bs in (1, 8):
        dec.append({"batch": bs, "context": 512, "mode": "eager", "step_ms_median": 10.0 + bs,
                    "forward_ms_median": None, "floor_ms": 0.6, "paths": ["eager"]})
        dec.append({"batch": bs, "context": 512, "mode": "full", "step_ms_median": 1.0 + bs,
                    "forward_ms_median": 0.9, "floor_ms": 0.6, "paths": ["graph"]})
    pre = [{"tokens": n, "sequences": 1, "mode": m, "ms_median": t, "floor_ms": 0.5,
            "paths": ["graph" if m != "eager" else "eager"], "fallback_reasons": []}
           for n in (128, 2048) for m, t in (("eager", 9.0), ("breakable", 1.5))]
    return {
        "environment": {"device": "Test GPU", "date": "2026-11-22", "git_commit": "abc",
                        "torch": "2.x", "cuda": "13", "triton": "3", "transformers": "5",
                        "driver": "1"},
        "hardware": {"read_gbs": 4000.0, "matmul_tflops": 790.0}, "profile": "quick",
        "startup": [{"decode_mode": "full", "prefill_mode": "disabled", "compiler": "eager",
                     "load_s": 1.0, "ready_s": 2.0,
                     "phases": {"decode": {"backend": "full", "capture_s": 1.0,
                                           "graph_memory_bytes": 2**20, "buckets": 3,
                                           "failed": []}}},
                    {"prefill_mode": "tc_piecewise", "error": "not built"}],
        "decode_table": dec, "prefill_table": pre,
        "peer": {"decode_bs1_eager_ms": 15.0, "prefill_eager_ms": {"128": 18.0}},
        "decode_8b_table": [
            {"batch": 1, "context": 512, "mode": m, "shape": "llama-3.1-8b", "floor_ms": 3.9,
             "step_ms_median": t} for m, t in (("eager", 30.0), ("full", 5.0))],
    }


def test_markdown_has_ratios_and_key_figures() -> None:
    md = markdown(result())
    assert "| 1 | 512 | 0.600 | 11.000 | 2.000 | 0.900 | 3.33 | 5.50 |" in md
    assert "| 128 | 1 | 0.500 | 9.000 | 1.500 | 6.00 |" in md
    key = md[md.index("## Key figures"):]
    assert "| 1B decode bs1 (ctx 512) | 2.000 | ≤ 0.8 | 0.600 | 3.33 | 15.00 | 7.50 | — |" in key
    assert "not built" in md
    assert "| 1 | 3.900 | 30.000 | 5.000 | 1.28 |" in md
    assert "| 8B decode bs1 (ctx 512) | 5.000 | ≤ 4.2 | 3.900 | 1.28 |" in key


def test_plots_are_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    paths = write_plots(result(), tmp_path)
    assert [p.name for p in paths] == ["decode.png", "prefill.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_attention_backends_get_their_own_columns() -> None:
    """``full@flashinfer`` and ``eager@flashinfer`` rows become columns; an eager row of
    another backend never counts as the best graph figure."""
    res = result()
    for bs in (1, 8):
        res["decode_table"] += [
            {"batch": bs, "context": 512, "mode": "eager@flashinfer", "step_ms_median": 0.5,
             "forward_ms_median": None, "floor_ms": 0.6, "paths": ["eager"]},
            {"batch": bs, "context": 512, "mode": "full@flashinfer", "step_ms_median": 1.5 + bs,
             "forward_ms_median": 1.2, "floor_ms": 0.6, "paths": ["graph"]}]
    res["startup"].append({"decode_mode": "full@flashinfer", "prefill_mode": "disabled",
                           "compiler": "eager", "attention": "flashinfer",
                           "boot_s": {"attention": 41.25, "weights": 0.5}, "load_s": 42.0,
                           "ready_s": 44.0, "phases": {}})
    res["startup"].append({"decode_mode": "breakable@flashinfer",
                           "error": "attention backend 'flashinfer' cannot serve here"})
    md = markdown(res)
    assert "| batch | ctx | floor | eager | full | eager@flashinfer | full@flashinfer |" in md
    assert "| 1 | 512 | 0.600 | 11.000 | 2.000 | 0.500 | 2.500 |" in md
    key = md[md.index("## Key figures"):]
    assert "| 1B decode bs1 (ctx 512) | 2.000 |" in key  # not the 0.5 eager@flashinfer
    assert "| breakable@flashinfer | — | — |" in md and "cannot serve here" in md


@pytest.mark.parametrize(("label", "parsed"), [
    ("full", ("full", "eager", "triton")),
    ("tc_piecewise:inductor", ("tc_piecewise", "inductor", "triton")),
    ("breakable@flashinfer", ("breakable", "eager", "flashinfer")),
    ("tc_piecewise:inductor@flashinfer", ("tc_piecewise", "inductor", "flashinfer")),
])
def test_mode_labels(label: str, parsed: tuple[str, str, str]) -> None:
    from bench.e2e.run import parse_mode

    assert parse_mode(label) == parsed


def test_8b_peer_and_cold_warm_start_rows() -> None:
    res = result()
    res["peer_8b"] = {"decode_bs1_eager_ms": 33.0, "decode_bs1_static_compile_ms": 6.6}
    phases = {"prefill": {"backend": "tc_piecewise", "capture_s": 2.0,
                          "graph_memory_bytes": 2**20, "buckets": 3, "failed": []}}
    for start, compile_s, ready in (("cold", 40.0, 50.0), ("warm", 0.5, 6.0)):
        res["startup"].append({"decode_mode": "disabled", "prefill_mode": "tc_piecewise",
                               "compiler": "inductor", "load_s": 1.0, "ready_s": ready,
                               "start": start, "compile": {"compile_s": compile_s},
                               "phases": phases})
    md = markdown(res)
    key = md[md.index("## Key figures"):]
    assert "| 8B decode bs1 (ctx 512) | 5.000 | ≤ 4.2 | 3.900 | 1.28 | 33.00 | 6.60 | 6.60 |" in key
    assert "| tc_piecewise (inductor), cold: compile 40.0 s | triton | 1.0 | 50.0 |" in md
    assert "| tc_piecewise (inductor), warm: compile 0.5 s | triton | 1.0 | 6.0 |" in md


def test_smoke_profile_names_its_model_and_has_no_1b_targets() -> None:
    res = result()
    res["shape"], res["key_context"] = "tiny", 128
    for row in res["decode_table"]:
        row["context"] = 128
    md = markdown(res)
    assert "embedded tiny model" in md and "Llama-3.2-1B shape" not in md
    key = md[md.index("## Key figures"):]
    assert "| tiny decode bs1 (ctx 128) | 2.000 | — | 0.600 | 3.33 |" in key
    assert "| tiny prefill 128 tok | 1.500 | — |" in key
    assert "| 8B decode bs1 (ctx 512) | 5.000 | ≤ 4.2 |" in key


def test_smoke_profile_runs_the_tiny_model_through_the_loader(tmp_path: Path) -> None:
    from bench.common import shapes
    from bench.e2e.run import PROFILES
    from executor.config import TINY_MODEL

    prof = PROFILES["smoke"]
    assert prof["shape"] == TINY_MODEL
    model_dir, spec = shapes.model(prof["shape"], tmp_path)
    assert (model_dir / "config.json").is_file() and not any(tmp_path.iterdir())
    assert max(prof["prefill_tokens"]) <= spec.max_position
    assert shapes.spec_weight_bytes(spec) > 0 and spec.num_layers > 0
