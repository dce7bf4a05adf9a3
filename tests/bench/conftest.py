"""Fixtures of the bench tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.service.harness import ServerHarness


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHarness]:
    """A READY in-process server on the tiny model, for the tests of one module."""
    harness = ServerHarness()
    try:
        harness.wait_ready()
        yield harness
    finally:
        harness.close()
