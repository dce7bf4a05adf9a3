"""Serving with tensor parallelism: rank 0 runs the gRPC server, the other ranks follow.

``run`` is what ``model-executor serve`` calls when ``--tensor-parallel-size`` is above 1
or a torchrun-style environment names a rendezvous. Rank 0 serves exactly as one process
does (``service/server.py``), with an executor factory that first joins the process
group; every other rank builds its executor shard and runs ``follower.run``.

A failed rank (``executor/distributed/spawn.py`` says how one is found) is logged with
its number and reason (``rank_failed``); the server turns UNHEALTHY at once (liveness and
readiness NOT_SERVING, new steps UNAVAILABLE), stays so for ``--drain-delay`` so probes
see it, then drains and exits with code 1 after stopping every rank it spawned. Leaving
the groups and exiting are bounded too (``docs/reliability.md``, the TP shutdown timeline):
a process whose teardown or exit does not finish in time ends with ``os._exit``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
import threading
import time
from typing import Any

import structlog
import torch

from executor import distributed
from executor.config import ExecutorConfig
from executor.distributed import (
    LOOPBACK,
    ChildWatch,
    CollectiveFailed,
    Heartbeat,
    ParallelConfig,
    Rendezvous,
    die_with_parent,
    host_store,
    rank_device,
    spawn_context,
)
from executor.errors import ConfigError, ModelLoadError
from executor.weights import check_divisible, load_hf_config, resolve_model_source
from service.config import ServerConfig
from service.errors import StartupError
from service.health import State
from service.server import ExecutorServer, run_until_signal
from service.worker import ExecutorLike

log = structlog.get_logger(__name__)

#: After a process has stopped its ranks and left the groups: how long exiting (threads a
#: library left running, atexit handlers) may take before it exits without them.
EXIT_GRACE_S = 5.0


class RankFailure(CollectiveFailed):
    """A tensor-parallel rank died, hung or lost its connection: the group cannot step."""


def _executor_config(config: ExecutorConfig, local_rank: int) -> ExecutorConfig:
    return dataclasses.replace(config, device=rank_device(config.device, local_rank))


def _build(config: ExecutorConfig, rdv: Rendezvous, parallel: ParallelConfig,
           store: Any) -> tuple[Any, distributed.TensorParallel]:
    from executor import Executor

    cfg = _executor_config(config, rdv.local_rank)
    tp = distributed.init(rdv.rank, rdv.world_size, torch.device(cfg.device), store,
                    parallel.collective_timeout, parallel.all_reduce, parallel.gemm_send)
    log.info("tp_all_reduce", rank=rdv.rank, **distributed.all_reduce_choice(tp))
    return Executor(cfg, tp), tp


def follower_main(rdv: Rendezvous, config: ExecutorConfig, parallel: ParallelConfig,
                  log_format: str = "json", log_level: str = "INFO",
                  spawned: bool = False) -> int:
    """A rank other than 0: build the shard, follow rank 0 until SHUTDOWN; exit code."""
    if spawned:
        die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's ^C is rank 0's
    from service.logs import configure_logging

    configure_logging(log_format, log_level)  # type: ignore[arg-type]
    structlog.contextvars.bind_contextvars(rank=rdv.rank)

    def lost(rank: int, reason: str) -> None:
        log.error("rank_failed", failed_rank=rank, reason=reason)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    store = rdv.store(parallel.collective_timeout)
    beat = Heartbeat(store, rdv.rank, rdv.world_size, parallel, lost).start()
    try:
        executor, tp = _build(config, rdv, parallel, store)
        log.info("rank_ready", world_size=rdv.world_size, device=str(executor.device))
        from executor import run_follower

        steps = run_follower(executor)
    except Exception as exc:
        log.error("rank_failed", failed_rank=rdv.rank, reason=f"{type(exc).__name__}: {exc}")
        beat.stop()
        return 1
    beat.stop()
    log.info("rank_stopped", steps=steps)
    if not distributed.shutdown(tp):
        _exit_now(0, "leaving the process groups")
    return 0 if spawned else _exit_guard(0)


def _spawned_main(rank: int, size: int, port: int, config: ExecutorConfig,
                  parallel: ParallelConfig, log_format: str, log_level: str) -> None:
    rdv = Rendezvous(LOOPBACK, port, size, rank, rank)
    code = follower_main(rdv, config, parallel, log_format, log_level, spawned=True)
    # NOTE: interpreter exit runs atexit handlers (buffered traces, logs) but also CUDA and
    # NCCL destructors and thread joins, which can block on a peer that is gone: the guard
    # bounds it, so rank 0 never has to kill a rank that finished its work.
    sys.exit(_exit_guard(code))


def _exit_now(code: int, what: str) -> None:
    """``what`` did not finish within its bound: say so, flush the logs, exit at once."""
    log.warning("exit_forced", code=code, reason=f"{what} did not finish in time")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_guard(code: int) -> int:
    """Exit with ``code`` from a daemon thread if the interpreter has not exited within
    ``EXIT_GRACE_S`` (it joins threads and runs atexit handlers first); ``code``."""
    def guard() -> None:
        time.sleep(EXIT_GRACE_S)
        _exit_now(code, "exiting the interpreter")

    threading.Thread(target=guard, name="exit-guard", daemon=True).start()
    return code


def run(executor_config: ExecutorConfig, server_config: ServerConfig,
        parallel: ParallelConfig, rdv: Rendezvous | None = None, log_format: str = "json",
        log_level: str = "INFO") -> int:
    """Start (or join) the ranks; serve on rank 0. The process exit code."""
    if rdv is not None and rdv.rank != 0:
        return follower_main(rdv, executor_config, parallel, log_format, log_level)
    size = parallel.tensor_parallel_size if rdv is None else rdv.world_size
    try:  # before any process starts: a size the heads do not divide is one line
        rank_device(executor_config.device, 0)
        if rdv is None and executor_config.is_cuda and torch.cuda.device_count() < size:
            raise ConfigError(f"--tensor-parallel-size {size} needs {size} GPUs on this host "
                              f"(one per rank); {torch.cuda.device_count()} are visible")
        check_divisible(load_hf_config(resolve_model_source(executor_config.model.source)),
                        size)
    except (ConfigError, ModelLoadError) as exc:
        print(f"model-executor: error: {exc}", file=sys.stderr)
        return 2
    children: dict[int, Any] = {}
    if rdv is None:
        import torch.distributed as dist

        # Rank 0 hosts the store on a free loopback port before its children start.
        host = host_store(LOOPBACK, 0, size, parallel.collective_timeout)
        rdv = Rendezvous(LOOPBACK, host.port, size, 0, 0)
        store: Any = dist.PrefixStore("model_executor", host)
        ctx = spawn_context()
        for rank in range(1, size):
            proc = ctx.Process(target=_spawned_main, name=f"model-executor-rank{rank}",
                               args=(rank, size, host.port, executor_config, parallel,
                                     log_format, log_level))
            proc.start()
            children[rank] = proc
        log.info("ranks_spawned", world_size=size,
                 pids={r: p.pid for r, p in children.items()})
    else:
        store = rdv.store(parallel.collective_timeout)
    try:
        code = asyncio.run(_serve(executor_config, server_config, parallel, rdv, store,
                                  children))
    finally:
        if children:  # each leaves within its own teardown bound; then SIGTERM, SIGKILL
            codes = ChildWatch(children, lambda r, why: None).stop_all(timeout=10)
            log.info("ranks_stopped", exit_codes=codes)
    return _exit_guard(code)


class _GroupWatch:
    """Rank 0's watch over the group: the first failure found (a rank that exited, a silent
    heartbeat, a step whose collective failed) turns the server UNHEALTHY, holds it so for
    ``drain_delay_s`` so probes see it, then sets ``stop``. Made on the event loop."""

    def __init__(self, server: ExecutorServer, config: ServerConfig, world_size: int) -> None:
        self._server, self._config, self._world_size = server, config, world_size
        self._loop = asyncio.get_running_loop()
        self.stop = asyncio.Event()
        self.failed: list[str] = []

    async def rank_failed(self, rank: int | None, reason: str) -> None:
        if self.failed:
            return
        if self.stop.is_set():  # shutting down (a signal to the whole process group, say)
            log.info("rank_exited_during_shutdown", failed_rank=rank, reason=reason)
            return
        self.failed.append(reason)
        log.error("rank_failed", failed_rank=rank, reason=reason, world_size=self._world_size)
        who = f"rank {rank}" if rank is not None else "a rank"
        text = f"tensor-parallel {who} failed: {reason}"
        server = self._server
        if server.worker.failure is None:  # calls not started refuse (UNAVAILABLE)
            server.worker.failure = RankFailure(text)
        await server.lifecycle.set(State.UNHEALTHY, text)
        await asyncio.sleep(self._config.drain_delay_s)  # probes see UNHEALTHY, then we go
        self.stop.set()

    def on_failure(self, rank: int, reason: str) -> None:  # from the watch threads
        self._loop.call_soon_threadsafe(
            lambda: asyncio.ensure_future(self.rank_failed(rank, reason)))

    async def watch_fatal(self) -> None:
        """A step whose collective failed or timed out (a rank hung inside a step while
        its heartbeat went on) makes the worker record a fatal error: the same exit."""
        while not self.stop.is_set():
            failure = self._server.worker.failure
            if failure is not None and not self.failed:
                # The collective's error names the peer's address at best, not its rank.
                await self.rank_failed(None, f"a step's collective failed: {failure}")
                return
            await asyncio.sleep(0.2)


async def _serve(executor_config: ExecutorConfig, config: ServerConfig,
                 parallel: ParallelConfig, rdv: Rendezvous, store: Any,
                 children: dict[int, Any]) -> int:
    built: list[tuple[Any, distributed.TensorParallel]] = []

    def factory() -> ExecutorLike:
        built.append(_build(executor_config, rdv, parallel, store))
        return built[-1][0]  # type: ignore[no-any-return]

    server = ExecutorServer(executor_config, config, executor_factory=factory)
    group = _GroupWatch(server, config, rdv.world_size)
    watch = ChildWatch(children, group.on_failure).start() if children else None
    beat = Heartbeat(store, 0, rdv.world_size, parallel, group.on_failure).start()
    fatal_watch = asyncio.create_task(group.watch_fatal())
    try:
        await server.start()
    except StartupError as exc:
        log.error("startup_failed", error=str(exc))
        return 1
    host = config.address.rsplit(":", 1)[0]
    metrics = f"http://{host}:{server.metrics_port}/metrics" \
        if server.metrics_port is not None else None
    log.info("serving", grpc=f"{host}:{server.port}", metrics=metrics,
             world_size=rdv.world_size, rank=0)
    if not await run_until_signal(server, group.stop):
        group.failed.append(f"start-up failed: {server.boot_error}")
    if watch is not None and not group.failed:
        watch.expect_exit()
    beat.stop()
    fatal_watch.cancel()
    await _stop(server, parallel, group.failed, built, children, watch)
    return 0


async def _stop(server: ExecutorServer, parallel: ParallelConfig, failed: list[str],
                built: list[tuple[Any, distributed.TensorParallel]],
                children: dict[int, Any], watch: ChildWatch | None) -> None:
    """Drain the server, then let the other ranks leave their loop. After a failure or an
    abandoned step, exit the process at once instead (``os._exit``)."""
    await server.stop(0 if failed else None)
    if not failed and not server.step_abandoned and built and \
            all(p.is_alive() for p in children.values()):
        # The executor thread is done: tell the other ranks to leave their loop.
        executor = built[0][0]
        done = threading.Thread(target=executor.close, daemon=True)
        done.start()
        done.join(parallel.collective_timeout_s)
    if watch is not None:
        watch.expect_exit()
    if server.step_abandoned or failed:
        # A step may still block on a collective with a dead rank: do not wait for it.
        if children:
            ChildWatch(children, lambda r, why: None).stop_all(timeout=2)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if failed else 0)
    if built and not distributed.shutdown(built[0][1]):
        if children:
            ChildWatch(children, lambda r, why: None).stop_all(timeout=2)
        _exit_now(0, "leaving the process groups")
