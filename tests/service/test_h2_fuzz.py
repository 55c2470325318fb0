"""Differential fuzzing of the h2 transport against grpc.aio.

hypothesis draws a scenario: a few gRPC streams (an echo method, a method that fails on a
given message, an unknown method), each with messages split into DATA frames at random
points, with padding, half-closed, reset or left open, interleaved at random with PINGs,
SETTINGS changes (initial window, frame size) and WINDOW_UPDATEs; then, sometimes, a tail of
hostile frames (random types, flags, streams and payloads, declared lengths that lie,
oversize frames). python-hyper's ``h2`` state machine (``H2Connection``, client side) turns the
valid part into frames and checks every frame the servers send (frame sizes included).

The valid part runs against both servers, our ``H2Server`` and a grpc.aio server with the
same methods, and each stream the client did not reset must end the same way on both: the
same gRPC status and the same messages, in order. The hostile tail runs against ours only.
For every example, ours must finish within a bounded time (no hang), stay within its bounds
(buffered bytes within the connection window, queued bytes within ``send_queue``, header
cache within 64 KiB, sampled every millisecond), and hold nothing once the client is gone.
Both servers run on one event loop in a background thread; the client drives blocking
sockets from the test thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.transport import h2 as transport
from extproc.transport.h2 import Call
from extproc.transport.h2.headers import OK_TRAILERS, status_block
from extproc.transport.h2.limits import HEADER_CACHE_BYTES
from tests.service.h2_peer import frame, parse_frames
from tests.service.h2_sansio import Raw, goaway_of, held

MAX_MESSAGE = 64 * 1024
EXAMPLE_DEADLINE_S = 5.0
ECHO, FAIL, NOPE = "/t.T/Echo", "/t.T/Fail", "/t.T/Nope"


# --- the servers -----------------------------------------------------------------------------


async def _echo_h2(call: transport.Call) -> None:
    while (msg := await call.read()) is not transport.EOF:
        await call.write(msg)


async def _fail_h2(call: transport.Call) -> None:
    while (msg := await call.read()) is not transport.EOF:
        if msg == b"fail":
            raise transport.CallAbort(grpc.StatusCode.INVALID_ARGUMENT, "bad")
        await call.write(msg)


async def _echo_aio(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for msg in requests:
        yield msg


async def _fail_aio(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for msg in requests:
        if msg == b"fail":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad")
        yield msg


@dataclass
class Servers:
    loop: asyncio.AbstractEventLoop
    ours: transport.H2Server
    ours_port: int
    aio_port: int
    peaks: dict[str, int] = field(default_factory=dict)

    def call(self, coro: Any, timeout: float = 5.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stats(self) -> transport.H2Stats:
        async def get() -> transport.H2Stats:
            return self.ours.statistics()

        return self.call(get())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    loop = asyncio.new_event_loop()
    ready: dict[str, Any] = {}
    started = threading.Event()
    stop = asyncio.Event()

    async def main() -> None:
        ours = transport.H2Server(
            {
                ECHO: transport.Method(_echo_h2, bytes, bytes),
                FAIL: transport.Method(_fail_h2, bytes, bytes),
            },
            max_message=MAX_MESSAGE,
        )
        ours_port = await ours.listen("127.0.0.1", 0)
        aio = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE),
                ("grpc.max_send_message_length", MAX_MESSAGE),
                # grpc core's own policy ends a connection after two PINGs without data
                # ("ping strikes"): a policy of grpc.aio, not of the protocol.
                ("grpc.http2.max_ping_strikes", 0),
            ]
        )
        aio.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "t.T",
                    {
                        "Echo": grpc.stream_stream_rpc_method_handler(_echo_aio),
                        "Fail": grpc.stream_stream_rpc_method_handler(_fail_aio),
                    },
                ),
            )
        )
        aio_port = aio.add_insecure_port("127.0.0.1:0")
        await aio.start()
        s = Servers(loop, ours, ours_port, aio_port)
        ready["servers"] = s

        async def sample() -> None:  # the peaks of what ours holds, every millisecond
            while True:
                st_ = ours.statistics()
                for name in ("buffered_bytes", "queued_out_bytes", "header_cache_bytes"):
                    s.peaks[name] = max(s.peaks.get(name, 0), getattr(st_, name))
                await asyncio.sleep(0.001)

        sampler = asyncio.ensure_future(sample())
        started.set()
        await stop.wait()
        sampler.cancel()
        await ours.stop(0)
        await aio.stop(0)

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    assert started.wait(10)
    yield ready["servers"]
    loop.call_soon_threadsafe(stop.set)
    thread.join(10)
    assert not thread.is_alive()


# --- scenarios -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Stream:
    path: str
    messages: tuple[bytes, ...]
    cuts: tuple[int, ...]  # where the concatenated gRPC messages are split into DATA frames
    pads: tuple[int, ...]  # padding of each DATA frame (0: none)
    ending: str  # "half-close", "reset" or "open" (half-closed once everything else is done)


def _grpc(messages: tuple[bytes, ...]) -> bytes:
    return b"".join(struct.pack(">BL", 0, len(m)) + m for m in messages)


message = st.one_of(
    st.binary(max_size=64),
    st.just(b"fail"),
    st.integers(0, 70_000).map(lambda n: b"z" * n),  # up to past MAX_MESSAGE
)


@st.composite
def streams(draw: st.DrawFn) -> Stream:
    path = draw(st.sampled_from([ECHO, ECHO, ECHO, FAIL, NOPE]))
    messages = tuple(draw(st.lists(message, max_size=4)))
    size = len(_grpc(messages))
    cuts = (
        tuple(sorted(draw(st.sets(st.integers(1, max(1, size - 1)), max_size=6))))
        if size > 1
        else ()
    )
    pads = tuple(draw(st.lists(st.integers(0, 40), min_size=len(cuts) + 1, max_size=len(cuts) + 1)))
    ending = draw(st.sampled_from(["half-close", "half-close", "reset", "open"]))
    return Stream(path=path, messages=messages, cuts=cuts, pads=pads, ending=ending)


connection_op = st.one_of(
    st.tuples(st.just("ping"), st.binary(min_size=8, max_size=8)),
    st.tuples(st.just("initial_window"), st.sampled_from([0, 100, 1000, 16_384, 65_535, 1 << 20])),
    st.tuples(st.just("max_frame"), st.sampled_from([16_384, 20_000, 1 << 20])),
    st.tuples(st.just("window"), st.integers(1, 1 << 16)),
)

hostile_frame = st.one_of(
    st.tuples(
        st.integers(0, 12),  # frame type (10-12: unknown)
        st.integers(0, 255),  # flags
        st.sampled_from([0, 1, 2, 3, 5, 101, 2**31 - 1]),  # stream
        st.binary(max_size=48),
        st.sampled_from([None, None, None, 0, 5, 20_000, (1 << 20) + 1]),  # declared length
    ),
    st.tuples(st.just(-1), st.just(0), st.just(0), st.binary(min_size=1, max_size=64), st.none()),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    streams: tuple[Stream, ...]
    order: tuple[int, ...]  # which stream takes its next step, in turn (connection ops: -1)
    connection_ops: tuple[tuple[str, Any], ...]
    hostile: tuple[tuple[int, int, int, bytes, int | None], ...]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    ss = tuple(draw(st.lists(streams(), min_size=1, max_size=4)))
    steps: list[int] = []
    for i, s in enumerate(ss):
        steps += [i] * (len(s.cuts) + 3)  # headers, each DATA frame, the ending
    ops = tuple(draw(st.lists(connection_op, max_size=5)))
    steps += [-1] * len(ops)
    order = tuple(draw(st.permutations(steps)))
    hostile = tuple(draw(st.one_of(st.just([]), st.lists(hostile_frame, min_size=1, max_size=8))))
    return Scenario(streams=ss, order=order, connection_ops=ops, hostile=hostile)


# --- the client ------------------------------------------------------------------------------


@dataclass
class Outcome:
    status: str | None = None
    message: str | None = None
    data: bytes = b""
    reset: int | None = None

    def messages(self) -> list[bytes]:
        out, pos = [], 0
        while len(self.data) - pos >= 5:
            n = struct.unpack_from(">L", self.data, pos + 1)[0]
            out.append(self.data[pos + 5 : pos + 5 + n])
            pos += 5 + n
        return out


class Client:
    """One connection driven by ``h2.connection.H2Connection``: it refuses any frame that
    breaks the protocol, and here any frame larger than the SETTINGS_MAX_FRAME_SIZE it
    announced."""

    def __init__(self, port: int, deadline: float, *, padding: bool = True) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=2)
        self.start(deadline, padding)

    def start(self, deadline: float, padding: bool) -> None:
        """The client's state machine, and its preface out."""
        self.deadline = deadline
        self.padding = padding
        config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        self.conn = h2.connection.H2Connection(config)
        self.conn.initiate_connection()
        self.outcomes: dict[int, Outcome] = {}
        self._rest = b""
        # h2's Settings.acknowledge() applies the oldest pending value of every setting at
        # each ACK, whichever SETTINGS frame the ACK is for: with two frames in flight it
        # applies the second too early (and then refuses DATA the server rightly sent). So
        # this client has one SETTINGS frame unacknowledged at most.
        self.settings_unacked = 1  # initiate_connection's
        self.done: set[int] = set()
        self.terminated = False
        self.flush()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def pump(self, wait: float) -> None:
        """Read what the server sent (for up to ``wait`` seconds) and handle it."""
        if self.terminated:
            return
        self.sock.settimeout(max(0.001, min(wait, self.deadline - time.monotonic())))
        try:
            chunk = self.sock.recv(1 << 20)
        except TimeoutError:
            return
        if not chunk:
            self.terminated = True
            return
        self.receive(chunk)
        self.flush()

    def receive(self, chunk: bytes) -> None:
        """One frame at a time: h2 applies a new SETTINGS_MAX_FRAME_SIZE only between calls
        of receive_data, so a larger frame right behind the ACK, in the same read, would be
        refused though the protocol allows it (RFC 9113 6.5.3)."""
        self._rest += chunk
        while len(self._rest) >= 9:
            end = 9 + int.from_bytes(self._rest[:3], "big")
            if len(self._rest) < end:
                break
            one, self._rest = self._rest[:end], self._rest[end:]
            for event in self.conn.receive_data(one):
                self.on_event(event)

    def on_event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.DataReceived):
            self.outcomes.setdefault(event.stream_id, Outcome()).data += event.data
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
            out = self.outcomes.setdefault(event.stream_id, Outcome())
            headers = dict(event.headers)
            out.status = headers.get("grpc-status", out.status)
            out.message = headers.get("grpc-message", out.message)
        elif isinstance(event, h2.events.StreamEnded):
            self.done.add(event.stream_id)
        elif isinstance(event, h2.events.StreamReset):
            out = self.outcomes.setdefault(event.stream_id, Outcome())
            if event.stream_id not in self.done:
                out.reset = event.error_code
            self.done.add(event.stream_id)
        elif isinstance(event, h2.events.SettingsAcknowledged):
            self.settings_unacked -= 1
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.terminated = True

    def send_data(self, sid: int, data: bytes, pad: int) -> None:
        """Send within the server's windows, waiting for them to open (bounded)."""
        while data:
            if sid in self.done or self.terminated:
                return
            room = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size)
            # Padding counts against the window too (and its length byte): drop it when the
            # window is too small for it, as a real client would.
            padding = pad if pad and room > pad + 1 else 0
            take = min(len(data), room - (padding + 1 if padding else 0))
            if take <= 0:
                assert time.monotonic() < self.deadline, "the server never opened its window"
                self.pump(0.05)
                continue
            self.conn.send_data(sid, data[:take], pad_length=padding or None)
            self.flush()
            data = data[take:]

    def run(self, sc: Scenario, ops_allowed: bool = True) -> dict[int, Outcome]:
        # Stream ids rise in the order streams first appear (RFC 9113 5.1.1).
        first = sorted(range(len(sc.streams)), key=lambda i: sc.order.index(i))
        sids = [0] * len(sc.streams)
        for n, i in enumerate(first):
            sids[i] = 1 + 2 * n
        steps = [0] * len(sc.streams)
        pieces = []
        for s in sc.streams:
            wire = _grpc(s.messages)
            bounds = [0, *s.cuts, len(wire)]
            pieces.append([wire[a:b] for a, b in itertools.pairwise(bounds)])
        ops = iter(sc.connection_ops)
        for who in sc.order:
            if self.terminated:
                break
            if who < 0:
                self.connection_op(next(ops))
                continue
            s, sid, step = sc.streams[who], sids[who], steps[who]
            steps[who] += 1
            try:
                self.stream_step(s, sid, step, pieces[who])
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                pass  # the server ended that stream already: nothing more to send on it
            self.pump(0)
        # Open every window, half-close what is still open, and wait for every answer.
        if not self.terminated:
            self.update_settings(h2.settings.SettingCodes.INITIAL_WINDOW_SIZE, 1 << 20)
            self.conn.increment_flow_control_window(1 << 24)
            for s, sid in zip(sc.streams, sids, strict=True):
                if s.ending == "open" and sid not in self.done:
                    with contextlib.suppress(h2.exceptions.H2Error):
                        self.conn.end_stream(sid)
            self.flush()
        wanted = {sid for s, sid in zip(sc.streams, sids, strict=True) if s.ending != "reset"}
        while not wanted <= self.done and not self.terminated:
            assert time.monotonic() < self.deadline, f"no answer for {wanted - self.done}"
            self.pump(0.05)
        return {sid: self.outcomes.get(sid, Outcome()) for sid in wanted}

    def stream_step(self, s: Stream, sid: int, step: int, pieces: list[bytes]) -> None:
        if step == 0:
            self.conn.send_headers(
                sid,
                [
                    (":method", "POST"),
                    (":scheme", "http"),
                    (":path", s.path),
                    (":authority", "fuzz"),
                    ("content-type", "application/grpc"),
                    ("te", "trailers"),
                ],
            )
            self.flush()
        elif step <= len(pieces):
            self.send_data(sid, pieces[step - 1], s.pads[step - 1] if self.padding else 0)
        elif s.ending == "half-close":
            self.conn.end_stream(sid)
            self.flush()
        elif s.ending == "reset":
            self.conn.reset_stream(sid, 0x8)
            self.flush()

    def update_settings(self, code: h2.settings.SettingCodes, value: int) -> None:
        while self.settings_unacked and not self.terminated:
            assert time.monotonic() < self.deadline, "SETTINGS never acknowledged"
            self.pump(0.05)
        self.conn.update_settings({code: value})
        self.settings_unacked += 1
        self.flush()

    def connection_op(self, op: tuple[str, Any]) -> None:
        kind, value = op
        if kind == "ping":
            self.conn.ping(value)
        elif kind == "initial_window":
            self.update_settings(h2.settings.SettingCodes.INITIAL_WINDOW_SIZE, value)
        elif kind == "max_frame":
            self.update_settings(h2.settings.SettingCodes.MAX_FRAME_SIZE, value)
        else:
            self.conn.increment_flow_control_window(value)
        self.flush()

    def close(self) -> None:
        self.sock.close()


