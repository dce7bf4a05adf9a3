from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.models import write_model

torch.set_num_threads(min(2, os.cpu_count() or 1))

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep the tiny model cache of the test run out of the user's home."""
    old = os.environ.get("MODEL_EXECUTOR_CACHE")
    os.environ["MODEL_EXECUTOR_CACHE"] = str(tmp_path_factory.mktemp("me-cache"))
    yield
    if old is None:
        os.environ.pop("MODEL_EXECUTOR_CACHE", None)
    else:
        os.environ["MODEL_EXECUTOR_CACHE"] = old


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {kind: write_model(root, kind, seed=i) for i, kind in enumerate(ARCHS)}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marker 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
