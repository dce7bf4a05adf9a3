"""``bench.e2e.fp8``'s floors and report on CPU (the measurement needs an FP8 GPU)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench.common import shapes
from bench.e2e import fp8


def test_fp8_floor_counts_projections_at_one_byte() -> None:
    spec = shapes.spec("llama-3.1-8b")
    bf16 = fp8.floors(spec, "decode", 1, 0, 1000.0, 500.0, 1000.0, fp8=False)
    f8 = fp8.floors(spec, "decode", 1, 0, 1000.0, 500.0, 1000.0, fp8=True)
    # 8B: 15.0 GB read per step in bf16, 7.0 GB of them projections
    assert bf16 == pytest.approx(shapes.weight_bytes("llama-3.1-8b") / 1e9)
    assert bf16 - f8 == pytest.approx(fp8.projection_params(spec) / 1e9)
    assert 0.5 < f8 / bf16 < 0.55
    # prefill 2048 is FLOP-bound: projections at the FP8 rate
    p16 = fp8.floors(spec, "prefill", 2048, 0, 3000.0, 700.0, 1400.0, fp8=False)
    p8 = fp8.floors(spec, "prefill", 2048, 0, 3000.0, 700.0, 1400.0, fp8=True)
    assert p16 == pytest.approx(2 * spec.num_params() * 2048 / 700e12 * 1e3)
    assert 0.5 < p8 / p16 < 0.6


def test_report_marks_targets() -> None:
    run = {"quantization": "fp8_at_load", "weight_format": "fp8_e4m3"}
    result = {"model": "llama-3.1-8b", "device": "H100", "commit": "abc",
              "read_bandwidth_gbs": 3000.0, "matmul_tflops": 700.0, "fp8_matmul_tflops": 1400.0,
              "steps": 10, "context": 512, "runs": {
                  "bf16": {**run, "cases": {"decode:1": {"gpu_ms": 5.3, "floor_ms": 5.0},
                                            "decode:64": {"gpu_ms": 6.0, "floor_ms": 5.5}}},
                  "fp8": {**run, "cases": {"decode:1": {"gpu_ms": 3.0, "floor_ms": 2.7},
                                           "decode:64": {"gpu_ms": 5.0, "floor_ms": 3.2}}}}}
    text = fp8.markdown(result)
    assert "| decode:1 | 5.300 | 3.000 | 0.566 | <= 0.63 met | 2.700 | 1.11x | 1.06x |" in text
    assert "| decode:64 | 6.000 | 5.000 | 0.833 | <= 0.8 MISSED |" in text


def test_tile_file_merge_replaces_rows_of_the_same_key(tmp_path: Any) -> None:
    from bench.kernels.fp8_gemm import merge_tiles
    from executor.quant import tiles

    path = tmp_path / "tiles.json"
    row = {"device": "H100", "scales": "rows", "m": 1, "n": 4096, "k": 4096, "input_op": 3,
           "tile": [4, 2048, 8, 3], "us": 10.0}
    merge_tiles(path, [row, {**row, "n": 6144}])
    merge_tiles(path, [{**row, "tile": [2, 1024, 8, 3], "us": 9.0}])
    rows = json.loads(path.read_text())["tiles"]
    assert [(r["n"], r["tile"]) for r in rows] == [(4096, [2, 1024, 8, 3]), (6144, [4, 2048, 8, 3])]
    assert "tiles" in json.loads(tiles.TILES_FILE.read_text())  # the shipped file parses


def test_sweep_candidates_and_row_tiles_round_trip(tmp_path: Any) -> None:
    """At one row the sweep times the row kernel's tiles (``--kernel row``: against the
    w8a16 tile in use only); a winning row tile is written with ``kernel`` "row" and read
    back as the same ``Fp8RowTile``; tiles.json rows without ``kernel`` stay w8a16 tiles."""
    from bench.kernels.fp8_gemm import _tile_list, candidates, merge_tiles
    from executor.quant import tiles
    from executor.quant.tiles import Fp8RowTile

    short = candidates(1, 4096, 4096, False, tiles.ADD_RMS_NORM, "row")
    assert [type(t) for t in short].count(tiles.Fp8Tile) == 1
    rows = [t for t in short if isinstance(t, Fp8RowTile)]
    assert Fp8RowTile(4, 8, 4, 0) in rows and Fp8RowTile(4, 8, 2, 3) in rows
    assert all(8192 <= t.block_n * 4096 <= 65536 for t in rows)
    assert not any(isinstance(t, Fp8RowTile) for t in candidates(8, 4096, 4096, False, 0))
    assert not any(isinstance(t, Fp8RowTile) for t in candidates(1, 4096, 4096, True, 0, "w8a16"))
    path = tmp_path / "tiles.json"
    merge_tiles(path, [{"device": "GPU", "scales": "rows", "m": 1, "n": 4096, "k": 4096,
                        "input_op": 0, "kernel": "row", "tile": _tile_list(Fp8RowTile(2, 4, 1, 4)),
                        "us": 5.0}])
    row = json.loads(path.read_text())["tiles"][0]
    assert tiles._tile(row) == Fp8RowTile(2, 4, 1, 4)
    assert tiles._tile({**row, "kernel": None, "tile": [2, 1024, 8, 3]}) == \
        tiles.Fp8Tile(2, 1024, 8, 3)
    shipped = json.loads(tiles.TILES_FILE.read_text())["tiles"]
    assert all(isinstance(tiles._tile(r), Fp8RowTile) == (r.get("kernel") == "row")
               for r in shipped)


def test_glu_rows_merge_apart_and_time_the_same_weight_blocks(tmp_path: Any) -> None:
    """The sweep's GLU gate_up rows (``glu``) merge beside the plain launch's rows of the
    same weight, not over them; its candidates are the plain ones with half the columns
    per block (the same weight rows); the GLU gate_up and the plain-input down are
    projections of their own, below 8 rows."""
    import dataclasses

    from bench.kernels.fp8_gemm import FEW_ROWS_ONLY, PROJECTIONS, candidates, merge_tiles
    from executor.quant import tiles

    path = tmp_path / "tiles.json"
    row = {"device": "H200", "scales": "rows", "m": 1, "n": 28672, "k": 4096, "input_op": 3,
           "kernel": "row", "tile": [4, 8, 2, 3], "us": 35.0}
    merge_tiles(path, [row, {**row, "glu": True, "tile": [2, 8, 2, 3]}])
    merge_tiles(path, [{**row, "glu": True, "tile": [1, 16, 1, 4]}])
    rows = json.loads(path.read_text())["tiles"]
    assert [(r.get("glu", False), r["tile"]) for r in rows] == \
        [(False, [4, 8, 2, 3]), (True, [1, 16, 1, 4])]
    plain = candidates(1, 28672, 4096, False, tiles.ADD_RMS_NORM)
    glu = candidates(1, 28672, 4096, False, tiles.ADD_RMS_NORM, glu=True)
    assert {dataclasses.replace(t, block_n=2 * t.block_n) for t in glu} == set(plain)
    assert PROJECTIONS["gate_up_glu"] == ("gate_up", tiles.ADD_RMS_NORM, True)
    assert PROJECTIONS["down_plain"] == ("down", tiles.PLAIN, False)
    assert set(FEW_ROWS_ONLY) == {"gate_up_glu", "down_plain"}
