"""Issue 19, defects 4 and 11: start-up failures are one line that says what to do.

4. grpcio sets SO_REUSEPORT by default, so a second server on a busy port used to start
   without error and the kernel split connections between the two processes.
11. A busy metrics port printed an OSError traceback; a TLS key that does not match its
   certificate said only "Failed to bind to address".
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from service.cli import main
from service.config import ServerConfig
from service.errors import StartupError
from service.server import ExecutorServer
from service.tls import TlsConfig
from tests.service.harness import ServerHarness, tiny_config

ROOT = Path(__file__).resolve().parents[2]


async def _start(config: ServerConfig) -> None:
    server = ExecutorServer(tiny_config(), config)
    try:
        await server.start()
    finally:
        await server.stop(0)


def test_second_server_on_a_busy_port_fails_naming_the_port(server: ServerHarness) -> None:
    port = server.server.port
    with pytest.raises(StartupError, match=f"127.0.0.1:{port}.*--port"):
        asyncio.run(_start(ServerConfig(port=port, metrics_port=None)))


def test_busy_metrics_port_fails_naming_the_port() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(StartupError, match=f"metrics on 127.0.0.1:{port}.*--metrics-port"):
            asyncio.run(_start(ServerConfig(port=0, metrics_port=port)))


def test_cli_on_a_busy_port_exits_with_one_line(server: ServerHarness) -> None:
    port = server.server.port
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--device", "cpu", "--port", str(port),
         "--metrics-port", "-1", "--log-format", "console"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    output = done.stdout + done.stderr
    assert "Traceback" not in output
    failures = [line for line in output.splitlines() if "startup_failed" in line]
    assert len(failures) == 1 and f":{port}" in failures[0], output
    assert "the port is in use" in failures[0]
    # nothing else: grpc-core's own "Failed to add port" line no longer comes first
    assert output.strip().splitlines() == failures, output


def test_an_address_not_on_this_host_is_named() -> None:
    with pytest.raises(StartupError, match=r"198\.51\.100\.7:45678: the address is not on "
                                           r"this host; choose another --host"):
        asyncio.run(_start(ServerConfig(host="198.51.100.7", port=45678, metrics_port=None)))


def test_tls_key_not_matching_its_certificate(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("cryptography", reason="makes the test certificates")
    from tests.system.reliability.certs import Authority  # needs cryptography (the test extra)

    a, b = Authority.make(tmp_path / "a", "a"), Authority.make(tmp_path / "b", "b")
    with pytest.raises(ValueError, match="does not match the certificate"):
        TlsConfig(a.server_cert, b.server_key)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--device", "cpu", "--tls-cert", str(a.server_cert), "--tls-key",
              str(b.server_key)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "does not match the certificate" in err and "Traceback" not in err


def test_a_client_ca_that_is_not_a_certificate_is_named(tmp_path: Path) -> None:
    """A client CA file with no certificate in it: exit 2 and one line naming the file
    (it was "the port is in use", exit 1, after grpc-core's own lines)."""
    pytest.importorskip("cryptography", reason="makes the test certificates")
    from tests.system.reliability.certs import Authority  # needs cryptography (the test extra)

    a = Authority.make(tmp_path / "a", "a")
    garbage = tmp_path / "ca.pem"
    garbage.write_text("not a certificate\n")
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--device", "cpu", "--port", "0",
         "--metrics-port", "-1", "--tls-cert", str(a.server_cert), "--tls-key",
         str(a.server_key), "--tls-client-ca", str(garbage), "--require-client-auth"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and str(garbage) in errors[0], done.stderr
    assert "holds no certificate" in errors[0]
    assert "port" not in done.stdout + done.stderr and "Traceback" not in done.stderr


def test_a_model_that_cannot_load_is_one_line(tmp_path: Path) -> None:
    """Boot errors that are the operator's to fix (a missing model directory) are one log
    line with the reason, not a traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--device", "cpu", "--port", "0",
         "--metrics-port", "-1", "--model", str(tmp_path / "missing"), "--log-format",
         "console"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    output = done.stdout + done.stderr
    assert "Traceback" not in output
    failures = [line for line in output.splitlines() if "boot_failed" in line]
    assert len(failures) == 1 and "does not exist" in failures[0], output
