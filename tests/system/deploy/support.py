"""What the deployment tests share: repository paths, YAML loading, external tools (skipped
with a reason locally, required under CI=true), and a live ``tiny`` server started through
the real CLI, as the container would start it (the fixtures are in ``conftest.py``).
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose"
GRAFANA = DEPLOY / "grafana"
PROMETHEUS = DEPLOY / "prometheus"
DASHBOARD = GRAFANA / "dashboards" / "model-executor.json"
ALERTS = PROMETHEUS / "alerts.yml"

READY_TIMEOUT_S = 90.0


def load_yaml_documents(path: Path) -> list[Any]:
    """Every non-empty document of a YAML file."""
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def load_yaml(path: Path) -> Any:
    docs = load_yaml_documents(path)
    assert len(docs) == 1, f"{path} should hold one YAML document, has {len(docs)}"
    return docs[0]


def k8s_manifests() -> dict[str, dict[str, Any]]:
    """deploy/k8s objects by kind (one object of each kind), Kustomization included."""
    objects: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in load_yaml_documents(path):
            assert doc["kind"] not in objects, f"two {doc['kind']} objects in deploy/k8s"
            objects[doc["kind"]] = doc
    return objects


def require_tool(name: str, install_hint: str) -> str:
    """The tool's path; skip without it, except in CI (CI=true), where that is a failure."""
    path = shutil.which(name)
    if path is not None:
        return path
    message = f"{name} not found ({install_hint})"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message}: CI must install it (.ci/run)")
    pytest.skip(message)


def require_module(name: str, install_hint: str) -> Any:
    """The imported module; skip without it, except in CI (CI=true), where that fails."""
    try:
        return importlib.import_module(name)
    except ImportError:
        message = f"{name} not importable ({install_hint})"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}: CI must install it (pyproject's test extra)")
        pytest.skip(message)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Any, timeout: float, what: str, process: subprocess.Popen[bytes],
             log: Path) -> None:
    """Poll ``predicate()`` until it is truthy; fail early if ``process`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"process exited ({process.returncode}) before {what}:\n"
                        f"{log.read_text()[-4000:]}")
        try:
            if predicate():
                return
        except Exception:
            pass
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}:\n{log.read_text()[-4000:]}")


def stop_process(process: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


@dataclass
class LiveServer:
    """A ``model-executor serve --model tiny --device cpu`` subprocess."""

    process: subprocess.Popen[bytes]
    grpc_port: int
    metrics_port: int
    log: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def scrape(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
            return str(response.read().decode())

    def ready(self) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(self.target) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="model_executor.v1.Executor"), timeout=2)
        return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


def drive_traffic(target: str, sequences: int = 3, decode_steps: int = 4) -> None:
    """Steps through every path a CPU executor has, plus one NOT_FOUND (a non-OK code)."""
    import grpc

    from service.gen.model_executor.v1 import executor_pb2 as pb
    from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ExecutorStub(channel)
        ids = [f"deploy-test-{i}" for i in range(sequences)]
        first = stub.Prefill(pb.PrefillRequest(items=[
            pb.PrefillItem(seq_id=s, token_ids=[1, 2, 3, 4 + i], sample=True)
            for i, s in enumerate(ids)]), timeout=30)
        tokens = {o.seq_id: o.token_id for o in first.outputs}
        for _ in range(decode_steps):
            step = stub.Decode(pb.DecodeRequest(items=[
                pb.DecodeItem(seq_id=s, token_id=tokens[s]) for s in ids]), timeout=30)
            tokens = {o.seq_id: o.token_id for o in step.outputs}
        stub.Release(pb.ReleaseRequest(seq_ids=ids), timeout=30)
        stub.Health(pb.HealthRequest(), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(seq_id="deploy-test-unknown",
                                                              token_id=1)]), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]


def serve_live(log: Path, extra: list[str]) -> Iterator[LiveServer]:
    """``serve`` on free ports, logging to ``log``, until it scrapes and is ready; stopped
    (SIGTERM) when the generator is closed."""
    grpc_port, metrics_port = free_port(), free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "2"}
    argv = [sys.executable, "-m", "service.cli", "serve", "--model", "tiny", "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(grpc_port), "--metrics-port",
            str(metrics_port), "--kv-tokens", "4096", "--max-sequences", "16",
            "--grace-period", "2", "--log-format", "json", *extra]
    with log.open("wb") as out:
        process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out,
                                   stderr=subprocess.STDOUT)
    server = LiveServer(process, grpc_port, metrics_port, log)
    try:
        wait_for(server.scrape, READY_TIMEOUT_S, "the metrics port", process, log)
        wait_for(server.ready, READY_TIMEOUT_S, "readiness SERVING", process, log)
        yield server
    finally:
        stop_process(process)
