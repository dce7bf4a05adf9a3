"""``RetryGate``: the one retry-aware run of the unary servicer and the Session, on a real
``ExecutorWorker`` with a stand-in executor. A retry of a call that succeeded gets its
cached response without running; a retry of a held (Session) step waits for its answer, or
runs itself when the original did not apply; another call under a used id is refused."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from executor.api import ForkResult
from service.config import RetryCacheConfig
from service.errors import StepAborted
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.idempotency import (
    Key,
    Replayed,
    RequestIdReused,
    ResponseCache,
    RetryGate,
    fork_once,
)
from service.worker import ExecutorLike, ExecutorWorker


class _Executor:
    """Counts the steps it runs; ``fork`` answers like the real one."""

    def __init__(self) -> None:
        self.runs = 0
        self.forks = 0

    def fork(self, parent: str, child: str, prefix: int | None) -> ForkResult:
        self.forks += 1
        return ForkResult(seq_len=4, shared_tokens=4, has_last_sampled=False)


def _response(token: int) -> pb.DecodeResponse:
    return pb.DecodeResponse(outputs=[pb.ItemOutput(seq_id="a", token_id=token, seq_len=3)])


def _key(cache: ResponseCache, request_id: str = "r1", token: int = 7) -> Key:
    key = cache.key("Decode", pb.DecodeRequest(request_id=request_id, items=[
        pb.DecodeItem(seq_id="a", token_id=token)]))
    assert key is not None
    return key


def _run(main: Callable[[RetryGate, _Executor], Any]) -> None:
    async def go() -> None:
        worker = ExecutorWorker()
        fake = _Executor()
        await worker.boot(lambda: fake)  # type: ignore[arg-type,return-value]
        try:
            await main(RetryGate(worker, ResponseCache(RetryCacheConfig())), fake)
        finally:
            worker.shutdown()

    asyncio.run(go())


def _step(gate: RetryGate, fake: _Executor, key: Key | None, token: int,
          answer: bool = True) -> Callable[[ExecutorLike], pb.DecodeResponse]:
    """A unary step's job: runs, then stores its response (``answer``) in the job."""
    def job(ex: ExecutorLike) -> pb.DecodeResponse:
        fake.runs += 1
        response = _response(token)
        if answer:
            gate.answer(key, ["a"], response)
        return response
    return job


def test_a_retry_of_a_call_that_succeeded_gets_the_cached_response_without_running() -> None:
    async def main(gate: RetryGate, fake: _Executor) -> None:
        key = _key(gate.cache)
        assert gate.cached(key) is None and gate.cached(None) is None
        first = await gate.run(key, _step(gate, fake, key, 11))
        assert first == _response(11) and not isinstance(first, Replayed)
        again = await gate.run(key, _step(gate, fake, key, 99))
        assert again == Replayed(_response(11))
        assert gate.cached(key) == _response(11)  # the loop's fast path sees it too
        assert fake.runs == 1
        # Without a request_id nothing is kept: every call runs.
        for _ in range(2):
            assert await gate.run(None, _step(gate, fake, None, 5)) == _response(5)
        assert fake.runs == 3

    _run(main)


def test_a_concurrent_retry_of_a_held_step_waits_and_gets_the_same_response() -> None:
    async def main(gate: RetryGate, fake: _Executor) -> None:
        key = _key(gate.cache)
        # The Session's launch: held in flight until the writer answers it.
        launched = await gate.run(key, _step(gate, fake, key, 21, answer=False), hold=True)
        assert launched == _response(21)
        retry = asyncio.ensure_future(gate.run(key, _step(gate, fake, key, 99)))
        await asyncio.sleep(0.05)
        assert not retry.done()  # waiting for the original's answer, not running
        gate.answer(key, ["a"], _response(21))
        assert await asyncio.wait_for(retry, 5) == Replayed(_response(21))
        assert fake.runs == 1

    _run(main)


def test_a_retry_of_a_held_step_that_did_not_apply_runs_itself() -> None:
    async def main(gate: RetryGate, fake: _Executor) -> None:
        key = _key(gate.cache)
        await gate.run(key, _step(gate, fake, key, 21, answer=False), hold=True)
        retry = asyncio.ensure_future(gate.run(key, _step(gate, fake, key, 31)))
        await asyncio.sleep(0.05)
        gate.abandon(key)  # rolled back: nothing of it applied
        assert await asyncio.wait_for(retry, 5) == _response(31)
        assert fake.runs == 2

    _run(main)


def test_a_held_step_whose_job_raises_lets_a_waiting_retry_run() -> None:
    async def main(gate: RetryGate, fake: _Executor) -> None:
        key = _key(gate.cache)
        started, release = threading.Event(), threading.Event()

        def failing(ex: ExecutorLike) -> pb.DecodeResponse:
            started.set()
            release.wait(5)
            raise ValueError("refused at launch")

        original = asyncio.ensure_future(gate.run(key, failing, hold=True))
        await asyncio.to_thread(started.wait, 5)
        retry = asyncio.ensure_future(gate.run(key, _step(gate, fake, key, 41)))
        release.set()
        with pytest.raises(ValueError):
            await original
        assert await asyncio.wait_for(retry, 5) == _response(41)  # queued behind: ran
        # The failed original left nothing in flight: a later retry runs, not waits.
        assert await asyncio.wait_for(gate.run(key, _step(gate, fake, key, 51)), 5) \
            == Replayed(_response(41))

    _run(main)


def test_a_different_call_under_a_used_id_is_refused() -> None:
    async def main(gate: RetryGate, fake: _Executor) -> None:
        key = _key(gate.cache)
        await gate.run(key, _step(gate, fake, key, 11))
        other = _key(gate.cache, token=8)  # same request_id, another body
        with pytest.raises(RequestIdReused):
            gate.cached(other)
        with pytest.raises(RequestIdReused):
            await gate.run(other, _step(gate, fake, other, 99))
        assert fake.runs == 1

    _run(main)


def test_check_runs_first_and_refuses_even_a_cached_retry() -> None:
    async def main(gate: RetryGate, fake: _Executor) -> None:
        key = _key(gate.cache)
        await gate.run(key, _step(gate, fake, key, 11))

        def refuse() -> None:
            raise StepAborted("step 3 failed; nothing of this step applied")

        with pytest.raises(StepAborted):
            await gate.run(key, _step(gate, fake, key, 99), hold=True, check=refuse)
        assert fake.runs == 1

    _run(main)


def test_fork_once_applies_once_per_request_id() -> None:
    async def main(gate: RetryGate, fake: _Executor) -> None:
        key = gate.cache.key("Fork", pb.ForkRequest(request_id="f1", parent_seq_id="a",
                                                    child_seq_id="b"))
        ex: Any = fake
        first, replayed = fork_once(ex, gate.cache, key, "a", "b", None)
        assert not replayed and first.seq_len == 4
        again, replayed = fork_once(ex, gate.cache, key, "a", "b", None)
        assert replayed and again == first and fake.forks == 1

    _run(main)
