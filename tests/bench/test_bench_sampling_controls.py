"""``bench.serving.sampling_controls`` on CPU (``tiny``, batch 2, a few steps): every row of
the summary is filled, the table prints and the JSON is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.serving import sampling_controls

pytest.importorskip("xgrammar")


def test_smoke_run_fills_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert sampling_controls.main(["--shape", "tiny", "--device", "cpu", "--batch", "2",
                                   "--steps", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for row in ("| plain |", "| masked |", "| controls |", "| unconstrained |", "| grammar |"):
        assert row in out
    assert (tmp_path / "sampling_controls.json").is_file()
