"""Security: loopback by default, TLS and mTLS with throwaway certificates, bearer tokens
(health exempt, an admin token for Capture), message-size limits, the CLI's flags and the
debug client's TLS/token options. Everything talks to 127.0.0.1 only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from service.auth import AuthConfig, Secret, check
from service.cli import build_configs, build_parser, main
from service.config import ServerConfig
from service.errors import PermissionDenied, Unauthenticated
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc
from service.health import READINESS_SERVICE
from service.tls import TlsConfig, channel_credentials
from tests.system.reliability.certs import Authority
from tests.system.reliability.figures import Figures
from tests.system.reliability.support import ServerHarness, check_kv, details, rpc_error, serving

SERVICE_TOKEN = "svc-token-0123456789"
ADMIN_TOKEN = "adm-token-9876543210"
SERVING = health_pb2.HealthCheckResponse.SERVING
PREFILL = pb.PrefillRequest(items=[pb.PrefillItem(seq_id="sec", token_ids=[1, 2, 3])])


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Authority, Authority]:
    root = tmp_path_factory.mktemp("pki")
    return Authority.make(root / "good", "good"), Authority.make(root / "other", "other")


@pytest.fixture(scope="module")
def tls_server(pki: tuple[Authority, Authority], figures: Figures
               ) -> Iterator[ServerHarness]:
    """TLS (no client certificates), a service and an admin token, a plaintext health port."""
    good, _ = pki
    config = ServerConfig(port=0, metrics_port=0, health_port=0,
                          tls=TlsConfig(good.server_cert, good.server_key),
                          auth=AuthConfig(Secret(SERVICE_TOKEN), Secret(ADMIN_TOKEN)))
    with serving(figures, server_config=config) as harness:
        yield harness


@pytest.fixture(scope="module")
def mtls_server(pki: tuple[Authority, Authority], figures: Figures
                ) -> Iterator[ServerHarness]:
    good, _ = pki
    config = ServerConfig(port=0, metrics_port=0, tls=TlsConfig(
        good.server_cert, good.server_key, client_ca=good.ca, require_client_auth=True))
    with serving(figures, server_config=config) as harness:
        yield harness


def secure(harness: ServerHarness, ca: Path, cert: Path | None = None,
           key: Path | None = None) -> grpc.Channel:
    return grpc.secure_channel(harness.target, channel_credentials(ca, cert, key))


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def health_ok(channel: grpc.Channel, service: str = READINESS_SERVICE) -> bool:
    request = health_pb2.HealthCheckRequest(service=service)
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status == SERVING


# -- binding --------------------------------------------------------------------------------

# /proc/net/tcp{,6} spellings of 127.0.0.1, ::ffff:127.0.0.1 and ::1
LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a socket listening on ``port`` (from /proc/net/tcp*)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A = LISTEN
                found.add(address)
    return found


def test_binds_loopback_unless_told(tls_server: ServerHarness) -> None:
    assert ServerConfig().host == "127.0.0.1"
    _, server = build_configs(build_parser().parse_args(["serve", "--device", "cpu"]), env={})
    assert server.host == "127.0.0.1" and server.tls is None and not server.auth.enabled
    for port in (tls_server.server.port, tls_server.server.health_port,
                 tls_server.server.metrics_port):
        assert port
        listening = _listening_addresses(port)
        assert listening and listening <= LOOPBACK, listening


# -- TLS and mTLS ---------------------------------------------------------------------------

def test_tls_works_and_wrong_ca_or_plaintext_fail(tls_server: ServerHarness,
                                                  pki: tuple[Authority, Authority]) -> None:
    good, other = pki
    with secure(tls_server, good.ca) as channel:
        assert health_ok(channel)
        stub = pb_grpc.ExecutorStub(channel)
        step = stub.Prefill(PREFILL, timeout=10, metadata=bearer(SERVICE_TOKEN))
        assert step.outputs[0].seq_len == 3
        stub.Release(pb.ReleaseRequest(seq_ids=["sec"]), timeout=10,
                     metadata=bearer(SERVICE_TOKEN))
    with secure(tls_server, other.ca) as channel:  # the server's certificate is not trusted
        with pytest.raises(grpc.RpcError) as info:
            health_ok(channel)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(tls_server.target) as channel:  # no TLS at all
        with pytest.raises(grpc.RpcError) as info:
            health_ok(channel)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # probes that cannot do TLS use the plaintext health-only port
    with grpc.insecure_channel(f"127.0.0.1:{tls_server.server.health_port}") as channel:
        assert health_ok(channel) and health_ok(channel, "")
        with pytest.raises(grpc.RpcError) as info:  # nothing else is served there
            pb_grpc.ExecutorStub(channel).Health(pb.HealthRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_mtls_requires_a_client_certificate_from_the_ca(
        mtls_server: ServerHarness, pki: tuple[Authority, Authority], figures: Figures) -> None:
    good, other = pki
    with secure(mtls_server, good.ca, good.client_cert, good.client_key) as channel:
        assert health_ok(channel)
        step = pb_grpc.ExecutorStub(channel).Prefill(PREFILL, timeout=10)
        assert step.outputs[0].seq_len == 3
        pb_grpc.ExecutorStub(channel).Release(pb.ReleaseRequest(seq_ids=["sec"]), timeout=10)
    for cert, key in ((None, None), (other.client_cert, other.client_key)):
        with secure(mtls_server, good.ca, cert, key) as channel:  # none, or wrong CA's
            with pytest.raises(grpc.RpcError) as info:
                health_ok(channel)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert check_kv(mtls_server, figures).active_sequences == 0


# -- tokens ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("token", "admin", "method", "presented", "expected"), [
    (None, None, "/model_executor.v1.Executor/Prefill", None, None),
    ("s", None, "/model_executor.v1.Executor/Prefill", None, Unauthenticated),
    ("s", None, "/model_executor.v1.Executor/Prefill", "x", Unauthenticated),
    ("s", None, "/model_executor.v1.Executor/Prefill", "s", None),
    ("s", "a", "/model_executor.v1.Executor/Prefill", "a", None),  # admin may do all
    ("s", None, "/model_executor.v1.Executor/Capture", "s", None),  # no admin token set
    ("s", "a", "/model_executor.v1.Executor/Capture", "s", PermissionDenied),
    ("s", "a", "/model_executor.v1.Executor/Capture", None, Unauthenticated),
    ("s", "a", "/model_executor.v1.Executor/Capture", "a", None),
    (None, "a", "/model_executor.v1.Executor/Decode", None, None),  # only Capture guarded
    (None, "a", "/model_executor.v1.Executor/Capture", "x", Unauthenticated),
    ("s", "a", "/grpc.health.v1.Health/Check", None, None),  # probes are exempt
    ("s", "a", "/grpc.health.v1.Health/Watch", "x", None),
    ("s", None, "/model_executor.v1.Executor/Health", None, Unauthenticated),
    ("s", None, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", None,
     Unauthenticated),
])
def test_access_table(token: str | None, admin: str | None, method: str,
                      presented: str | None, expected: type | None) -> None:
    config = AuthConfig(Secret(token) if token else None, Secret(admin) if admin else None)
    error = check(config, method, presented)
    assert (type(error) if error is not None else None) is expected


def test_tokens_are_enforced(tls_server: ServerHarness, pki: tuple[Authority, Authority],
                             capsys: pytest.CaptureFixture[str], figures: Figures) -> None:
    good, _ = pki
    with secure(tls_server, good.ca) as channel:
        stub = pb_grpc.ExecutorStub(channel)
        for metadata in (None, bearer("wrong"), [("authorization", SERVICE_TOKEN)]):
            for call, request in ((stub.Prefill, PREFILL), (stub.Health, pb.HealthRequest()),
                                  (stub.Release, pb.ReleaseRequest(seq_ids=["sec"]))):
                err = rpc_error(call, request, metadata=metadata)
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED, call
                assert details(err)["ErrorInfo"].reason == "UNAUTHENTICATED"  # type: ignore[attr-defined]
        assert health_ok(channel)  # grpc.health.v1 needs no token
        # reflection follows the API's access
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as info:
            list(reflect.ServerReflectionInfo(iter([ask]), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        listed = list(reflect.ServerReflectionInfo(iter([ask]), timeout=5,
                                                   metadata=bearer(SERVICE_TOKEN)))
        assert listed[0].list_services_response.service
        # Capture needs the admin token: the service token is known but not enough
        err = rpc_error(stub.Capture, pb.CaptureRequest(), metadata=bearer(SERVICE_TOKEN))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        err = rpc_error(stub.Capture, pb.CaptureRequest(), metadata=bearer(ADMIN_TOKEN))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION  # past auth; CPU: no graphs
        assert stub.Health(pb.HealthRequest(), timeout=5,
                           metadata=bearer(ADMIN_TOKEN)).state == pb.SERVER_STATE_READY
    assert check_kv(tls_server, figures).active_sequences == 0  # no refused call ran
    metrics = tls_server.scrape()
    refused = metrics[("grpc_server_handled_total", (
        ("grpc_code", "UNAUTHENTICATED"), ("grpc_method", "Prefill"),
        ("grpc_service", "model_executor.v1.Executor"), ("grpc_type", "unary")))]
    assert refused == 3
    logged = capsys.readouterr()
    assert "UNAUTHENTICATED" in logged.err  # refusals are logged ...
    assert SERVICE_TOKEN not in logged.out + logged.err  # ... and tokens never are
    assert ADMIN_TOKEN not in logged.out + logged.err
    assert SERVICE_TOKEN not in repr(tls_server.server.config)


def test_message_size_limit(tls_server: ServerHarness, pki: tuple[Authority, Authority],
                            figures: Figures) -> None:
    good, _ = pki
    limit = tls_server.server.limits.max_receive_bytes
    huge = pb.PrefillRequest(items=[pb.PrefillItem(seq_id="big", token_ids=[300] * (limit // 2))])
    assert huge.ByteSize() > limit
    with secure(tls_server, good.ca) as channel:
        stub = pb_grpc.ExecutorStub(channel)
        err = rpc_error(stub.Prefill, huge, metadata=bearer(SERVICE_TOKEN))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert health_ok(channel)
        stub.Prefill(PREFILL, timeout=10, metadata=bearer(SERVICE_TOKEN))  # still serving
        stub.Release(pb.ReleaseRequest(seq_ids=["sec"]), timeout=10,
                     metadata=bearer(SERVICE_TOKEN))
    assert check_kv(tls_server, figures).active_sequences == 0


# -- CLI ------------------------------------------------------------------------------------

def test_serve_flags(pki: tuple[Authority, Authority], tmp_path: Path) -> None:
    good, _ = pki
    token_file = tmp_path / "token"
    token_file.write_text(f"{SERVICE_TOKEN}\n")
    args = build_parser().parse_args([
        "serve", "--device", "cpu", "--tls-cert", str(good.server_cert), "--tls-key",
        str(good.server_key), "--tls-client-ca", str(good.ca), "--require-client-auth",
        "--token-file", str(token_file), "--health-port", "0", "--retry-cache-entries", "7",
        "--retry-cache-mib", "1", "--retry-cache-per-sequence", "2"])
    _, server = build_configs(args, env={"MODEL_EXECUTOR_ADMIN_TOKEN": ADMIN_TOKEN})
    assert server.tls is not None and server.tls.mode == "mtls"
    assert server.auth.token == Secret(SERVICE_TOKEN)
    assert server.auth.admin_token == Secret(ADMIN_TOKEN)
    assert server.health_port == 0
    assert (server.retry_cache.max_entries, server.retry_cache.max_bytes,
            server.retry_cache.per_sequence) == (7, 2**20, 2)
    assert SERVICE_TOKEN not in repr(server) and ADMIN_TOKEN not in repr(server)
    _, server = build_configs(build_parser().parse_args(["serve", "--device", "cpu"]),
                              env={"MODEL_EXECUTOR_TOKEN": SERVICE_TOKEN})
    assert server.auth.token == Secret(SERVICE_TOKEN) and server.auth.admin_token is None
    executor, _ = build_configs(build_parser().parse_args([
        "serve", "--device", "cuda", "--prefill-graph", "tc_piecewise", "--prefill-compiler",
        "inductor"]), env={})
    assert executor.graphs.compiler == "inductor"
    assert executor.graphs.prefill_mode == "tc_piecewise"


def test_optional_client_certificate_is_refused(pki: tuple[Authority, Authority]) -> None:
    """Issue 19, defect 7: with a client CA but no --require-client-auth, gRPC accepted a
    client certificate from any CA; the combination is refused instead."""
    good, _ = pki
    with pytest.raises(ValueError, match="needs --require-client-auth"):
        TlsConfig(good.server_cert, good.server_key, client_ca=good.ca)


@pytest.mark.parametrize(("flags", "message"), [
    (["--tls-cert", "{cert}"], "both --tls-cert and --tls-key"),
    (["--tls-client-ca", "{ca}"], "need --tls-cert"),
    (["--tls-cert", "{cert}", "--tls-key", "{key}", "--require-client-auth"],
     "needs --tls-client-ca"),
    # Issue 19, defect 7: an optional client certificate could not be verified.
    (["--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-client-ca", "{ca}"],
     "--tls-client-ca needs --require-client-auth"),
    (["--tls-cert", "/nonexistent.pem", "--tls-key", "{key}"], "cannot read"),
    (["--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-client-ca", "{key}",
      "--require-client-auth"], "holds no certificate"),  # a key where the CA goes
    (["--token-file", "{empty}"], "is empty"),
    (["--token-file", "/nonexistent"], "cannot read the token file"),
    (["--prefill-compiler", "inductor"], "only to --prefill-graph tc_piecewise"),
    (["--retry-cache-per-sequence", "0"], "per_sequence"),
])
def test_bad_security_flags_exit_2(flags: list[str], message: str, tmp_path: Path,
                                   pki: tuple[Authority, Authority],
                                   capsys: pytest.CaptureFixture[str]) -> None:
    good, _ = pki
    empty = tmp_path / "empty"
    empty.write_text("\n")
    values = {"cert": good.server_cert, "key": good.server_key, "ca": good.ca, "empty": empty}
    with pytest.raises(SystemExit) as info:
        main(["serve", "--device", "cpu", *(f.format(**values) for f in flags)])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_debug_client_tls_and_token(tls_server: ServerHarness, mtls_server: ServerHarness,
                                    pki: tuple[Authority, Authority], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    good, _ = pki
    base = ["client", "--target", f"localhost:{tls_server.server.port}", "--tls-ca",
            str(good.ca)]
    assert main([*base, "--token", SERVICE_TOKEN, "health"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "SERVER_STATE_READY"
    assert main([*base, "health"]) == 1  # no token
    assert '"UNAUTHENTICATED"' in capsys.readouterr().err
    token_file = tmp_path / "token"
    token_file.write_text(SERVICE_TOKEN)
    assert main([*base, "--token-file", str(token_file), "--request-id", "cli", "generate",
                 "--tokens", "1,2", "--max-new-tokens", "3"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3
    monkeypatch.setenv("MODEL_EXECUTOR_TOKEN", ADMIN_TOKEN)
    assert main([*base, "capture"]) == 1  # the admin token passes auth; CPU has no graphs
    assert '"FAILED_PRECONDITION"' in capsys.readouterr().err
    monkeypatch.delenv("MODEL_EXECUTOR_TOKEN")
    mtls = ["client", "--target", mtls_server.target, "--tls-ca", str(good.ca)]
    assert main([*mtls, "--tls-cert", str(good.client_cert), "--tls-key",
                 str(good.client_key), "check"]) == 0
    assert json.loads(capsys.readouterr().out) == {"status": "SERVING"}
    assert main([*mtls, "--tls-cert", str(good.client_cert), "check"]) == 2  # no key
    assert "--tls-key" in capsys.readouterr().err
