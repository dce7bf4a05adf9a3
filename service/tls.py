"""Transport security: TLS and mutual TLS for the gRPC listener, and the client side of it.

Modes, from the flags (``model-executor serve``):

| flags                                           | mode                                 |
|-------------------------------------------------|--------------------------------------|
| none                                            | plaintext (fine on 127.0.0.1)        |
| ``--tls-cert --tls-key``                        | TLS: the client checks the server    |
| ... ``--tls-client-ca --require-client-auth``   | mTLS: every client needs one         |

``--tls-client-ca`` alone is refused: gRPC Python can only *request* an optional client
certificate without verifying it, so a certificate from any CA would be accepted while the
flag promised a check. Files are read and checked once, at start-up, so a bad path or a
file that is not what its flag names is a start-up error.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


def _read(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} {str(path)!r}: {exc.strerror}") from exc
    if not data.strip():
        raise ValueError(f"the {what} {str(path)!r} is empty")
    return data


@dataclass(frozen=True)
class TlsConfig:
    """PEM files of the server's certificate chain and key, and of the CA that signs client
    certificates (``client_ca``); ``require_client_auth`` makes client certificates
    mandatory (mTLS). The contents are read in ``__post_init__`` (and checked to exist)."""

    cert: Path
    key: Path
    client_ca: Path | None = None
    require_client_auth: bool = False

    def __post_init__(self) -> None:
        if self.require_client_auth and self.client_ca is None:
            raise ValueError("--require-client-auth needs --tls-client-ca (the CA that signs "
                             "client certificates)")
        if self.client_ca is not None and not self.require_client_auth:
            raise ValueError("--tls-client-ca needs --require-client-auth: gRPC cannot verify "
                             "an optional client certificate, so without it a certificate "
                             "from any CA would be accepted; add --require-client-auth (mTLS) "
                             "or drop --tls-client-ca")
        for path, what in ((self.cert, "TLS certificate"), (self.key, "TLS key"),
                           (self.client_ca, "client CA")):
            if path is not None:
                _read(path, what)
        _check_pair(self.cert, self.key)
        if self.client_ca is not None:
            _check_ca(self.client_ca)

    @property
    def mode(self) -> str:
        return "mtls" if self.require_client_auth else "tls"

    def server_credentials(self) -> grpc.ServerCredentials:
        key, cert = _read(self.key, "TLS key"), _read(self.cert, "TLS certificate")
        ca = _read(self.client_ca, "client CA") if self.client_ca is not None else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=self.require_client_auth)


def _check_pair(cert: Path, key: Path) -> None:
    """Refuse a certificate and key that do not load or do not belong together (gRPC says
    only "Failed to bind to address" for them)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # A password callback that returns nothing: an encrypted key fails, never prompts.
        context.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise ValueError(f"the TLS key {str(key)!r} does not match the certificate "
                             f"{str(cert)!r}: pass the key the certificate was issued "
                             "for") from None
        raise ValueError(f"cannot load the TLS certificate {str(cert)!r} with the key "
                         f"{str(key)!r} ({exc.reason or exc}): both must be PEM, the key "
                         "unencrypted") from None


def _check_ca(path: Path) -> None:
    """Refuse a client CA file with no PEM certificate in it (gRPC says only "Failed to
    bind to address", which read as a busy port)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise ValueError(f"the client CA {str(path)!r} holds no certificate "
                         f"({exc.reason or exc}): pass the PEM file of the CA that signs "
                         "the client certificates") from None


def channel_credentials(ca: Path | None, cert: Path | None = None, key: Path | None = None
                        ) -> grpc.ChannelCredentials:
    """Client credentials: trust ``ca`` (None: the system roots); present ``cert``/``key``
    for mTLS (both or neither)."""
    if (cert is None) != (key is None):
        raise ValueError("a client certificate needs its key and a key its certificate "
                         "(--tls-cert and --tls-key together)")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "CA certificate") if ca is not None else None,
        private_key=_read(key, "TLS key") if key is not None else None,
        certificate_chain=_read(cert, "TLS certificate") if cert is not None else None)
