"""Run a real ``ExecutorServer`` on a free loopback port, driven from synchronous tests.

The server's event loop runs in a background thread; tests talk to it through a real
gRPC channel (sync API) and reach into it with ``harness.call(coro)`` when they need to.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import urllib.request
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from executor.config import CacheConfig, ExecutorConfig, ModelConfig
from service.config import ServerConfig
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc
from service.health import READINESS_SERVICE
from service.server import ExecutorFactory, ExecutorServer
from service.worker import ExecutorLike

T = TypeVar("T")


def tiny_config(kv_tokens: int = 4096, max_sequences: int = 16, max_context: int = 512,
                max_prefill_tokens: int = 4096) -> ExecutorConfig:
    return ExecutorConfig(
        model=ModelConfig(source="tiny"), device="cpu",
        cache=CacheConfig(kv_tokens=kv_tokens, max_sequences=max_sequences,
                          max_context=max_context),
        max_prefill_tokens=max_prefill_tokens, max_decode_batch=max_sequences)


class ServerHarness:
    def __init__(self, executor_config: ExecutorConfig | None = None,
                 server_config: ServerConfig | None = None,
                 factory: ExecutorFactory | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop",
                                        daemon=True)
        self._thread.start()
        config = server_config or ServerConfig(port=0, metrics_port=0, grace_period_s=5.0)
        self.server: ExecutorServer = self.call(
            self._build(executor_config or tiny_config(), config, factory))
        self.call(self.server.start())
        self.target = f"127.0.0.1:{self.server.port}"
        self.channel = grpc.insecure_channel(self.target)
        self.stub = pb_grpc.ExecutorStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self._stopped = False

    @staticmethod
    async def _build(executor_config: ExecutorConfig, config: ServerConfig,
                     factory: ExecutorFactory | None) -> ExecutorServer:
        return ExecutorServer(executor_config, config, executor_factory=factory)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_ready(self, timeout: float = 60.0) -> ExecutorServer:
        assert self.call(self.server.wait_booted(), timeout), self.server.boot_error
        return self.server

    @property
    def executor(self) -> ExecutorLike:
        executor = self.server.worker.executor
        assert executor is not None
        return executor

    # -- convenience --------------------------------------------------------------------
    def check(self, service: str = "") -> int:
        """grpc.health.v1 Check status for ``service``."""
        request = health_pb2.HealthCheckRequest(service=service)
        return int(self.health.Check(request, timeout=5).status)

    def ready(self) -> int:
        return self.check(READINESS_SERVICE)

    def kv(self) -> pb.KVCacheStats:
        return self.stub.Health(pb.HealthRequest(), timeout=5).kv

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """``/metrics`` over HTTP: {(sample name, sorted labels): value}."""
        url = f"http://127.0.0.1:{self.server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
        }

    def stop(self, grace: float = 0.0) -> None:
        if not self._stopped:
            self._stopped = True
            self.call(self.server.stop(grace))

    def stop_in_background(self, grace: float) -> concurrent.futures.Future[None]:
        """Begin a graceful stop and return at once (the test watches the drain)."""
        self._stopped = True
        return asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop)

    def close(self) -> None:
        self.channel.close()
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()
