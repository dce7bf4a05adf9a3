"""The gRPC process: ``ExecutorServer`` wires the servicer, the health and reflection
services, the interceptor, metrics and the executor thread; ``serve`` runs one until SIGTERM.

Boot (on the executor thread; gRPC answers at once, steps get UNAVAILABLE until READY):
STARTING (load weights, allocate the KV cache) -> CAPTURING (CUDA graphs, if asked) -> READY.

Shutdown (every bound is a flag; docs/reliability.md has the timeline):

    t=0                DRAINING: health NOT_SERVING, new steps UNAVAILABLE (nothing applied)
    t=drain            the listener closes (new connections refused)
    t=drain..+grace    calls in flight, queued or running, finish and get their real answer
    t=drain+grace      queued calls: UNAVAILABLE, nothing applied; a step still running:
                       CANCELLED, reason STEP_OUTCOME_UNKNOWN (it may apply)
    then               the executor thread and exporter stop; exit without waiting for a step
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, ProcessCollector

from executor.api import Phase
from executor.config import ExecutorConfig
from executor.errors import ConfigError, GraphsUnavailable, ModelLoadError
from service import __version__
from service.admission import Admission, Kind
from service.auth import AuthInterceptor
from service.config import RequestLimits, ServerConfig, channel_options
from service.errors import StartupError
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc
from service.health import HealthServicer, Lifecycle, State
from service.idempotency import ResponseCache
from service.interceptors import AUTH_LOG_INTERVAL_S, ParseInterceptor, ServiceInterceptor
from service.listen import bind
from service.metrics import Exporter, Metrics, start_exporter
from service.reflection import enable_reflection
from service.servicer import ExecutorServicer
from service.stats import StatsRecorder
from service.worker import ExecutorLike, ExecutorWorker

log = structlog.get_logger(__name__)

SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["Executor"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
)

ExecutorFactory = Callable[[], ExecutorLike]


def real_executor_factory(config: ExecutorConfig) -> ExecutorFactory:
    def build() -> ExecutorLike:
        from executor import Executor

        return Executor(config)

    return build


def fallback_reasons() -> tuple[str, ...]:
    """The executor's eager-fallback reasons: the label values of eager_fallbacks."""
    from executor.api import FallbackReason

    return (*(r.value for r in FallbackReason), "other")


