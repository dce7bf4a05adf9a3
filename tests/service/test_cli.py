"""The CLI: flags become validated configs; the debug client talks to a real server."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from executor.config import ModelConfig
from service.cli import build_configs, build_parser, main
from service.config import ServerConfig
from service.server import serve
from tests.service.cli_process import client_error
from tests.service.harness import ServerHarness, tiny_config


def configs(*flags: str) -> tuple:  # type: ignore[type-arg]
    return build_configs(build_parser().parse_args(["serve", *flags]))


def test_defaults_bind_loopback_and_serve_tiny() -> None:
    executor, server = configs("--device", "cpu")
    assert executor.model.source == "tiny" and executor.device == "cpu"
    # ``auto`` is carried to boot, which settles it against the attention backend.
    assert (executor.graphs.decode_mode, executor.graphs.prefill_mode) == ("auto", "auto")
    assert server.host == "127.0.0.1" and server.port == 50051
    executor, server = configs("--device", "cpu", "--max-sequences", "8", "--metrics-port",
                               "-1", "--no-capture-at-startup", "--dtype", "bfloat16")
    assert executor.max_decode_batch == 8 and server.metrics_port is None
    assert not executor.graphs.capture_at_startup and executor.model.dtype == "bfloat16"
    assert server.rpc_log == "all" and configs("--rpc-log", "errors")[1].rpc_log == "errors"
    assert (server.max_session_streams, server.session_idle_timeout_s) == (64, 60.0)
    _, server = configs("--max-session-streams", "4", "--session-idle-timeout", "0")
    assert (server.max_session_streams, server.session_idle_timeout_s) == (4, 0.0)


def test_graph_modes_pass_through_checked() -> None:
    executor, _ = configs("--device", "cuda", "--prefill-graph", "tc_piecewise")
    assert (executor.graphs.decode_mode, executor.graphs.prefill_mode) == ("auto",
                                                                           "tc_piecewise")


@pytest.mark.parametrize(("flags", "message"), [
    (["--prefill-graph", "full"], "variable-length"),
    (["--decode-graph", "bogus"], "valid: auto"),
    (["--decode-graph", "full"], "(--decode-graph full) needs a CUDA device"),
    (["--max-sequences", "0"], "max_sequences"),
    (["--port", "70000"], "port"),
    (["--session-idle-timeout", "-1"], "session_idle_timeout_s"),
])
def test_bad_flags_exit_2_with_the_reason(flags: list[str], message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--device", "cpu", *flags])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_client_commands(server: ServerHarness, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["client", "--target", server.target]
    assert main([*base, "health"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "SERVER_STATE_READY"
    assert main([*base, "check", "--service", "model_executor.v1.Executor"]) == 0
    assert json.loads(capsys.readouterr().out) == {"status": "SERVING"}

    assert main([*base, "prefill", "--seq-id", "cli", "--tokens", "1,2,3", "--logprobs"]) == 0
    first = json.loads(capsys.readouterr().out)["outputs"][0]
    assert first["seq_len"] == 3 and "logprob" in first
    assert main([*base, "decode", "--seq-id", "cli", "--token", str(first["token_id"])]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"][0]["seq_len"] == 4
    assert main([*base, "fork", "cli", "kid", "--prefix-len", "2"]) == 0
    assert json.loads(capsys.readouterr().out) == {"seq_len": 2, "shared_tokens": 2}
    assert main([*base, "release", "cli", "ghost", "kid"]) == 0
    assert json.loads(capsys.readouterr().out) == {"released": 2, "unknown_seq_ids": ["ghost"],
                                                   "freed_tokens": 4}

    assert main([*base, "generate", "--tokens", "1 2 3", "--max-new-tokens", "4"]) == 0
    generated = json.loads(capsys.readouterr().out)["token_ids"]
    assert len(generated) == 4 and generated[0] == first["token_id"]  # same prompt, greedy

    assert main([*base, "decode", "--seq-id", "ghost", "--token", "1"]) == 1
    error = client_error(capsys.readouterr().err)
    assert error["code"] == "NOT_FOUND"
    assert error["details"][0]["type"] == "google.rpc.ResourceInfo"
    assert main([*base, "capture"]) == 1
    assert client_error(capsys.readouterr().err)["code"] == "FAILED_PRECONDITION"


def test_serve_exits_1_when_start_up_fails() -> None:
    config = replace(tiny_config(), model=ModelConfig(source="/nonexistent/model"))
    assert asyncio.run(serve(config, ServerConfig(port=0, metrics_port=None))) == 1
