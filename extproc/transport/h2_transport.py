"""The sidecar's transport: its services on this project's HTTP/2 server.

ext_proc's ``Process`` and ``grpc.health.v1`` (``health.H2Health``) are methods of one
``h2.H2Server``. Its bounds come from the policy through ``Serving``: a message is at
most the largest body Envoy forwards plus room for the ProcessingRequest around it
(``MESSAGE_MARGIN``), at least ``MIN_MESSAGE``; the streams per connection are what Envoy's
circuit breakers let it open. The rest take ``H2Server``'s defaults (docs/transport.md).
"""

from __future__ import annotations

from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb

from extproc.contract import PROCESS_METHOD
from extproc.request import respond
from extproc.transport import ServerTransport, Serving, h2, split_host_port
from extproc.transport.health import H2Health

__all__ = ["MESSAGE_MARGIN", "MIN_MESSAGE", "H2Transport"]

MIN_MESSAGE = 8 * 1024 * 1024
MESSAGE_MARGIN = 1024 * 1024


class H2Transport(ServerTransport):
    """The h2 server serving ext_proc and grpc.health.v1 (``extproc.transport.Transport``)."""

    def __init__(self) -> None:
        super().__init__()
        self.health = H2Health()

    async def start(self, serving: Serving) -> int | None:
        process = serving.process

        def on_call(call: h2.Call) -> Any:
            return process(None, call)

        parse = ext_pb.ProcessingRequest.FromString
        methods = {PROCESS_METHOD: h2.Method(on_call, parse, respond.serialize)}
        methods.update(self.health.methods())
        # Looked up at start, not import: tests replace h2.H2Server to shorten its timeouts.
        server = h2.H2Server(
            methods,
            max_message=max(MIN_MESSAGE, serving.body_limit + MESSAGE_MARGIN),
            max_streams=serving.max_streams,
        )
        ctx = serving.tls.ssl_context() if serving.tls is not None else None
        listen = serving.listen
        port: int | None = None
        if listen.startswith("unix:"):
            path = listen.removeprefix("unix:")
            await server.listen_unix(path.removeprefix("//"), ctx)
        else:
            host, tcp_port = split_host_port(listen)
            port = await server.listen(host, tcp_port, ctx)
        self._server = server
        return port
