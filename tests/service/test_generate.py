"""``client generate``: a unique sequence per run, released on every way out."""

from __future__ import annotations

import inspect
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from service.cli import main
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc
from tests.service.cli_process import client_error
from tests.service.harness import ServerHarness


def test_each_run_has_its_own_sequence(server: ServerHarness,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    baseline = server.kv()
    ids = []
    for _ in range(2):
        assert main(["client", "--target", server.target, "generate", "--tokens", "1 2 3",
                     "--max-new-tokens", "3"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert len(result["token_ids"]) == 3 and result["stop"] == "length"
        ids.append(result["seq_id"])
    assert ids[0] != ids[1] and all(i.startswith("client-generate-") for i in ids)
    assert server.kv() == baseline


def test_a_prefill_past_the_client_deadline_is_released(server: ServerHarness,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """The server finishes a Prefill whose caller gave up (a running step cannot be
    stopped), so the sequence exists although the client saw DEADLINE_EXCEEDED."""
    baseline = server.kv()
    finished = threading.Event()
    real_prefill = server.executor.prefill

    def slow_prefill(items: Any) -> Any:
        time.sleep(1.0)
        try:
            return real_prefill(items)
        finally:
            finished.set()

    monkeypatch.setattr(server.executor, "prefill", slow_prefill)
    assert main(["client", "--target", server.target, "--timeout", "0.3", "generate",
                 "--pipeline", "0", "--tokens", "1 2 3", "--max-new-tokens", "4"]) == 1
    assert client_error(capsys.readouterr().err)["code"] == "DEADLINE_EXCEEDED"
    assert finished.wait(10)
    monkeypatch.undo()
    deadline = time.monotonic() + 10
    while server.kv() != baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.kv() == baseline


def interrupt_after(method: str, calls: int) -> Callable[[Any], Any]:
    """An ExecutorStub whose ``calls``-th ``method`` call returns on the server, then
    raises KeyboardInterrupt in the client (Ctrl-C as the response arrives)."""
    real = pb_grpc.ExecutorStub

    def make(channel: Any) -> Any:
        stub = real(channel)
        call = getattr(stub, method)
        seen = [0]

        def interrupted(*args: Any, **kwargs: Any) -> Any:
            response = call(*args, **kwargs)
            seen[0] += 1
            if seen[0] == calls:
                raise KeyboardInterrupt
            return response

        setattr(stub, method, interrupted)
        return stub

    return make


@pytest.mark.parametrize(("method", "calls"), [("Prefill", 1), ("Decode", 2)])
def test_ctrl_c_releases_the_sequence(server: ServerHarness, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str], method: str,
                                      calls: int) -> None:
    baseline = server.kv()
    monkeypatch.setattr(pb_grpc, "ExecutorStub", interrupt_after(method, calls))
    assert main(["client", "--target", server.target, "generate", "--pipeline", "0",
                 "--tokens", "1 2 3", "--max-new-tokens", "8"]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert server.kv() == baseline


@pytest.mark.parametrize("pipeline", ["0", "3"])
def test_a_rejected_prefill_leaves_nothing(server: ServerHarness,
                                          capsys: pytest.CaptureFixture[str],
                                          pipeline: str) -> None:
    """Unary or over a Session, a failed step is reported as a failed call (exit 1, the
    status as JSON with its details)."""
    baseline = server.kv()
    assert main(["client", "--target", server.target, "generate", "--pipeline", pipeline,
                 "--tokens", "1 2 99999"]) == 1
    report = client_error(capsys.readouterr().err)
    assert report["code"] == "INVALID_ARGUMENT" and report["details"]
    assert server.kv() == baseline


def test_prompt_mode_needs_a_tokenizer_it_can_find(server: ServerHarness,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny model has no tokenizer: the run stops before admitting anything."""
    baseline = server.kv()
    assert main(["client", "--target", server.target, "generate", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "serves 'tiny'" in err and "--tokenizer DIR" in err
    assert server.kv() == baseline


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_pipelined_generate_equals_the_unary_loop_and_releases(
        server: ServerHarness, capsys: pytest.CaptureFixture[str], depth: int) -> None:
    """``--pipeline N`` sends the steps over one Session, N in flight: the same tokens as
    the unary loop, a tokens/s figure, and the sequence released (steps sent past the
    last token included)."""
    baseline = server.kv()
    runs = []
    for extra in (["--pipeline", "0"], ["--pipeline", str(depth)]):
        assert main(["client", "--target", server.target, "generate", "--tokens", "4 8 15",
                     "--max-new-tokens", "9", *extra]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    unary, piped = runs
    assert piped["token_ids"] == unary["token_ids"] and len(piped["token_ids"]) == 9
    assert piped["stop"] == "length" and piped["tokens_per_s"] > 0
    deadline = time.monotonic() + 10  # the release is queued behind the stream's steps
    while server.kv() != baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.kv() == baseline


def test_the_default_pipeline_depth_is_the_servers_default_session_depth() -> None:
    """Three steps in flight by default (two left the device waiting on some hosts), the
    client's and the server's defaults alike."""
    from service.cli import build_parser
    from service.config import ServerConfig

    parser = build_parser()
    generate = parser.parse_args(["client", "generate", "--tokens", "1"])
    serve = parser.parse_args(["serve"])
    assert generate.pipeline == serve.session_depth == ServerConfig().session_depth == 3
    from bench.serving.session_latency import DEPTH
    from tests.service.test_scheduler_example import load_example

    example = load_example()
    assert inspect.signature(example.generate_pipelined).parameters["depth"].default == 3
    assert DEPTH == 3  # the Session the benchmark's headline ratio measures
