"""The sidecar's services on grpc.aio: a test oracle, never part of the product.

The product serves gRPC on its own HTTP/2 server (``extproc.transport.h2_transport``). Tests
run the same ``Sidecar`` on grpc.aio as well, a second gRPC implementation to compare its
answers with: ``GrpcAioTransport`` is an ``extproc.transport.Transport`` for ``Sidecar``'s
``transport`` parameter, ``sidecar_on("grpc")`` builds a ``Sidecar`` on it in-process, and
``serve_argv("grpc")`` starts one as a process (``python -m testing.grpc_sidecar``, which
takes ``llm-extproc serve``'s flags).

ext_proc's ``Process`` is registered so that pre-encoded answers (bytes from
``request.respond``) and messages can both be written to the stream; ``grpc.health.v1`` is
grpc_health's own servicer. Its bounds are grpc core's, with a fixed message limit
(``MAX_MESSAGE``; the h2 transport sizes its own from the policy instead). grpc.aio stops
serving after one non-UTF-8 ``:path`` (``tests/e2e/test_grpc_aio_path.py``): that is one
reason it is not the product's.
"""

from __future__ import annotations

import socket
import sys
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from grpc_health.v1 import health, health_pb2_grpc

from extproc.app import Sidecar
from extproc.config.policy import Policy
from extproc.contract import EXT_PROC_SERVICE
from extproc.request import respond
from extproc.transport import ServerTransport, Serving, TlsFiles, split_host_port

__all__ = [
    "MAX_MESSAGE",
    "TRANSPORTS",
    "GrpcAioSidecar",
    "GrpcAioTransport",
    "serve_argv",
    "sidecar_on",
]

# The transports tests run the sidecar on: the product's (h2) and this oracle (grpc). The names
# are what llm_extproc_build_info's transport label says.
TRANSPORTS = ("h2", "grpc")

# Envoy buffers the whole request body and sends it in one gRPC message: allow large ones.
# Envoy's own buffer limit (413 before we see the body) is the real bound on body size.
MAX_MESSAGE = 64 * 1024 * 1024


class GrpcAioTransport(ServerTransport):
    """grpc.aio serving ext_proc and grpc.health.v1 (``extproc.transport.Transport``)."""

    def __init__(self) -> None:
        super().__init__()
        self.health = health.aio.HealthServicer()

    async def start(self, serving: Serving) -> int | None:
        listen, tls = serving.listen, serving.tls
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE),
                ("grpc.max_send_message_length", MAX_MESSAGE),
                # Fail loudly if the port is taken instead of sharing it.
                ("grpc.so_reuseport", 0),
            ]
        )
        handler = grpc.method_handlers_generic_handler(
            EXT_PROC_SERVICE,
            {
                # grpc.aio runs a coroutine function as a stream-stream method: ``process``
                # must be one (the servicer's bound ``Process``), not a wrapper.
                "Process": grpc.stream_stream_rpc_method_handler(
                    serving.process,
                    request_deserializer=ext_pb.ProcessingRequest.FromString,
                    response_serializer=respond.serialize,
                )
            },
        )
        server.add_generic_rpc_handlers((handler,))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if not listen.startswith("unix:"):
            _probe(listen)
        if tls is not None:
            port = server.add_secure_port(listen, _server_credentials(tls))
        else:
            port = server.add_insecure_port(listen)
        if not listen.startswith("unix:") and port == 0:
            raise OSError(f"cannot listen on {listen}")
        await server.start()
        self._server = server
        return None if listen.startswith("unix:") else port


def _server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """TLS with cert+key; mutual TLS when client_ca is set."""
    return grpc.ssl_server_credentials(
        [(tls.key.read_bytes(), tls.cert.read_bytes())],
        root_certificates=tls.client_ca.read_bytes() if tls.client_ca else None,
        require_client_auth=tls.client_ca is not None,
    )


def _probe(listen: str) -> None:
    """Raise the OSError binding ``listen`` (HOST:PORT) gives, if it gives one: grpc.aio's own
    failure is a RuntimeError without the cause, after grpc's core logged it on stderr."""
    host, port = split_host_port(listen)
    if port == 0:
        return
    # create_server sets SO_REUSEADDR, as grpc does: a port in TIME_WAIT is not taken.
    socket.create_server((host, port)).close()


class GrpcAioSidecar(Sidecar):
    """``Sidecar`` on grpc.aio, its llm_extproc_build_info saying so (transport "grpc")."""

    def __init__(self, policy: Policy, **kwargs: Any) -> None:
        super().__init__(policy, transport=GrpcAioTransport, transport_name="grpc", **kwargs)


def sidecar_on(transport: str) -> type[Sidecar]:
    """The ``Sidecar`` class for the transport named in ``TRANSPORTS``: the product's
    (``h2``, ``Sidecar``'s default) or this oracle (``grpc``)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
    return Sidecar if transport == "h2" else GrpcAioSidecar


def serve_argv(transport: str = "h2") -> list[str]:
    """The command that runs ``llm-extproc serve`` on the transport named: its flags go after
    it. ``h2``: the product's CLI (``python -m extproc serve``); ``grpc``: the same CLI with the
    sidecar on this oracle (``python -m testing.grpc_sidecar``, run from the repository)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
    if transport == "h2":
        return [sys.executable, "-m", "extproc", "serve"]
    return [sys.executable, "-m", "testing.grpc_sidecar"]
