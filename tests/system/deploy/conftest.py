"""Fixtures of the deployment tests: the external tools and the live servers (``support``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.system.deploy.support import LiveServer, require_tool, serve_live


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_tool("promtool", "apt-get install -y prometheus")


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    return require_tool("prometheus", "apt-get install -y prometheus")


@pytest.fixture(scope="session")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The service started through its CLI, as the image's ENTRYPOINT does, on CPU."""
    yield from serve_live(tmp_path_factory.mktemp("live-server") / "server.log", [])


@pytest.fixture(scope="session")
def live_tp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The same at ``--tensor-parallel-size 2`` (two CPU ranks over gloo): the metrics
    only a tensor-parallel server exports (the dashboard's tensor-parallelism row)."""
    yield from serve_live(tmp_path_factory.mktemp("live-tp-server") / "server.log",
                          ["--tensor-parallel-size", "2"])
