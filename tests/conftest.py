"""Fixtures of the whole suite: an isolated model cache (and one SmolLM2 conversion per
run), the tiny HF checkpoints of each architecture, the families' and MoE kinds'
checkpoints with their HF references (made once, shared by their TP = 1 and TP = 2 tests),
the GPU tests' models; tests marked ``gpu`` skip without CUDA."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from tests.helpers import family_parity, moe_models
from tests.helpers.models import ARCHS, write_model

# Under pytest-xdist (``scripts/test.sh`` runs two workers) each worker takes its share of
# the cores: torch's spinning intra-op threads of two processes on the same cores starve
# each other and the servers' event loops.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
# No per-example deadline for hypothesis (tests check behaviour, never time): an example
# stalled by the other worker would otherwise fail as a missed or flaky deadline.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep the tiny model cache of the test run out of the user's home, and give the
    real-checkpoint modules (which read ``MODEL_EXECUTOR_TEST_CACHE``) one cache for the
    whole run when none is set: SmolLM2 is downloaded and converted once, not per module.
    Under pytest-xdist that one cache is shared by the workers (the run's base temporary
    directory, above each worker's own); the conversion takes a file lock, so one worker
    converts and the others wait for it."""
    old = {name: os.environ.get(name)
           for name in ("MODEL_EXECUTOR_CACHE", "MODEL_EXECUTOR_TEST_CACHE")}
    os.environ["MODEL_EXECUTOR_CACHE"] = str(tmp_path_factory.mktemp("me-cache"))
    if not old["MODEL_EXECUTOR_TEST_CACHE"]:
        if os.environ.get("PYTEST_XDIST_WORKER"):
            shared = tmp_path_factory.getbasetemp().parent / "smol-shared"
            shared.mkdir(exist_ok=True)
        else:
            shared = tmp_path_factory.mktemp("smol")
        os.environ["MODEL_EXECUTOR_TEST_CACHE"] = str(shared)
    yield
    for name, value in old.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {kind: write_model(root, kind, seed=i) for i, kind in enumerate(ARCHS)}


@pytest.fixture(scope="session")
def family_references(tmp_path_factory: pytest.TempPathFactory) -> family_parity.References:
    """The model families' checkpoints and HF references, shared by their TP = 1 and
    TP = 2 parity tests (``tests.helpers.family_parity``)."""
    return family_parity.References(tmp_path_factory.mktemp("families"))


@pytest.fixture(scope="session")
def moe_references(tmp_path_factory: pytest.TempPathFactory) -> moe_models.References:
    """The MoE checkpoints and their HF greedy references, shared by the TP = 1 and TP = 2
    serving tests (``tests.helpers.moe_models``)."""
    return moe_models.References(tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GPU tests' small Llama (``gpu_model``), written once per test module."""
    from tests.helpers.gpu import gpu_model

    return gpu_model(tmp_path_factory.mktemp("m"))


@pytest.fixture(scope="session")
def smollm2_shape(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M's shape (hidden 576, 9 query and 3 KV heads, 30 layers, tied
    embeddings) with random bf16 weights, written once per run: GPU runs need no network
    access to the real checkpoint."""
    from bench.common.shapes import write_shape

    return write_shape("smollm2-135m", tmp_path_factory.mktemp("smollm2"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marker 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
