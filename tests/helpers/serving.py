"""``model-executor serve`` as a real subprocess (its ranks spawned by it), for tests.

The log lines (JSON, stdout and stderr together) are collected on a thread; the gRPC port
comes from the ``serving`` line (``--port 0``: the kernel picks a free one), the spawned
ranks' pids from ``ranks_spawned``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc
from service.health import READINESS_SERVICE

ROOT = Path(__file__).resolve().parents[2]


def _pythonpath() -> str:
    """The checkout first, then whatever the test run's own path holds (dependencies
    installed with ``pip --target`` on machines without a package index)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


class ServeProcess:
    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        child_env = {**os.environ, "PYTHONPATH": _pythonpath(), "OMP_NUM_THREADS": "1",
                     **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--device", "cpu", "--port", "0",
             "--metrics-port", "-1", "--log-format", "json", *args],
            cwd=ROOT, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        serving = self.wait_for("serving", timeout=120)
        self.port = int(str(serving["grpc"]).rsplit(":", 1)[1])
        self.target = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.target)
        self.stub = pb_grpc.ExecutorStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    @staticmethod
    def start_follower(args: Sequence[str], env: dict[str, str]) -> subprocess.Popen[str]:
        """A rank other than 0 of a torchrun-style launch (it serves nothing)."""
        return subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--device", "cpu", "--port", "0",
             "--metrics-port", "-1", *args],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": _pythonpath(), "OMP_NUM_THREADS": "1",
                           **env},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def events(self, name: str) -> list[dict[str, Any]]:
        out = []
        for line in list(self.lines):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("event") == name:
                out.append(record)
        return out

    def wait_for(self, event: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.events(event)
            if found:
                return found[0]
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no {event!r} log line; output:\n{''.join(self.lines)[-4000:]}")

    def check(self, service: str = "") -> int:
        request = health_pb2.HealthCheckRequest(service=service)
        return int(self.health.Check(request, timeout=5).status)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.check(READINESS_SERVICE) == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"not ready; output:\n{''.join(self.lines)[-4000:]}")

    @property
    def rank_pids(self) -> dict[int, int]:
        spawned = self.wait_for("ranks_spawned", timeout=30)
        return {int(r): int(p) for r, p in spawned["pids"].items()}

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then the exit code (SIGKILL after ``timeout``)."""
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)
        finally:
            self._reader.join(5)


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """The (address, port) of every TCP socket ``pid`` listens on (``/proc``, Linux);
    IPv4 addresses mapped into IPv6 are given as IPv4."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)  # 32-bit words in host (little-endian) order
            addr = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            ip = ipaddress.ip_address(addr)
            mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:a.b.c.d is a.b.c.d
            found.append((str(mapped or ip), int(hex_port, 16)))
    return found
