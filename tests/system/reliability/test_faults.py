"""Faults and the policy for each (docs/reliability.md):

* an exception inside a forward pass fails that call with INTERNAL; the executor rolls the
  call's KV allocation back; the server keeps serving (a bug is not a broken device);
* a fatal device error (a CUDA error, ``torch.AcceleratorError``) fails its call with
  INTERNAL, refuses the calls queued behind it with UNAVAILABLE (nothing applied), and
  turns both health services NOT_SERVING for good, also when the failing call's client
  had already gone;
* a capture failure at one bucket leaves the others captured and is counted (CPU: the
  counting path with a fake capture; GPU: a real injected failure, marker ``gpu``).
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from executor.api import BucketCapture, ExecutorStatus, GraphStatus, PhaseCapture
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.health import READINESS_SERVICE
from service.server import real_executor_factory
from service.worker import ExecutorLike
from tests.system.reliability.figures import Figures
from tests.system.reliability.support import (
    Gate,
    ServerHarness,
    check_kv,
    details,
    rpc_error,
    serving,
    tiny_config,
    wait_until,
)
from tests.system.reliability.support import pending as pending_calls

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING
CONFIG = tiny_config(max_sequences=32)  # the module's ``server`` (conftest)


class EvilForward:
    """Makes the model's forward raise ``error`` on every ``every``-th pass (or, with
    ``every=0``, whenever ``armed`` is set). Restores the real forward on exit."""

    def __init__(self, harness: ServerHarness, error: BaseException, every: int = 0) -> None:
        self.model: Any = harness.executor.model  # type: ignore[attr-defined]
        self.real = self.model.forward
        self.error, self.every = error, every
        self.passes = 0
        self.raised = 0
        self.armed = threading.Event()
        self.model.forward = self._forward

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        self.passes += 1
        if (self.every and self.passes % self.every == 0) or self.armed.is_set():
            self.raised += 1
            raise self.error
        return self.real(*args, **kwargs)

    def __enter__(self) -> EvilForward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.model.forward = self.real


def test_forward_failure_is_internal_and_kv_stays_exact(server: ServerHarness,
                                                        figures: Figures) -> None:
    baseline = check_kv(server, figures)
    codes: Counter[str] = Counter()
    lengths: dict[str, int] = {}
    lock = threading.Lock()

    def client(c: int) -> None:
        rng, seq, length = random.Random(c), f"evil{c}", 0
        for i in range(30):
            try:
                if length == 0:
                    n = rng.randrange(2, 12)
                    out = server.stub.Prefill(pb.PrefillRequest(request_id=f"e{c}-{i}", items=[
                        pb.PrefillItem(seq_id=seq, token_ids=[9] * n, sample=True)]),
                        timeout=30).outputs[0]
                    length = n
                else:
                    out = server.stub.Decode(pb.DecodeRequest(request_id=f"e{c}-{i}", items=[
                        pb.DecodeItem(seq_id=seq, token_id=4)]), timeout=30).outputs[0]
                    length += 1
                assert out.seq_len == length  # a failed step appended nothing
                code = "OK"
            except grpc.RpcError as err:
                code = err.code().name
                if code == "INTERNAL":
                    assert f"e{c}-{i}" in err.details()  # the request id, to find the log
                    assert details(err)["ErrorInfo"].metadata["request_id"] == f"e{c}-{i}"  # type: ignore[attr-defined]
            with lock:
                codes[code] += 1
        lengths[seq] = length

    with EvilForward(server, RuntimeError("injected forward failure"), every=7) as evil, \
            ThreadPoolExecutor(4) as pool:
        list(pool.map(client, range(4)))
    assert set(codes) == {"OK", "INTERNAL"}, codes
    assert codes["INTERNAL"] == evil.raised > 0
    stats = check_kv(server, figures)
    assert stats.total_tokens - stats.free_tokens == sum(lengths.values())
    assert server.check(READINESS_SERVICE) == SERVING  # a bug, not a broken device
    server.stub.Release(pb.ReleaseRequest(seq_ids=list(lengths)), timeout=10)
    check_kv(server, figures, expected=baseline)
    figures.notes["forward_fault_codes"] = dict(codes)


def _logged(captured: str) -> list[dict[str, Any]]:
    """The server's JSON log lines among ``captured`` (stderr)."""
    lines = []
    for text in captured.splitlines():
        with contextlib.suppress(ValueError):
            line = json.loads(text)
            if isinstance(line, dict):
                lines.append(line)
    return lines


