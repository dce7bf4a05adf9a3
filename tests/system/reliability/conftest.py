"""The reliability suite: loopback servers, bounded in calls and time (``budget.py``).

``server`` is a test module's one live server: the executor config is the module's ``CONFIG``
and the server config its ``SERVER_CONFIG`` (either may be left out). Figures go to the
terminal summary and, when ``MODEL_EXECUTOR_RELIABILITY_REPORT`` names a file, to that file
as JSON."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from service.logs import configure_logging
from tests.system.reliability.budget import BUDGET, REPORT_ENV
from tests.system.reliability.figures import Figures
from tests.system.reliability.support import ServerHarness, serving

_FIGURES = Figures()


class _CurrentStderr:
    """Whatever ``sys.stderr`` is now (pytest swaps it per test to capture it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


@pytest.fixture(scope="package", autouse=True)
def _production_logs_and_one_thread() -> Iterator[None]:
    """In-process servers log as in production (JSON lines), to stderr; one torch thread,
    so the executor thread, the servers' event loops and the clients share the two cores
    without torch's spinning workers starving them (results do not depend on it)."""
    root = logging.getLogger()
    old_handlers, old_level = root.handlers[:], root.level
    old_config = structlog.get_config()
    old_threads = torch.get_num_threads()
    configure_logging("json", "INFO", stream=_CurrentStderr())  # type: ignore[arg-type]
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old_threads)
    structlog.configure(**old_config)
    root.handlers, root.level = old_handlers, old_level


@pytest.fixture(scope="session")
def figures() -> Figures:
    return _FIGURES


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, figures: Figures) -> Iterator[ServerHarness]:
    """The module's live server (``serving``), shared by its tests: its ``CONFIG`` and
    ``SERVER_CONFIG`` when it sets them, else ``tiny_config()`` on free loopback ports."""
    with serving(figures, getattr(request.module, "CONFIG", None),
                 server_config=getattr(request.module, "SERVER_CONFIG", None)) as harness:
        yield harness


def pytest_terminal_summary(terminalreporter: Any) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        _FIGURES.write(Path(path))
    if not (_FIGURES.calls or _FIGURES.invariant_checks or _FIGURES.notes):
        return
    terminalreporter.section(f"reliability figures ({BUDGET.name})")
    for key, value in _FIGURES.summary().items():
        terminalreporter.write_line(f"{key}: {value}")
    if path:
        terminalreporter.write_line(f"written to {path}")
