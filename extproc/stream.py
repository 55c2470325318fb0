"""What the servicer does with Envoy's ext_proc stream, apart from deciding.

The servicer needs two things of a stream, ``await read()`` and ``await write(msg)``
(``Stream``): grpc.aio's context and ``extproc.transport.h2.Call`` both have them. ``read``
returns ``EOF`` once Envoy half-closed the stream. Here: the request's headers as a dict, the
body gathered from its message(s), what a request's stream holds (``State``), and the hold
loop that keeps a stream (and whatever it holds) until Envoy ends it, answering anything else
Envoy sends with a plain CONTINUE.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.pool.gate import Slot, Waiter
from extproc.pool.shares import Share
from extproc.record import RequestRecord
from extproc.request import respond
from extproc.request.deadline import NO_DEADLINE

__all__ = ["EOF", "State", "Stream", "headers_of", "hold", "read_body"]

EOF = grpc.aio.EOF


class Stream(Protocol):
    """One ext_proc stream, as the servicer sees it."""

    async def read(self) -> Any: ...

    async def write(self, message: Any) -> None: ...


class State:
    """What one request's stream holds, for the servicer's ``finally``: its slot (and its
    route share's), or its place in a queue, and its record."""

    __slots__ = (
        "answer_by",
        "deadline",
        "overridden",
        "rec",
        "shadow_task",
        "share",
        "share_slot",
        "slot",
        "waiter",
    )

    def __init__(self, rec: RequestRecord) -> None:
        self.rec = rec
        self.slot: Slot | None = None
        self.share: Share | None = None  # the route's share of its bucket, when it has one
        self.share_slot: Slot | None = None
        self.waiter: Waiter | None = None
        self.overridden = False  # Envoy's message timeout was extended (once per message)
        self.answer_by: float | None = None  # loop time by which Envoy expects our answer
        # When the client (or an Envoy in front, or the route) stops waiting.
        self.deadline = NO_DEADLINE
        self.shadow_task: asyncio.Task[None] | None = None


def headers_of(msg: pb.HttpHeaders) -> dict[str, str]:
    """Envoy's headers message as {lower-case name: value} (values arrive as raw bytes)."""
    out: dict[str, str] = {}
    for h in msg.headers.headers:
        out[h.key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


async def read_body(stream: Stream) -> bytes | None:
    """The request body, or None if the stream ended before it was complete."""
    chunks: list[bytes] = []
    while True:
        msg = await stream.read()
        if msg is EOF:
            return None
        if msg.WhichOneof("request") != "request_body":
            # Not expected with BUFFERED bodies; answer and keep waiting for the body.
            await stream.write(respond.continue_for(msg))
            continue
        chunks.append(msg.request_body.body)
        if msg.request_body.end_of_stream:
            return b"".join(chunks)
        # A chunk not marked last (STREAMED mode): acknowledge it and wait for more.
        await stream.write(respond.continue_for(msg))


async def hold(stream: Stream, pending_read: asyncio.Future[Any] | None) -> None:
    """Keep the stream (and any slot) until Envoy ends it; ``pending_read`` is a read already
    started (while the request waited) whose message comes first."""
    while True:
        if pending_read is not None:
            nxt, pending_read = await pending_read, None
        else:
            nxt = await stream.read()
        if nxt is EOF:
            return
        await stream.write(respond.continue_for(nxt))
