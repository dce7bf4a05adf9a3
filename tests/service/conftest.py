from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from executor.weights.catalog import ensure_named_model
from tests.service.harness import ServerHarness


def _stderr_logger(*args: Any) -> structlog.PrintLogger:
    return structlog.PrintLogger(sys.stderr)  # looked up per call: pytest swaps it per test


@pytest.fixture(scope="session", autouse=True)
def _server_logs_to_stderr() -> Iterator[None]:
    """In-process servers log to stderr, so stdout holds only what the test prints."""
    old = structlog.get_config()
    structlog.configure(logger_factory=_stderr_logger, cache_logger_on_first_use=False)
    yield
    structlog.configure(**old)


@pytest.fixture(scope="session")
def server() -> Iterator[ServerHarness]:
    """One READY server on the tiny model, shared by tests that leave it as they found it
    (they release every sequence they admit)."""
    harness = ServerHarness()
    try:
        harness.wait_ready()
        yield harness
    finally:
        harness.close()


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The cache holding SmolLM2-135M converted from its PyPI wheel (shared by the run:
    ``MODEL_EXECUTOR_TEST_CACHE``); MODEL_EXECUTOR_CACHE points at it for the module."""
    root = Path(os.environ.get("MODEL_EXECUTOR_TEST_CACHE") or tmp_path_factory.mktemp("smol"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MODEL_EXECUTOR_CACHE", str(root))
        ensure_named_model("smollm2-135m", cache_dir=root)
        yield root
