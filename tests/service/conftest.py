from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

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
