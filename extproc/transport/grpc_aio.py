"""``--transport grpc``: the sidecar's services on grpc.aio, kept for comparison.

ext_proc's ``Process`` is registered so that pre-encoded answers (bytes from
``request.respond``) and messages can both be written to the stream; ``grpc.health.v1`` is
grpc_health's own servicer. Its bounds are grpc core's, with a fixed message limit
(``MAX_MESSAGE``; the h2 transport sizes its own from the policy instead). grpc.aio stops
serving after one non-UTF-8 ``:path`` (``tests/e2e/test_grpc_aio_path.py``): never expose it
to anything but Envoy (docs/transport.md).
"""

from __future__ import annotations

import socket

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from grpc_health.v1 import health, health_pb2_grpc

from extproc.contract import EXT_PROC_SERVICE
from extproc.request import respond
from extproc.transport import ServerTransport, Serving, split_host_port

__all__ = ["MAX_MESSAGE", "GrpcAioTransport"]

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
            port = server.add_secure_port(listen, tls.server_credentials())
        else:
            port = server.add_insecure_port(listen)
        if not listen.startswith("unix:") and port == 0:
            raise OSError(f"cannot listen on {listen}")
        await server.start()
        self._server = server
        return None if listen.startswith("unix:") else port


def _probe(listen: str) -> None:
    """Raise the OSError binding ``listen`` (HOST:PORT) gives, if it gives one: grpc.aio's own
    failure is a RuntimeError without the cause, after grpc's core logged it on stderr."""
    host, port = split_host_port(listen)
    if port == 0:
        return
    # create_server sets SO_REUSEADDR, as grpc does: a port in TIME_WAIT is not taken.
    socket.create_server((host, port)).close()
