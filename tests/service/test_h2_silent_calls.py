"""Calls that hold a connection's place without being Envoy's (issue 31).

Finding: at ``max_connections`` a newcomer displaces a connection without an open call, so a
peer that opened 256 connections and started one call on each (HEADERS for ext_proc's
``Process`` and no message, or a ``grpc.health.v1`` ``Watch``, which stays open as long as its
client likes) left nothing to displace, and Envoy's new connection was refused. Envoy's
``Process`` calls send their first message (request_headers) with their HEADERS, and Envoy
never watches health (it uses ``Check``, unary). Now only a call whose first message arrived,
of a method that keeps its connection (not ``Watch``), keeps its connection in place.

Two tiers: the sans-IO connection alone (``use_mark``, what ``idle.IdleOrder`` reads; no event
loop, no sockets), then 256 such connections against a real ``H2Server`` with the sidecar's
health service, and an honest client's call.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from grpc_health.v1 import health_pb2

from extproc.contract import PROCESS_METHOD
from extproc.transport import h2
from extproc.transport.h2 import H2Server, Method
from extproc.transport.h2.frames import DATA, END_HEADERS, END_STREAM, HEADERS, RST_STREAM
from extproc.transport.h2.headers import OK_TRAILERS
from extproc.transport.health import H2Health
from tests.service.h2_peer import (
    Honest,
    RawPeer,
    Test,
    displaced,
    frame,
    grpc_msg,
    honest_exchanges,
    methods,
    request_block,
    settle,
    stranger,
    told_nothing,
)
from tests.service.h2_sansio import METHODS, Raw, goaway_of

SINK = request_block("/t.T/Sink")
WATCH_PATH = "/grpc.health.v1.Health/Watch"
WATCH = request_block(WATCH_PATH)
PROCESS = request_block(PROCESS_METHOD)
NO_ERROR = 0x0


# --- the sans-IO connection: what keeps a connection in place ---------------------------------


def watch_raw() -> Raw:
    """A connection whose methods include one like health Watch (keeps no connection)."""
    raw = Raw()
    raw.conn.methods = {
        **METHODS,
        WATCH_PATH.encode(): Method(
            METHODS[b"/t.T/Sink"].handler, bytes, bytes, keeps_connection=False
        ),
    }
    return raw


# Steps: "open SID [watch]" HEADERS for a new stream (Sink, or the Watch-like method);
# "part SID" the first 3 bytes of a 10-byte message; "rest SID" its other 8 bytes;
# "msg SID" a whole message; "read SID" the method reads a message; "end SID" the client
# resets the stream. After each step the expected mark: None (kept in place) or a number
# (the highest stream opened: displaceable).
MARKS: dict[str, list[tuple[str, int | None]]] = {
    "a-silent-call-keeps-nothing": [("open 1", 1), ("open 3", 3)],
    "the-first-message-keeps-it": [("open 1", 1), ("msg 1", None), ("end 1", 1)],
    "a-read-message-keeps-it": [("open 1", 1), ("msg 1", None), ("read 1", None)],
    "an-incomplete-message-is-not-yet-a-message": [
        ("open 1", 1),
        ("part 1", 1),
        ("rest 1", None),
    ],
    "one-call-with-a-message-is-enough": [
        ("open 1", 1),
        ("open 3", 3),
        ("msg 3", None),
        ("end 1", None),
        ("end 3", 3),
    ],
    "a-watch-never-keeps-it": [("open 1 watch", 1), ("msg 1", 1), ("msg 1", 1)],
    "a-watch-beside-a-kept-call": [
        ("open 1 watch", 1),
        ("msg 1", 1),
        ("open 3", 3),
        ("msg 3", None),
        ("end 3", 3),
    ],
}


@pytest.mark.parametrize("steps", MARKS.values(), ids=MARKS.keys())
def test_only_a_call_whose_first_message_arrived_keeps_its_connection(
    steps: list[tuple[str, int | None]],
) -> None:
    raw = watch_raw()
    message = grpc_msg(b"x" * 5)
    assert raw.conn.use_mark() == 0
    for i, (step, mark) in enumerate(steps):
        what, sid_text, *watch = step.split()
        sid = int(sid_text)
        if what == "open":
            raw.send(frame(HEADERS, END_HEADERS, sid, WATCH if watch else SINK))
            assert raw.take_events() == [("start", sid)]
        elif what == "part":
            raw.send(frame(DATA, 0, sid, message[:3]))
        elif what == "rest":
            raw.send(frame(DATA, 0, sid, message[3:]))
        elif what == "msg":
            raw.send(frame(DATA, 0, sid, message))
        elif what == "read":
            assert raw.conn.calls[sid].take() == b"x" * 5
        else:
            assert what == "end"
            raw.send(frame(RST_STREAM, 0, sid, b"\0\0\0\0"))
        assert raw.conn.use_mark() == mark, f"step {i}: {step}"


def test_a_displaced_connection_ends_the_calls_it_still_had() -> None:
    """A connection displaced with a silent call (or a watch) open: the final GOAWAY, its
    calls' methods cancelled, and the close."""
    raw = watch_raw()
    raw.send(frame(HEADERS, END_HEADERS, 1, SINK) + frame(HEADERS, END_HEADERS, 3, WATCH))
    raw.send(frame(DATA, 0, 3, grpc_msg(b"")))
    raw.take_events()
    raw.read()
    assert raw.conn.use_mark() == 3
    raw.conn.displace()
    assert goaway_of(raw.read()) == (3, NO_ERROR, b"too many connections")
    assert raw.take_events() == [("cancel", 1), ("cancel", 3), ("close", 0.0)]
    assert raw.counters.displaced == 1


