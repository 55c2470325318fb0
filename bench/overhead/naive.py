"""The naive ext_proc server ``bench.overhead`` compares the sidecar with.

What a first attempt at an Envoy external processor in grpc.aio looks like, and nothing more:
the servicer method is an async generator over the request iterator (the idiom grpc's own
examples use); it answers ``request_headers`` with CONTINUE, parses the buffered JSON body with
``json.loads`` and answers ``request_body`` with CONTINUE, and CONTINUEs anything else until
Envoy ends the stream. No policy, no queue, no metrics, no mutation.

It is a yardstick, not a product: the sidecar must cost no more per request than this does.
``--style read-write`` gives the same answers through ``context.read()``/``context.write()``,
the idiom the sidecar's grpc transport (extproc/service.py) uses.

``python -m bench.overhead.naive --listen 127.0.0.1:50052 [--style generator|read-write]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

__all__ = ["NaiveExtProc", "NaiveExtProcReadWrite", "main", "serve"]


class NaiveExtProc(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for msg in request_iterator:
            kind = msg.WhichOneof("request")
            if kind == "request_headers":
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            elif kind == "request_body":
                if msg.request_body.body:
                    json.loads(msg.request_body.body)
                yield pb.ProcessingResponse(request_body=pb.BodyResponse())
            elif kind == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            elif kind == "response_body":
                yield pb.ProcessingResponse(response_body=pb.BodyResponse())
            else:
                yield pb.ProcessingResponse()


class NaiveExtProcReadWrite(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The same answers with the other grpc.aio idiom, ``context.read()`` / ``context.write()``
    (the one extproc/service.py uses), to tell the cost of the idiom from the cost of the work."""

    async def Process(self, request_iterator: object, context: Any) -> None:
        while (msg := await context.read()) is not grpc.aio.EOF:
            kind = msg.WhichOneof("request")
            if kind == "request_headers":
                await context.write(_HEADERS_CONTINUE)
            elif kind == "request_body":
                if msg.request_body.body:
                    json.loads(msg.request_body.body)
                await context.write(_BODY_CONTINUE)
            else:
                await context.write(pb.ProcessingResponse())


_HEADERS_CONTINUE = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_BODY_CONTINUE = pb.ProcessingResponse(request_body=pb.BodyResponse())
STYLES = {"generator": NaiveExtProc, "read-write": NaiveExtProcReadWrite}


async def serve(listen: str, style: str = "generator") -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_ExternalProcessorServicer_to_server(STYLES[style](), server)
    if server.add_insecure_port(listen) == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead.naive", description=__doc__)
    parser.add_argument("--listen", default="127.0.0.1:50052", help="gRPC HOST:PORT")
    parser.add_argument(
        "--style",
        choices=sorted(STYLES),
        default="generator",
        help="grpc.aio idiom: an async generator (default) or context.read()/write()",
    )
    args = parser.parse_args(argv)
    asyncio.run(serve(args.listen, args.style))


if __name__ == "__main__":
    main()
