"""The sidecar's gRPC transport, and the small interface it meets.

The transport serves the servicer, ext_proc's ``Process``, and the standard ``grpc.health.v1``
service on one address: ``h2_transport.H2Transport``, on the HTTP/2 server of this project
(``h2/``, with ``health.H2Health`` for the health service). Tests run a second one beside it,
grpc.aio, as an oracle (``testing.grpc_aio``, not part of the product).

``extproc.app`` builds one and drives it through ``Transport``: start it on an address
(``split_host_port``'s ``HOST:PORT``, or ``unix:PATH``), with TLS or mutual TLS from
``TlsFiles``; set the health statuses; stop it with a grace; wait for its end.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "Health",
    "Process",
    "ServerTransport",
    "Serving",
    "TlsFiles",
    "Transport",
    "split_host_port",
]

# The servicer's entry point for one ext_proc stream: ``ExtProcService.Process(requests,
# context)``; the context is the stream (``extproc.stream.Stream``).
Process = Callable[[Any, Any], Awaitable[None]]


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsFiles:
    """PEM files for the gRPC listener: TLS with cert+key; mutual TLS when client_ca is set
    (clients, i.e. Envoy, must then present a certificate signed by it)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        if self.client_ca is not None:
            ctx.load_verify_locations(self.client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.set_alpn_protocols(["h2"])
        return ctx


def split_host_port(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


class Health(Protocol):
    """The calls the sidecar makes of a health service (grpc_health's servicer has them)."""

    async def set(self, service: str, status: Any) -> None: ...

    async def enter_graceful_shutdown(self) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Serving:
    """What a transport serves and where: ext_proc's entry point on ``listen``, with TLS from
    ``tls``; ``body_limit`` is the largest body Envoy forwards and ``max_streams`` the most
    ext_proc streams Envoy opens (a transport sizes its bounds from them, or keeps its own)."""

    process: Process
    listen: str
    tls: TlsFiles | None
    body_limit: int
    max_streams: int


class Transport(Protocol):
    """A gRPC server for the sidecar's services. ``health`` exists from construction (the
    sidecar may enter graceful shutdown without having started)."""

    @property
    def health(self) -> Health: ...

    async def start(self, serving: Serving) -> int | None:
        """Serve ext_proc and grpc.health.v1; returns the TCP port (None on a unix socket)."""
        ...

    async def stop(self, grace: float) -> None:
        """Flush answers already written; cancel what is still open after ``grace``."""
        ...

    async def wait_for_termination(self) -> None: ...


class _Server(Protocol):
    """What ``H2Server`` and ``grpc.aio.Server`` have alike."""

    async def stop(self, grace: float) -> Any: ...

    async def wait_for_termination(self) -> Any: ...


class ServerTransport:
    """The part of a ``Transport`` that stops a server and waits for it: once ``start`` has
    one listening (``_server``), it is stopped and waited for the same way (the h2 transport
    and the tests' grpc.aio one share it)."""

    def __init__(self) -> None:
        self._server: _Server | None = None

    async def stop(self, grace: float) -> None:
        if self._server is not None:
            await self._server.stop(grace)

    async def wait_for_termination(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()
