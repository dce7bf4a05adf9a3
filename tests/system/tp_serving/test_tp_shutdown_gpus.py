"""SIGTERM to ``serve --model tiny --device cuda --tensor-parallel-size 2`` (marker
``gpu``, 2 GPUs): exit 0 within drain delay + grace period + the teardown's bound + a
few seconds, with no rank process, listener or shared-memory file left behind (NCCL
teardown must not keep either rank alive)."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch

from executor.distributed.bootstrap import TEARDOWN_TIMEOUT_S
from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.helpers.serving import ServeProcess, alive

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs (tensor parallelism)")]

DRAIN_S, GRACE_S = 1.0, 2.0


def _shm() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir()} if Path("/dev/shm").is_dir() else set()


def test_tp2_on_cuda_exits_zero_after_sigterm_and_leaves_nothing() -> None:
    before = _shm()
    server = ServeProcess(["--model", "tiny", "--device", "cuda", "--tensor-parallel-size",
                           "2", "--max-sequences", "8", "--max-context", "256",
                           "--drain-delay", str(DRAIN_S), "--grace-period", str(GRACE_S)])
    pids = server.rank_pids
    try:
        server.wait_ready(600)  # graphs capture at start-up
        out = server.stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(
            seq_id="s", token_ids=[5, 17, 99, 4], sample=True)]), timeout=60)
        server.stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(
            seq_id="s", token_id=out.outputs[0].token_id)]), timeout=60)
        server.channel.close()
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        bound = DRAIN_S + GRACE_S + TEARDOWN_TIMEOUT_S + 10
        assert server.proc.wait(bound) == 0, "".join(server.lines)[-3000:]
        assert time.monotonic() - started < bound
        assert server.events("rank_stopped"), "".join(server.lines)[-3000:]
        deadline = time.monotonic() + 5
        while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids.values()), "a rank outlived the server"
        leaked = {n for n in _shm() - before if n.startswith(("torch_", "nccl", "gloo"))}
        assert not leaked
        with socket.socket() as s:  # nothing listens on the gRPC port any more
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", server.port))
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