def test_checking_for_the_first_message_stops_once_it_arrived() -> None:
    """Nothing is looked at per frame once a call has its first message: the call says it
    keeps its connection, and its later DATA frames do not change the count."""
    raw = Raw()
    raw.send(frame(HEADERS, END_HEADERS, 1, SINK) + frame(DATA, 0, 1, grpc_msg(b"a")))
    call = raw.conn.calls[1]
    assert (call.first_due, call.keeps_place, raw.conn.keeping) == (False, True, 1)
    raw.send(frame(DATA, 0, 1, grpc_msg(b"b")) + frame(DATA, END_STREAM, 1, grpc_msg(b"c")))
    assert raw.conn.keeping == 1
    raw.conn.complete(call, OK_TRAILERS)
    assert raw.conn.keeping == 0 and raw.conn.use_mark() == 1


# --- a real server: 256 connections, each holding one call that is not Envoy's ----------------


async def wait_first(call: h2.Call) -> None:
    """Like the sidecar's ``Process``: waits for the stream's first message, as long as the
    stream lives, then holds the call."""
    if await call.read() is not h2.EOF:
        await asyncio.sleep(30)


def sidecar_like_methods() -> dict[str, Method]:
    return {
        **methods(),
        PROCESS_METHOD: Method(wait_first, bytes, bytes),
        **H2Health().methods(),
    }


def serve(test: Test, **limits: Any) -> None:
    """``h2_peer.serve`` with the sidecar's method paths: ``Process`` and the health service."""

    async def main() -> None:
        server = H2Server(sidecar_like_methods(), **{"max_message": 64 * 1024, **limits})
        port = await server.listen("127.0.0.1", 0)
        try:
            await asyncio.wait_for(test(server, port), 30)
        finally:
            await server.stop(0)

    asyncio.run(main())


def hold_a_call(port: int, how: str) -> RawPeer:
    """A stranger that starts one call and sends nothing more: ``process``, HEADERS for
    ext_proc's Process and no message; ``watch``, a health Watch (its request, and the
    stream left open)."""
    peer = stranger(port)
    if how == "process":
        peer.send(frame(HEADERS, END_HEADERS, 1, PROCESS))
    else:
        request = health_pb2.HealthCheckRequest(service="").SerializeToString()
        peer.send(frame(HEADERS, END_HEADERS, 1, WATCH) + frame(DATA, 0, 1, grpc_msg(request)))
    return peer


@pytest.mark.parametrize("how", ["process", "watch"])
def test_calls_that_are_not_envoys_give_way_to_an_honest_newcomer(how: str) -> None:
    """256 connections (all of max_connections), each with one call open that Envoy would
    not make: an honest client's new connection displaces the oldest of them, and its calls
    are answered. Before, every one of them had an open call, and the honest connection was
    closed at once (refused_connections)."""

    async def t(server: H2Server, port: int) -> None:
        limit = server.limits.max_connections
        assert limit == 256
        holders = await asyncio.to_thread(lambda: [hold_a_call(port, how) for _ in range(limit)])
        assert await settle(server, lambda s: s.statistics().calls == limit, within=10)
        await honest_exchanges(port)
        s = server.statistics()
        assert (s.displaced_connections, s.refused_connections) == (1, 0)
        assert await asyncio.to_thread(displaced, holders[0])
        # The others keep their places (a watch may have been sent its status meanwhile).
        if how == "process":
            assert told_nothing(holders[1:])
        assert s.calls == limit - 1
        for p in holders:
            p.close()
        assert await settle(server, lambda s: s.statistics().connections == 0)

    serve(t)


def test_calls_with_a_first_message_keep_their_places() -> None:
    """Connections whose calls sent their first message, as Envoy's do, are never displaced;
    beside them, those holding only a silent call or a watch give way, oldest first, and
    then the honest connections without a call, least recently used first."""

    async def t(server: H2Server, port: int) -> None:
        envoys = [await asyncio.to_thread(stranger, port) for _ in range(2)]
        for envoy in envoys:
            envoy.send(
                frame(HEADERS, END_HEADERS, 1, PROCESS) + frame(DATA, 0, 1, grpc_msg(b"headers"))
            )
        silent = await asyncio.to_thread(
            lambda: [hold_a_call(port, how) for how in ("process", "watch", "process")]
        )
        assert await settle(server, lambda s: s.statistics().calls == 5)
        honest = []
        for holder in silent:
            honest.append(await Honest.connect(port))
            await honest[-1].exchange()
            assert await asyncio.to_thread(displaced, holder)
        assert told_nothing(envoys)
        s = server.statistics()
        assert (s.connections, s.calls, s.displaced_connections) == (5, 2, 3)
        late = await Honest.connect(port)  # takes the place of the first honest connection
        await late.exchange()
        with pytest.raises(AssertionError, match="closed the honest connection"):
            await honest[0].exchange()
        for client in honest[1:]:
            await client.exchange()
        assert told_nothing(envoys)
        s = server.statistics()
        assert (s.connections, s.calls, s.displaced_connections) == (5, 2, 4)
        for client in [*honest, late]:
            client.close()
        for p in envoys:
            p.close()

    serve(t, max_connections=5)
