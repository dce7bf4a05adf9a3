"""Throwaway X.509 material for the TLS tests, made with ``cryptography``: a CA, a server
certificate for localhost / 127.0.0.1 and a client certificate signed by it, and a second,
unrelated CA with its own pair (the "wrong CA")."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

Key = ec.EllipticCurvePrivateKey


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, cert: x509.Certificate | None = None, key: Key | None = None) -> Path:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        assert key is not None
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return path


def _cert(subject: str, key: Key, issuer: str, issuer_key: Key, ca: bool,
          usage: x509.ObjectIdentifier | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if usage == ExtendedKeyUsageOID.SERVER_AUTH:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@dataclass(frozen=True)
class Authority:
    """A CA and the server and client certificates it signed, as PEM files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @staticmethod
    def make(directory: Path, name: str) -> Authority:
        directory.mkdir(parents=True, exist_ok=True)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _cert(f"{name} CA", ca_key, f"{name} CA", ca_key, ca=True)
        server_key = ec.generate_private_key(ec.SECP256R1())
        server = _cert("localhost", server_key, f"{name} CA", ca_key, ca=False,
                       usage=ExtendedKeyUsageOID.SERVER_AUTH)
        client_key = ec.generate_private_key(ec.SECP256R1())
        client = _cert(f"{name} scheduler", client_key, f"{name} CA", ca_key, ca=False,
                       usage=ExtendedKeyUsageOID.CLIENT_AUTH)
        return Authority(
            ca=_write(directory / "ca.pem", ca),
            server_cert=_write(directory / "server.pem", server),
            server_key=_write(directory / "server.key", key=server_key),
            client_cert=_write(directory / "client.pem", client),
            client_key=_write(directory / "client.key", key=client_key))
