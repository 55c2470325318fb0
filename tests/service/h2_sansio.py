"""Drivers for the h2 transport's sans-IO connection: no event loop, no sockets.

``Recorder`` is the connection's host: it keeps the bytes the connection writes and, in order,
what it asks for (a call started, cancelled or failing soon; the transport closed or
aborted). ``Raw`` is our ``Connection`` with a raw peer (bytes in as given, frames out
parsed); ``Peer`` adds python-hyper's ``h2`` client state machine, which makes valid frames and
checks ours. The time is ``now``, a number the test moves. The method is the test itself:
``take`` reads a call's messages, ``Connection.send_message`` and ``Connection.complete``
answer. ``echo`` plays an echo method over every open call, and ``held`` checks the
connection's bounds and the receive-window invariant.
"""

from __future__ import annotations

from typing import Any

import h2.config
import h2.connection
import h2.events

from extproc.transport.h2 import EOF, Call, CallAbort, Connection, H2Limits, Method
from extproc.transport.h2.frames import GOAWAY, PREFACE, SETTINGS, U32, frame
from extproc.transport.h2.headers import OK_TRAILERS, status_block
from extproc.transport.h2.limits import HEADER_CACHE_BYTES, Counters
from tests.service.h2_peer import Frame, parse_frames, request_headers

MAX_MESSAGE = 64 * 1024


async def _not_run(call: Call) -> None:
    raise AssertionError("no method runs without an event loop")


PATHS = ("/t.T/Echo", "/t.T/Sink", "/t.T/Fail")
METHODS = {path.encode(): Method(_not_run, bytes, bytes) for path in PATHS}


class Recorder:
    """The connection's host, recorded."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.wire = bytearray()
        self.ended = 0

    def start(self, call: Call, method: Method) -> None:
        self.events.append(("start", call.id))

    def fail_soon(self, call: Call) -> None:
        self.events.append(("fail_soon", call.id))

    def cancel(self, call: Call) -> None:
        self.events.append(("cancel", call.id))

    def write(self, data: bytes) -> None:
        self.wire += data

    def close(self, delay: float) -> None:
        self.events.append(("close", delay))

    def abort(self) -> None:
        self.events.append(("abort",))

    def call_ended(self) -> None:
        self.ended += 1


class Raw:
    """Our connection and a raw peer. ``options``: ``H2Server``'s parameters."""

    def __init__(self, *, handshake: bool = True, **options: Any) -> None:
        self.now = 0.0
        self.host = Recorder()
        self.counters = Counters()
        self.limits = H2Limits.resolve(
            max_message=options.pop("max_message", MAX_MESSAGE), **options
        )
        self.conn = Connection(self.host, METHODS, self.limits, self.counters, self.now)
        self.conn.initiate()
        self.announced = self.read()  # our SETTINGS and connection WINDOW_UPDATE
        if handshake:
            self.send(PREFACE + frame(SETTINGS, 0, 0))
            assert self.read() == [(SETTINGS, 1, 0, b"")]

    def send(self, data: bytes) -> bool:
        """Feed bytes in; returns ``receive_data``'s answer (bytes left for the next turn)."""
        return self.conn.receive_data(data, self.now)

    def read(self) -> list[Frame]:
        """The frames written since the last read."""
        frames, rest = parse_frames(bytes(self.host.wire))
        assert rest == b""
        self.host.wire.clear()
        return frames

    def take_events(self) -> list[tuple[Any, ...]]:
        events, self.host.events = self.host.events, []
        return events


def goaway_of(frames: list[Frame]) -> tuple[int, int, bytes] | None:
    """(last stream, error code, debug data) of the first GOAWAY."""
    for ftype, _flags, _sid, payload in frames:
        if ftype == GOAWAY:
            return U32.unpack(payload[:4])[0], U32.unpack(payload[4:8])[0], payload[8:]
    return None


class Peer(Raw):
    """Our connection and python-hyper's client: it refuses any frame that breaks the
    protocol. ``pump`` moves bytes both ways until both are quiet."""

    def __init__(self, **options: Any) -> None:
        super().__init__(handshake=False, **options)
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        self.h2.initiate_connection()
        self.h2.receive_data(frame(SETTINGS, 0, 0, self.announced[0][3]))
        self.events: list[h2.events.Event] = []
        self.pump()

    def pump(self) -> list[h2.events.Event]:
        new: list[h2.events.Event] = []
        for _ in range(100):
            out = self.h2.data_to_send()
            if out:
                self.send(out)
            wire = bytes(self.host.wire)
            self.host.wire.clear()
            if not out and not wire:
                break
            # One frame at a time: h2 applies a new SETTINGS_MAX_FRAME_SIZE only between calls.
            pos = 0
            while pos < len(wire):
                end = pos + 9 + int.from_bytes(wire[pos : pos + 3], "big")
                for event in self.h2.receive_data(wire[pos:end]):
                    if isinstance(event, h2.events.DataReceived):
                        self.h2.acknowledge_received_data(
                            event.flow_controlled_length, event.stream_id
                        )
                    new.append(event)
                pos = end
        self.events += new
        return new

    def open(self, path: str = "/t.T/Echo", *, end_stream: bool = False) -> int:
        sid: int = self.h2.get_next_available_stream_id()
        self.h2.send_headers(sid, request_headers(path), end_stream=end_stream)
        return sid

    def answer_of(self, sid: int) -> tuple[dict[str, str], bytes, dict[str, str]]:
        """Headers, data and trailers (or the trailers-only answer) the client got on a
        stream."""
        headers: dict[str, str] = {}
        trailers: dict[str, str] = {}
        data = b""
        for e in self.events:
            if getattr(e, "stream_id", None) != sid:
                continue
            if isinstance(e, h2.events.ResponseReceived):
                headers = dict(e.headers)
            elif isinstance(e, h2.events.DataReceived):
                data += e.data
            elif isinstance(e, h2.events.TrailersReceived):
                trailers = dict(e.headers)
        if "grpc-status" in headers:  # trailers-only
            trailers = headers
        return headers, data, trailers


def echo(conn: Connection, pending_failures: list[Call]) -> None:
    """One turn of an echo method on every open call: answer each message read, end the call
    at EOF (OK) or at a bad message (its status). Calls whose failure was deferred by one turn
    (``fail_soon``) are failed first, as the event loop would."""
    for call in pending_failures:
        conn.fail_due(call)
    pending_failures.clear()
    for call in list(conn.calls.values()):
        if call.reset or call.closed:
            continue
        try:
            while (msg := call.take()) is not None:
                if msg is EOF:
                    conn.complete(call, OK_TRAILERS)
                    break
                conn.send_message(call, msg)
                if conn.closed:
                    return
        except CallAbort as e:
            conn.complete(call, status_block(e.code, e.message))


def held(conn: Connection) -> dict[str, int]:
    """What the connection holds, checked against its bounds and the receive invariant
    (``recv_window + credit + buffered == connection_window`` once the handshake opened it)."""
    limits = conn.limits
    assert 0 <= conn.buffered <= limits.connection_window
    assert 0 <= conn.queued_out <= limits.send_queue or conn.closed
    assert conn.header_cache_bytes <= HEADER_CACHE_BYTES
    assert sum(call.held for call in conn.calls.values()) == conn.buffered
    if not conn.closed:
        total = conn.inbound.window + conn.inbound.credit + conn.buffered
        assert total == limits.connection_window, (total, limits.connection_window)
    return {"calls": len(conn.calls), "buffered": conn.buffered, "queued": conn.queued_out}
