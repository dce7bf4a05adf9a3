"""Fixtures shared by the GPU test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.helpers import gpu_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small GPU Llama (``gpu_model``), written once per test module."""
    return gpu_model(tmp_path_factory.mktemp("m"))


@pytest.fixture(scope="session")
def smollm2_shape(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M's shape (hidden 576, 9 query and 3 KV heads, 30 layers, tied
    embeddings) with random bf16 weights, written once per run: the real checkpoint cannot
    reach the GPU machines (``bench/results/README.md``)."""
    from bench.common.shapes import write_shape

    return write_shape("smollm2-135m", tmp_path_factory.mktemp("smollm2"))
