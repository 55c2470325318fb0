"""The naive ext_proc server ``bench.overhead`` compares the sidecar with.

What a first attempt at an Envoy external processor in grpc.aio looks like, and nothing more:
the servicer method is an async generator over the request iterator (the idiom grpc's own
examples use); it answers ``request_headers`` with CONTINUE, parses the buffered JSON body with
``json.loads`` and answers ``request_body`` with CONTINUE, and CONTINUEs anything else until
Envoy ends the stream. No policy, no queue, no metrics, no mutation.

It is a yardstick, not a product: the sidecar must cost no more per request than this does.
(The same answers through ``context.read()``/``context.write()`` were no slower:
docs/performance.md, "Tried and ruled out".)

``python -m bench.overhead.naive --listen 127.0.0.1:50052``
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

__all__ = ["NaiveExtProc", "main", "serve"]


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


async def serve(listen: str) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_ExternalProcessorServicer_to_server(NaiveExtProc(), server)
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
    args = parser.parse_args(argv)
    asyncio.run(serve(args.listen))


if __name__ == "__main__":
    main()
