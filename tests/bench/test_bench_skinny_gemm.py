"""``bench.kernels.skinny_gemm``'s CPU-side parts: which row-kernel tiles its sweep tries, and the
report line with the row kernel's figures."""

from __future__ import annotations

from bench.kernels import skinny_gemm as bench


def test_row_sweep_skips_tiles_that_would_spill_registers() -> None:
    """At most 128 weight values a thread: every tile at K = 2048, none of 8 columns
    with 4 warps from K = 4096, only 1-2 columns at K = 14336 (a 16384-wide row)."""
    assert bench.row_candidates(2048) == bench.ROW_SWEEP
    at_4096 = bench.row_candidates(4096)
    assert (8, 8, 1) in at_4096 and not any(c[:2] == (8, 4) for c in at_4096)
    assert {c[0] for c in bench.row_candidates(8192)} == {1, 2, 4}
    assert (4, 4, 1) not in bench.row_candidates(8192)
    assert {c[:2] for c in bench.row_candidates(14336)} == {(1, 4), (1, 8), (2, 8)}


def test_report_line_has_the_row_kernel_and_failed_candidates() -> None:
    row = {"proj": "qkv", "n": 3072, "k": 2048, "floor_us": 4.1, "unfused_us": 8.9,
           "skinny_us": 7.4, "tile": [4, 2048, 4, 3, False], "row_us": 5.6,
           "row_tile": [4, 8, 4], "best_us": 7.3, "best_tile": [4, 2048, 8, 3, False],
           "sweep": {"[4, 2048, 8, 3]": 7.3}, "best_row_us": 5.5,
           "best_row_tile": [8, 8, 2], "row_sweep": {"[8, 8, 2]": 5.5, "[1, 4, 1]": "Err"}}
    line = bench._line(row)
    assert "row    5.6 [4, 8, 4]" in line and "best row    5.5 [8, 8, 2]" in line
    assert line.endswith("FAILED ['[1, 4, 1]']")


def test_moe_shape_projections_are_attention_router_and_head() -> None:
    """A mixture of experts' layer has no dense MLP to tune: its skinny GEMMs are qkv, o
    and the router (experts x hidden); a dense shape keeps gate_up and down."""
    from bench.common import shapes

    moe = shapes.projections(shapes.spec("qwen3-30b-a3b"))
    assert moe == {"qkv": (2048, 32 * 128 + 2 * 4 * 128), "o": (32 * 128, 2048),
                   "router": (2048, 128), "lm_head": (2048, 151936)}
    dense = shapes.projections(shapes.spec("llama-3.2-1b"))
    assert {"gate_up", "down"} <= dense.keys() and "router" not in dense
