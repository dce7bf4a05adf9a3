"""Fixtures shared by the GPU test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.helpers import gpu_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small GPU Llama (``gpu_model``), written once per test module."""
    return gpu_model(tmp_path_factory.mktemp("m"))