def _hostile_bytes(frames: tuple[tuple[int, int, int, bytes, int | None], ...]) -> bytes:
    out = b""
    for ftype, flags, sid, payload, declared in frames:
        if ftype < 0:
            out += payload  # junk between frames
            continue
        raw = frame(ftype, flags, sid, payload)
        if declared is not None:  # a length that lies: shorter, longer, or oversize
            raw = struct.pack(">BH", declared >> 16, declared & 0xFFFF) + raw[3:]
            if len(payload) < declared <= 20_000:
                raw += bytes(declared - len(payload))
        out += raw
    return out


def _answers_or_closes(sock: socket.socket) -> str:
    """After the hostile tail the server must either close the connection or still answer
    a PING. It may rightly be waiting for the rest of a frame whose length header came in
    the junk: then a megabyte of zeros completes any frame and must end the connection."""
    ping = frame(6, 0, 0, b"fuzzping")
    for filler, wait in ((b"", 1.0), (bytes((1 << 20) + 64), 2.0)):
        try:
            sock.sendall(filler + ping)
        except OSError:
            return "closed"
        deadline = time.monotonic() + wait
        buf = b""
        while time.monotonic() < deadline:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                chunk = sock.recv(1 << 20)
            except TimeoutError:
                break
            except OSError:
                return "closed"
            if not chunk:
                return "closed"
            buf += chunk
            if frame(6, 1, 0, b"fuzzping") in buf:
                return "answers"
    return "silent"


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(sc=scenarios())
def test_h2_answers_as_grpc_aio_does_and_stays_bounded(servers: Servers, sc: Scenario) -> None:
    servers.peaks.clear()
    start = time.monotonic()
    # grpc core resets a stream that sends a padded DATA frame (PROTOCOL_ERROR, seen with
    # grpcio 1.85), though RFC 9113 allows padding: the reference gets the frames unpadded.
    reference = Client(servers.aio_port, start + EXAMPLE_DEADLINE_S, padding=False)
    try:
        want = reference.run(sc)
    finally:
        reference.close()
    ours = Client(servers.ours_port, time.monotonic() + EXAMPLE_DEADLINE_S)
    try:
        got = ours.run(sc)
        if sc.hostile and not ours.terminated:
            ours.sock.sendall(_hostile_bytes(sc.hostile))
            verdict = _answers_or_closes(ours.sock)
            assert verdict != "silent", "the server neither answered nor closed"
    finally:
        ours.close()
    assert (not reference.terminated and not ours.terminated) or bool(sc.hostile)
    for sid, expected in want.items():
        mine = got[sid]
        assert (mine.status, mine.reset) == (expected.status, expected.reset), (sid, mine, expected)
        assert mine.messages() == expected.messages(), sid
        if expected.status == "3":
            assert mine.message == expected.message == "bad"
    limits = servers.ours.limits
    assert servers.peaks.get("buffered_bytes", 0) <= limits.connection_window
    assert servers.peaks.get("queued_out_bytes", 0) <= limits.send_queue
    assert servers.peaks.get("header_cache_bytes", 0) <= HEADER_CACHE_BYTES
    # Nothing is held once the client is gone.
    for _ in range(300):
        s = servers.stats()
        if s.connections == 0 and s.calls == 0 and s.buffered_bytes == 0:
            break
        time.sleep(0.01)
    assert (s.connections, s.calls, s.buffered_bytes, s.queued_out_bytes) == (0, 0, 0, 0)
    assert time.monotonic() - start < 3 * EXAMPLE_DEADLINE_S


