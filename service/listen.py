"""Adding a listening port to a gRPC server, with a one-line ``StartupError`` when it cannot.

grpc-core reports a failed bind as a raw line of its own on stderr, then grpcio raises
"Failed to bind to address", which does not say why. So the address is tried first with a
plain socket (as gRPC binds it: ``SO_REUSEADDR``, no ``SO_REUSEPORT``): a busy port or an
address not on this host is refused before gRPC sees it. gRPC's own failure (a race, TLS
material it refuses) remains a fallback with the generic message.
"""

from __future__ import annotations

import contextlib
import errno
import socket

import grpc

from service.errors import StartupError


def bind(server: grpc.aio.Server, address: str, flag: str,
         credentials: grpc.ServerCredentials | None = None) -> int:
    """Add a listening port on ``address`` ("host:port", "[v6]:port"); the port bound.
    ``flag`` names the option that chose the port, for the message."""
    why = unbindable(address)
    if why == "in_use":
        raise StartupError(f"cannot listen on {address}: the port is in use (another "
                           f"model-executor?); stop the other process or choose another "
                           f"{flag}")
    if why == "not_here":
        raise StartupError(f"cannot listen on {address}: the address is not on this host; "
                           "choose another --host")
    try:
        if credentials is not None:
            return server.add_secure_port(address, credentials)
        return server.add_insecure_port(address)
    except RuntimeError:  # grpcio says only "Failed to bind to address ..."
        raise StartupError(
            f"cannot listen on {address}: the port is in use (another model-executor?) or "
            f"the address is not on this host; stop the other process or choose another "
            f"{flag}") from None


def unbindable(address: str) -> str | None:
    """Why ``address`` cannot be bound: ``in_use`` when the port is taken on an address it
    resolves to, ``not_here`` when none of those is on this host; None when it can be, for
    port 0, and when it does not resolve (gRPC's own bind decides)."""
    host, _, port_text = address.rpartition(":")
    try:
        port = int(port_text)
        if port == 0:
            return None
        found = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (ValueError, OSError):
        return None
    failures = [_bind_error(family, sockaddr) for family, _, _, _, sockaddr in found]
    if errno.EADDRINUSE in failures:
        return "in_use"
    if failures and all(e == errno.EADDRNOTAVAIL for e in failures):
        return "not_here"
    return None


def _bind_error(family: int, sockaddr: tuple[object, ...]) -> int | None:
    """The errno of binding ``sockaddr`` as gRPC would (None: it binds)."""
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        return None
    with contextlib.closing(sock):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            return exc.errno
    return None