def test_a_failed_session_step_is_logged_under_the_id_its_status_names(
        server: ServerHarness, figures: Figures, capsys: pytest.CaptureFixture[str]) -> None:
    """A Session step that fails with a bug (an injected forward failure) answers INTERNAL
    naming a request id; the server log has an ERROR line with that id and the traceback:
    the step's own request_id when it has one, else the id made for it. Before, the
    status named ``session-step-<n>``, which no log line had."""
    baseline = check_kv(server, figures)

    def prefill(seq_id: str, request_id: str) -> pb.PrefillRequest:
        return pb.PrefillRequest(request_id=request_id, items=[
            pb.PrefillItem(seq_id=seq_id, token_ids=[5, 6, 7], sample=True)])

    requests = [pb.SessionRequest(step=59, prefill=prefill("sf1", "ts-59")),
                pb.SessionRequest(step=60, prefill=prefill("sf2", ""), ack_failed_step=59)]
    capsys.readouterr()
    with EvilForward(server, RuntimeError("injected forward failure")) as evil:
        evil.armed.set()
        responses = list(server.stub.Session(iter(requests), timeout=30))
    assert [r.error.code_name for r in responses] == ["INTERNAL", "INTERNAL"]
    lines = _logged(capsys.readouterr().err)
    named = []
    for response in responses:
        message = response.error.message
        assert "in the server log has the traceback" in message
        request_id = message.split("request_id=", 1)[1].split()[0]
        named.append(request_id)
        errors = [line for line in lines if line.get("request_id") == request_id
                  and line.get("level") == "error"]
        assert errors, (request_id, lines)
        assert errors[0]["code"] == "INTERNAL" and errors[0]["step"] == response.step
        assert "injected forward failure" in json.dumps(errors[0]["exception"])
    assert named[0] == "ts-59"  # the step's own id
    assert named[1] != "ts-59" and named[1].endswith("-step-60")  # one made for it
    check_kv(server, figures, expected=baseline)  # nothing of either step applied


def _device_lost() -> BaseException:
    return torch.AcceleratorError("CUDA error: an illegal memory access was encountered")


@pytest.mark.parametrize("client_gone", [False, True], ids=["client-waits", "client-gone"])
def test_fatal_device_error_turns_health_not_serving(figures: Figures,
                                                     client_gone: bool) -> None:
    with serving(figures) as harness:
        baseline = check_kv(harness, figures)
        prefill = pb.PrefillRequest(items=[pb.PrefillItem(seq_id="victim", token_ids=[1, 2])])
        with Gate(harness, "prefill", hold="victim") as gate, \
                EvilForward(harness, _device_lost()) as evil:
            evil.armed.set()
            doomed = harness.stub.Prefill.future(prefill, timeout=0.5 if client_gone else 30)
            assert gate.entered.wait(10)
            queued = [harness.stub.Prefill.future(pb.PrefillRequest(items=[
                pb.PrefillItem(seq_id=f"q{i}", token_ids=[3])]), timeout=30) for i in range(2)]
            wait_until(lambda: pending_calls(harness) == 3, what="calls queued")
            if client_gone:
                with pytest.raises(grpc.RpcError) as info:
                    doomed.result()
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            gate.open()
            if not client_gone:
                with pytest.raises(grpc.RpcError) as info:
                    doomed.result()
                assert info.value.code() == grpc.StatusCode.INTERNAL
            for future in queued:  # refused, not run on a broken device
                with pytest.raises(grpc.RpcError) as info:
                    future.result()
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "nothing was applied" in info.value.details()
        assert gate.calls == [["victim"]]
        wait_until(lambda: harness.check() == NOT_SERVING, what="liveness NOT_SERVING")
        assert harness.check(READINESS_SERVICE) == NOT_SERVING
        health = harness.stub.Health(pb.HealthRequest(), timeout=5)
        assert health.state == pb.SERVER_STATE_UNHEALTHY
        err = rpc_error(harness.stub.Prefill, prefill)
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "restarted" in err.details()
        assert harness.scrape()[("model_executor_healthy", ())] == 0
        check_kv(harness, figures, expected=baseline)  # the failed call was rolled back


