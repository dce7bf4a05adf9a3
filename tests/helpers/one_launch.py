"""Which MoE decode calls took the one-launch path (``decode_persistent.try_one_launch``)."""

from __future__ import annotations

import pytest


def count_one_launches(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """A list that each later ``try_one_launch`` call appends its answer to (it still
    runs: true where it launched, false where it left the work to the two launches)."""
    from executor.kernels.moe import decode_persistent

    taken: list[bool] = []
    real = decode_persistent.try_one_launch

    def counting(*args: object, **kwargs: object) -> bool:
        taken.append(real(*args, **kwargs))  # type: ignore[arg-type]
        return taken[-1]

    monkeypatch.setattr(decode_persistent, "try_one_launch", counting)
    return taken