# --- the sans-IO twin ---------------------------------------------------------------------------


def held_and_kept(conn: transport.Connection) -> None:
    """``h2_sansio.held``, and the count of calls that keep the connection in place (what
    displacement reads) is the calls that say so: each one whose first message arrived."""
    held(conn)
    calls = conn.calls.values()
    assert conn.keeping == sum(call.keeps_place for call in calls)
    assert all(call.keeps_place != call.first_due for call in calls)


class Alone(Client):
    """The same client against our sans-IO connection alone (no sockets, no event loop): each
    ``pump`` is a turn of the loop, in which the methods (echo, and fail on b"fail") read what
    arrived and answer, and the calls failing soon fail. Every read is checked against the
    connection's bounds and its receive-window invariant (``h2_sansio.held``)."""

    def __init__(self, sc: Scenario, deadline: float) -> None:
        self.ours = Raw(handshake=False, max_message=MAX_MESSAGE)
        self.ours.host.wire += b"".join(frame(*f) for f in self.ours.announced)  # for the client
        first = sorted(range(len(sc.streams)), key=lambda i: sc.order.index(i))
        self.streams = {1 + 2 * n: sc.streams[i] for n, i in enumerate(first)}
        self.paths = {sid: stream.path for sid, stream in self.streams.items()}
        self.failing: list[Call] = []
        self.start(deadline, padding=True)

    def feed(self, data: bytes) -> None:
        ours = self.ours
        more = ours.send(data)
        held_and_kept(ours.conn)
        while more:
            more = ours.conn.resume(ours.now)
            held_and_kept(ours.conn)
        for event in ours.take_events():
            if event[0] == "fail_soon":
                self.failing.append(ours.conn.calls[event[1]])

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.feed(data)

    def methods(self) -> None:
        conn = self.ours.conn
        failing, self.failing = self.failing, []
        for call in failing:
            conn.fail_due(call)
        for call in list(conn.calls.values()):
            try:
                while not (call.reset or call.closed) and (msg := call.take()) is not None:
                    if msg is transport.EOF:
                        conn.complete(call, OK_TRAILERS)
                    elif msg == b"fail" and self.paths.get(call.id) == FAIL:
                        conn.complete(call, status_block(grpc.StatusCode.INVALID_ARGUMENT, "bad"))
                    else:
                        conn.send_message(call, msg)
            except transport.CallAbort as e:
                conn.complete(call, status_block(e.code, e.message))
        held_and_kept(conn)

    def pump(self, wait: float) -> None:
        if self.terminated:
            return
        self.ours.now += 0.001
        self.methods()
        wire = bytes(self.ours.host.wire)
        self.ours.host.wire.clear()
        goaway = goaway_of(parse_frames(wire)[0])
        assert goaway is None or goaway[1] != 0x2, "INTERNAL_ERROR: an exception escaped"
        self.receive(wire)
        if self.ours.conn.closed and not wire:
            self.terminated = True
        self.flush()

    def close(self) -> None:
        pass


@settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(sc=scenarios())
def test_the_connection_alone_answers_and_stays_bounded(sc: Scenario) -> None:
    """The twin of the differential test, on the sans-IO connection (200 examples in a few
    seconds): every stream the client did not reset ends; an unknown method is UNIMPLEMENTED;
    echo streams get their messages back; after the hostile tail the connection is closed or
    still answers a PING; once lost, it holds nothing. No read ends in INTERNAL_ERROR."""
    client = Alone(sc, time.monotonic() + EXAMPLE_DEADLINE_S)
    got = client.run(sc)
    for sid, outcome in got.items():
        stream = client.streams[sid]
        assert outcome.status is not None or outcome.reset is not None or client.terminated, sid
        if stream.path == NOPE:
            assert outcome.status == "12"
        elif stream.path == ECHO and all(len(m) <= MAX_MESSAGE for m in stream.messages):
            assert (outcome.status, outcome.messages()) == ("0", list(stream.messages)), sid
    ours = client.ours
    if sc.hostile and not ours.conn.closed:
        client.feed(_hostile_bytes(sc.hostile))
        if not ours.conn.closed:
            ours.read()
            client.feed(bytes((1 << 20) + 64) + frame(6, 0, 0, b"fuzzping"))
            frames = ours.read()
            assert ours.conn.closed or (6, 1, 0, b"fuzzping") in frames
    ours.conn.lost()
    assert (ours.conn.calls, ours.conn.buffered, ours.conn.queued_out) == ({}, 0, 0)