class _SyncRaises:
    """A step's device event whose wait raises ``error``: an asynchronous device error that
    surfaces when a Session step completes, off the executor thread."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def query(self) -> bool:  # a CUDA event's query raises a sticky device error too
        raise self.error

    def synchronize(self) -> None:
        raise self.error


def test_a_fatal_device_error_at_a_session_completion_turns_health_not_serving(
        figures: Figures) -> None:
    """As for a unary call: the step answers INTERNAL, the server turns UNHEALTHY and later
    calls are refused UNAVAILABLE (before, only an error on the executor thread did that,
    and a Session's completion waits elsewhere)."""
    with serving(figures) as harness:
        ex: Any = harness.executor
        real = ex.launch_prefill

        def launch(items: Any) -> Any:
            pending = real(items)
            pending.done = _SyncRaises(_device_lost())
            return pending

        ex.launch_prefill = launch
        try:
            [response] = harness.stub.Session(iter([pb.SessionRequest(
                step=1, prefill=pb.PrefillRequest(request_id="fatal-1", items=[
                    pb.PrefillItem(seq_id="fs", token_ids=[1, 2], sample=True)]))]),
                timeout=30)
        finally:
            ex.launch_prefill = real
        assert response.error.code_name == "INTERNAL"
        assert "request_id=fatal-1" in response.error.message
        wait_until(lambda: harness.check() == NOT_SERVING, what="liveness NOT_SERVING")
        assert harness.check(READINESS_SERVICE) == NOT_SERVING
        err = rpc_error(harness.stub.Prefill, pb.PrefillRequest(items=[
            pb.PrefillItem(seq_id="after", token_ids=[3])]))
        assert err.code() == grpc.StatusCode.UNAVAILABLE


# -- capture failures -------------------------------------------------------------------

CAPTURE = (PhaseCapture("decode", "full", (
    BucketCapture(1, 3.0, True, "", 1000), BucketCapture(2, 1.0, False,
                                                         "OutOfMemoryError: CUDA out of memory"),
    BucketCapture(4, 3.0, True, "", 2000), BucketCapture(8, 1.0, False, "RuntimeError: boom"),
), 9.0, 3000),)


def _fake_capture(executor: ExecutorLike) -> ExecutorLike:
    """On CPU, a capture that reports buckets 2 and 8 failed and 1 and 4 captured."""
    captured: list[int] = []
    real_status = executor.status

    def capture(phases: Any, force: bool = False, progress: bool = False) -> Any:
        captured[:] = [1, 4]
        return CAPTURE

    def status() -> ExecutorStatus:
        real = real_status()
        return ExecutorStatus(real.model, real.kv, (GraphStatus("decode", "full",
                                                                tuple(captured)),))

    executor.capture = capture  # type: ignore[method-assign]
    executor.status = status  # type: ignore[method-assign]
    executor.startup_phases = lambda: ("decode",)  # type: ignore[method-assign]
    return executor


def test_capture_failure_at_one_bucket_is_counted(figures: Figures) -> None:
    def factory() -> ExecutorLike:
        return _fake_capture(real_executor_factory(tiny_config())())

    with serving(figures, factory=factory) as harness:
        metrics = harness.scrape()  # the start-up capture
        failures = "model_executor_graph_capture_failures_total"
        assert metrics[(failures, (("phase", "decode"), ("reason", "oom")))] == 1
        assert metrics[(failures, (("phase", "decode"), ("reason", "error")))] == 1
        assert metrics[("model_executor_graph_captured_buckets", (("phase", "decode"),))] == 2
        assert harness.check(READINESS_SERVICE) == SERVING  # serving with what was captured
        response = harness.stub.Capture(pb.CaptureRequest(phases=[pb.PHASE_DECODE]),
                                        timeout=10)
        assert [(b.size, b.ok) for b in response.phases[0].buckets] == [
            (1, True), (2, False), (4, True), (8, False)]
        assert "out of memory" in response.phases[0].buckets[1].error
        metrics = harness.scrape()
        assert metrics[(failures, (("phase", "decode"), ("reason", "oom")))] == 2
        health = harness.stub.Health(pb.HealthRequest(), timeout=5)
        assert list(health.graphs[0].captured_sizes) == [1, 4]


_DEVICE_ASSERT = """
import torch
from service.errors import is_fatal_device_error
try:
    x = torch.zeros(4, device="cuda")
    x[torch.tensor([10], device="cuda")] = 1.0  # out of bounds: a device-side assert
    torch.cuda.synchronize()
except BaseException as exc:
    print(type(exc).__name__, is_fatal_device_error(exc))
    raise SystemExit(0 if is_fatal_device_error(exc) else 3) from None
raise SystemExit(4)
"""


@pytest.mark.gpu
def test_a_real_device_side_assert_is_classified_fatal() -> None:
    """The fault policy's trigger on a real CUDA error (in a child process: the error
    leaves its CUDA context unusable, which is the point)."""
    result = subprocess.run([sys.executable, "-c", _DEVICE_ASSERT], capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


@pytest.mark.gpu
def test_gpu_capture_failure_at_one_bucket_leaves_the_others(figures: Figures) -> None:
    """A real decode capture with bucket 2 failing (the runner's ``before_capture`` hook):
    the other buckets are captured and replay; size 2 runs eagerly, counted; tokens match."""
    config = ExecutorConfig(
        model=ModelConfig(source="tiny"), device="cuda",
        cache=CacheConfig(kv_tokens=4096, max_sequences=8, max_context=256),
        graphs=GraphConfig(decode_mode="full", prefill_mode="disabled",
                           decode_buckets=(1, 2, 4, 8)),
        max_prefill_tokens=256, max_decode_batch=8)
    with serving(figures, config) as harness:
        seqs = ["g0", "g1"]
        first = harness.stub.Prefill(pb.PrefillRequest(items=[
            pb.PrefillItem(seq_id=s, token_ids=[5, 6, 7], sample=True) for s in seqs]),
            timeout=60)
        tokens = [o.token_id for o in first.outputs]
        graph_step = harness.stub.Decode(pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id=s, token_id=t) for s, t in zip(seqs, tokens, strict=True)]),
            timeout=60)
        assert graph_step.step.path == pb.PATH_GRAPH
        harness.stub.Release(pb.ReleaseRequest(seq_ids=seqs), timeout=10)

        runner: Any = harness.executor.runners["decode"]  # type: ignore[attr-defined]

        def fail_two(bucket: int) -> None:
            if bucket == 2:
                raise RuntimeError("injected capture failure")

        runner.before_capture = fail_two
        response = harness.stub.Capture(pb.CaptureRequest(phases=[pb.PHASE_DECODE],
                                                          force=True), timeout=300)
        runner.before_capture = None
        assert {b.size: b.ok for b in response.phases[0].buckets} == {1: True, 2: False,
                                                                      4: True, 8: True}
        metrics = harness.scrape()
        assert metrics[("model_executor_graph_capture_failures_total",
                        (("phase", "decode"), ("reason", "error")))] == 1
        health = harness.stub.Health(pb.HealthRequest(), timeout=5)
        assert sorted(health.graphs[0].captured_sizes) == [1, 4, 8]
        again = harness.stub.Prefill(pb.PrefillRequest(items=[
            pb.PrefillItem(seq_id=s, token_ids=[5, 6, 7], sample=True) for s in seqs]),
            timeout=60)
        assert [o.token_id for o in again.outputs] == tokens
        eager_step = harness.stub.Decode(pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id=s, token_id=t) for s, t in zip(seqs, tokens, strict=True)]),
            timeout=60)
        assert eager_step.step.path == pb.PATH_EAGER
        assert eager_step.step.fallback_reason == "capture_failed"
        assert [o.token_id for o in eager_step.outputs] == \
            [o.token_id for o in graph_step.outputs]
        single = harness.stub.Decode(pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id="g0", token_id=eager_step.outputs[0].token_id)]), timeout=60)
        assert single.step.path == pb.PATH_GRAPH  # bucket 1 still replays
        harness.stub.Release(pb.ReleaseRequest(seq_ids=seqs), timeout=10)
        check_kv(harness, figures)