def _process_registry() -> CollectorRegistry:
    """A fresh registry with the standard process metrics (``process_start_time_seconds``
    lets alert rules tell a restart from a counter that stopped moving)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return registry


class ExecutorServer:
    def __init__(self, executor_config: ExecutorConfig, config: ServerConfig | None = None,
                 executor_factory: ExecutorFactory | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.executor_config = executor_config
        self.config = config or ServerConfig()
        self._factory = executor_factory or real_executor_factory(executor_config)
        self.limits = RequestLimits.from_executor(executor_config)
        self.metrics = Metrics(registry or _process_registry(), fallback_reasons())
        self.recorder = StatsRecorder(self.metrics)
        self.worker = ExecutorWorker(on_fatal=self._fatal_seen,
                                     on_wait=self.recorder.queue_wait,
                                     after_call=lambda ex: self.recorder.kv(ex.kv_stats()))
        self.metrics.queue_depth.set_function(lambda: self.worker.pending)
        self.lifecycle = Lifecycle(HealthServicer(),
                                   on_change=lambda s: self.recorder.healthy(s is State.READY))
        self.cache = ResponseCache(self.config.retry_cache, self.recorder.retry_evicted)
        self.servicer = ExecutorServicer(self.lifecycle, self.worker, self.recorder,
                                         self.limits, __version__, self.cache,
                                         self.config.session_depth,
                                         self.config.session_idle_timeout_s)
        self.port = 0
        self.health_port: int | None = None
        self._health_server: grpc.aio.Server | None = None
        self.exporter: Exporter | None = None
        self.boot_error: BaseException | None = None
        # True when the stop left a step running on the executor thread (grace over).
        self.step_abandoned = False
        self._server: grpc.aio.Server | None = None
        self._boot_task: asyncio.Task[None] | None = None
        self._fatal_task: asyncio.Future[None] | None = None
        self._booted = asyncio.Event()
        # With tokens: the interceptor whose held-back auth_refused lines are said later.
        self._interceptor: ServiceInterceptor | None = None
        self._held_back_task: asyncio.Task[None] | None = None

    @property
    def metrics_port(self) -> int | None:
        return self.exporter.port if self.exporter is not None else None

    async def start(self) -> None:
        """Bind and serve at once (health answers, steps get UNAVAILABLE); boot behind."""
        await self.lifecycle.publish()
        config = self.config
        # The service interceptor is outermost: auth refusals are logged and counted too.
        # It also admits calls by kind (service/admission.py); gRPC's own
        # maximum_concurrent_rpcs is not set: it would count probes with everything else.
        service = ServiceInterceptor(self.recorder, self._on_fatal,
                                     self._admission(self.recorder.calls_in_flight),
                                     log_successes=config.rpc_log == "all")
        server = grpc.aio.server(
            interceptors=[service, AuthInterceptor(config.auth), ParseInterceptor()],
            options=channel_options(self.limits))
        pb_grpc.add_ExecutorServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.lifecycle.health, server)
        if config.reflection:
            enable_reflection(SERVICE_NAMES, server)  # v1 and v1alpha
        credentials = config.tls.server_credentials() if config.tls is not None else None
        self.port = bind(server, config.address, "--port", credentials)
        await server.start()
        self._server = server
        try:
            if config.health_port is not None:
                self._health_server = await self._start_health_listener(config.health_port)
            if self.config.metrics_port is not None:
                self.exporter = self._start_exporter(self.config.metrics_port)
        except StartupError:
            await self._close_listeners()
            raise
        self._warn_if_exposed()
        if config.auth.enabled:
            self._interceptor = service
            self._held_back_task = asyncio.create_task(self._say_held_back(service))
        self.metrics.set_build_info(__version__)
        executor_service = pb.DESCRIPTOR.services_by_name["Executor"]
        self.metrics.touch_rpcs(executor_service.full_name,
                                tuple(m.name for m in executor_service.methods))
        self._boot_task = asyncio.create_task(self._boot(), name="executor-boot")

    @staticmethod
    async def _say_held_back(service: ServiceInterceptor) -> None:
        """Auth refusals held back from the log are said within an interval of being held,
        also when no later refusal of their kind comes to carry the count."""
        while True:
            await asyncio.sleep(AUTH_LOG_INTERVAL_S)
            service.log_held_back()

    async def _start_health_listener(self, port: int) -> grpc.aio.Server:
        """Plaintext ``grpc.health.v1`` only, for probes that cannot do TLS or tokens."""
        server = grpc.aio.server(interceptors=[ServiceInterceptor(self.recorder,
                                                                  self._on_fatal,
                                                                  self._admission()),
                                               ParseInterceptor()],
                                 options=channel_options(self.limits))
        health_pb2_grpc.add_HealthServicer_to_server(self.lifecycle.health, server)
        self.health_port = bind(server, self.config.address_of(port), "--health-port")
        await server.start()
        return server

    def _start_exporter(self, port: int) -> Exporter:
        try:
            return start_exporter(self.metrics.registry, self.config.host, port)
        except OSError as exc:
            raise StartupError(
                f"cannot serve metrics on {self.config.address_of(port)}: "
                f"{exc.strerror or exc}; stop what holds the port or choose another "
                "--metrics-port (-1: no exporter)") from None

    async def _close_listeners(self) -> None:
        for server in (self._server, self._health_server):
            if server is not None:
                await server.stop(0)
        self._server = self._health_server = None

    def _admission(self, on_change: Callable[[Kind, int], None] | None = None) -> Admission:
        """Fresh budgets for one listener (``on_change``: the main one's gauge)."""
        return Admission(self.config.max_concurrent_rpcs, self.config.max_watch_streams,
                         on_change, max_session_streams=self.config.max_session_streams)

    def _warn_if_exposed(self) -> None:
        config = self.config
        security = {"tls": config.tls.mode if config.tls is not None else "off",
                    "token": config.auth.token is not None,
                    "admin_token": config.auth.admin_token is not None}
        log.info("security", host=config.host, **security)
        if config.is_loopback:
            return
        if config.tls is None and config.auth.enabled:
            log.warning("tokens_in_cleartext", reason="tokens are sent without TLS on a "
                        "non-loopback address; add --tls-cert/--tls-key")
        elif config.tls is None and not config.auth.enabled:
            log.warning("unprotected_listener", reason="serving without TLS or a token on a "
                        "non-loopback address; anyone who can reach it can run steps")

    async def _boot(self) -> None:
        try:
            executor = await self.worker.boot(self._factory)
            self.recorder.model(executor.model_info)
            self.servicer.update_status((await self.worker.run(lambda ex: ex.status())).value)
            log.info("executor_ready", **vars(executor.model_info))
            if self.executor_config.model.load_format == "random":
                log.warning("random_weights", reason="--load-format random: the weights are "
                            "random values, not the checkpoint's; outputs are meaningless",
                            seed=self.executor_config.model.seed)
            capture = self.executor_config.graphs.capture_at_startup
            phases = executor.startup_phases() if capture else ()
            if phases:
                if not await self.lifecycle.set(State.CAPTURING):
                    return  # draining already
                await self._capture(phases)
            await self.lifecycle.set(State.READY)
        except Exception as exc:
            self.boot_error = exc
            if isinstance(exc, (ConfigError, ModelLoadError)):
                # The operator's to fix, and the message says what: one line, no traceback.
                log.error("boot_failed", error=str(exc), error_type=type(exc).__name__)
            else:
                log.error("boot_failed", exc_info=exc)
            await self.lifecycle.set(State.UNHEALTHY, f"start-up failed: {exc}")
        finally:
            self._booted.set()

    async def _capture(self, phases: tuple[Phase, ...]) -> None:
        try:
            # A progress bar (on stderr) only for a person watching a terminal.
            progress = sys.stderr.isatty()
            timed = await self.worker.run(
                lambda ex: (ex.capture(phases, progress=progress), ex.status()))
        except GraphsUnavailable as exc:
            log.warning("startup_capture_unavailable", reason=str(exc))
            return
        captures, status = timed.value
        self.recorder.capture(captures, force=False)
        self.servicer.update_status(status)
        for p in captures:
            failed = [b.size for b in p.buckets if not b.ok]
            log.info("startup_capture_done", phase=p.phase, backend=p.backend,
                     buckets=len(p.buckets), failed=failed, total_ms=round(p.total_ms, 1),
                     memory_bytes=p.memory_bytes)

    async def wait_booted(self) -> bool:
        """Wait for the boot sequence; True if the server is READY."""
        await self._booted.wait()
        return self.lifecycle.state is State.READY

    async def _on_fatal(self, exc: BaseException) -> None:
        if self.lifecycle.state is State.UNHEALTHY:
            return
        log.error("fatal_device_error", error=str(exc))
        await self.lifecycle.set(State.UNHEALTHY, f"fatal device error: {exc}"[:300])

    def _fatal_seen(self, exc: BaseException) -> None:
        """The worker saw a fatal device error (maybe in a call whose client is gone)."""
        self._fatal_task = asyncio.ensure_future(self._on_fatal(exc))

    async def stop(self, grace: float | None = None) -> None:
        """Drain: readiness NOT_SERVING, refuse new calls, let in-flight ones finish."""
        grace = self.config.grace_period_s if grace is None else grace
        await self.lifecycle.set(State.DRAINING)
        log.info("draining", grace_s=grace, drain_delay_s=self.config.drain_delay_s,
                 pending_calls=self.worker.pending)
        if self.config.drain_delay_s > 0:
            await asyncio.sleep(self.config.drain_delay_s)
        closing: asyncio.Future[None] | None = None
        if self._server is not None:
            # Closes the listener now; RPCs still active a second after the grace period
            # (only streams such as Health/Watch by then) are cancelled by gRPC.
            closing = asyncio.ensure_future(self._server.stop(grace + 1.0))
        idle = self.worker.executor is None or await self.worker.wait_idle(grace)
        if not idle:
            # Answer every waiting caller truthfully (service/worker.py); never make them
            # wait on a step that may outlast the pod's termination budget.
            log.warning("grace_period_over", grace_s=grace, pending_calls=self.worker.pending)
            self.step_abandoned = self.worker.pending > 0
            self.worker.abandon()
        if self._server is not None:
            await self._server.stop(0.5)  # the answers above go out; Watch streams end
        if closing is not None:
            await closing
        if self._health_server is not None:
            await self._health_server.stop(0)
        if self._held_back_task is not None:
            self._held_back_task.cancel()
        if self._interceptor is not None:
            self._interceptor.log_held_back(everything=True)  # no call runs any more
        if self._boot_task is not None and not self._boot_task.done():
            self._boot_task.cancel()  # a construction under way still runs to its end
        await asyncio.to_thread(self.worker.shutdown, not self.step_abandoned)
        if self.exporter is not None:
            self.exporter.close()
        log.info("stopped", step_abandoned=self.step_abandoned)


async def run_until_signal(server: ExecutorServer, stop: asyncio.Event) -> bool:
    """Let SIGTERM and SIGINT set ``stop`` (each logged as ``signal_received``), then wait:
    False as soon as the server's boot fails (unless ``stop`` was set first), True once
    ``stop`` is set."""
    loop = asyncio.get_running_loop()

    def received(sig: signal.Signals) -> None:
        log.info("signal_received", signal=sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, received, sig)
    booted = asyncio.create_task(server.wait_booted())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({booted, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if server.boot_error is not None and not stop.is_set():
            return False
        await stopping
        return True
    finally:
        booted.cancel()
        stopping.cancel()


async def serve(executor_config: ExecutorConfig, config: ServerConfig) -> int:
    """Run a server until SIGTERM/SIGINT; the exit code (1 if start-up failed)."""
    server = ExecutorServer(executor_config, config)
    try:
        await server.start()
    except StartupError as exc:
        log.error("startup_failed", error=str(exc))
        return 1
    metrics = (f"http://{config.address.rsplit(':', 1)[0]}:{server.metrics_port}/metrics"
               if server.metrics_port is not None else None)
    log.info("serving", grpc=f"{config.address.rsplit(':', 1)[0]}:{server.port}",
             metrics=metrics, version=__version__,
             health=config.address_of(server.health_port) if server.health_port else None)
    if not await run_until_signal(server, asyncio.Event()):
        await server.stop(0)
        return 1
    await server.stop()
    if server.step_abandoned:
        # The executor thread cannot be interrupted, and the interpreter would join it at
        # exit; the grace period is the bound the operator set, so leave without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
