"""The tensor-parallel package's shared servers: ``serve`` on ``tiny`` (``scenario.TINY``) at
TP = 1 and at TP = 2 over gloo, each started once for the package, not once per test.

The tests that use them leave them as they found them (every sequence they admit is
released, which ``tiny_tp1`` / ``tiny_tp2`` check before handing them out). The tests that
kill, stop or hang a rank start their own servers. At the end both must stop cleanly:
exit code 0, and at TP = 2 the follower leaves its loop and the groups are torn down
within the teardown's bound.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.helpers.serving import ServeProcess
from tests.system.tp_serving.scenario import TINY


def _shared(world_size: int) -> Iterator[ServeProcess]:
    # A longer heartbeat bound than the default: the server idles between its tests while
    # others load the host (a missed heartbeat is the fault tests' subject, not these').
    extra = ["--tensor-parallel-size", str(world_size), "--rank-heartbeat-timeout", "60"
             ] if world_size > 1 else []
    server = ServeProcess([*TINY, "--metrics-port", "0", *extra])
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, "".join(server.lines)[-3000:]
        if world_size > 1:
            assert server.events("rank_stopped"), "".join(server.lines)[-3000:]
            assert not server.events("exit_forced"), "".join(server.lines)[-3000:]


@pytest.fixture(scope="package")
def _tiny_tp1() -> Iterator[ServeProcess]:
    yield from _shared(1)


@pytest.fixture(scope="package")
def _tiny_tp2() -> Iterator[ServeProcess]:
    yield from _shared(2)


def _idle(server: ServeProcess) -> ServeProcess:
    """The shared server, alive and holding no sequence (a test before left it so)."""
    assert server.proc.poll() is None, "".join(server.lines)[-3000:]
    kv = server.stub.Health(pb.HealthRequest(), timeout=10).kv
    assert kv.active_sequences == 0 and kv.free_tokens == kv.total_tokens, kv
    return server


@pytest.fixture
def tiny_tp1(_tiny_tp1: ServeProcess) -> ServeProcess:
    return _idle(_tiny_tp1)


@pytest.fixture
def tiny_tp2(_tiny_tp2: ServeProcess) -> ServeProcess:
    return _idle(_tiny_tp2)
