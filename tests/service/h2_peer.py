"""Peers for the h2 transport's hostile tests: a blocking raw-socket attacker meant to run in a
thread (its big writes release the GIL, so it costs the server's event loop little), an
asyncio honest client that times its exchanges, and a harness that runs an ``H2Server`` with
a few test methods on 127.0.0.1. Everything here is bounded: every read has a timeout and
every loop a count."""

from __future__ import annotations

import asyncio
import math
import selectors
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import hpack

from extproc.transport import h2
from extproc.transport.h2 import H2Server, Method
from extproc.transport.h2.frames import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    NO_ERROR,
    PREFACE,
    RST_STREAM,
    SETTINGS,
)
from testing.wait import TIMEOUT_S, until_async

Frame = tuple[int, int, int, bytes]


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">BHBBL", n >> 16, n & 0xFFFF, ftype, flags, sid) + payload


def grpc_msg(payload: bytes) -> bytes:
    return struct.pack(">BL", 0, len(payload)) + payload


def settings(**values: int) -> bytes:
    ids = {"initial_window": 4, "max_frame": 5, "enable_push": 2, "table_size": 1}
    return b"".join(struct.pack(">HL", ids[k], v) for k, v in values.items())


def request_headers(path: str) -> list[tuple[str, str]]:
    """A gRPC request's headers."""
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "x"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]


def request_block(path: str, encoder: hpack.Encoder | None = None) -> bytes:
    """A gRPC request's header block: with a fresh encoder (the default) it touches no
    dynamic table, so any connection can decode it."""
    # Fields "never indexed" (the third element): the block leaves the table alone, like
    # Envoy's, so the server can cache it.
    enc = encoder or hpack.Encoder()
    fields = [(name, value, True) for name, value in request_headers(path)]
    return bytes(enc.encode(fields, huffman=False))


def parse_frames(data: bytes) -> tuple[list[Frame], bytes]:
    frames, pos = [], 0
    while len(data) - pos >= 9:
        hi, lo, ftype, flags, sid = struct.unpack_from(">BHBBL", data, pos)
        n = hi << 16 | lo
        if len(data) - pos - 9 < n:
            break
        frames.append((ftype, flags, sid & 0x7FFFFFFF, data[pos + 9 : pos + 9 + n]))
        pos += 9 + n
    return frames, data[pos:]


def goaway_of(frames: list[Frame]) -> tuple[int, bytes] | None:
    """(error code, debug data) of the first GOAWAY, if any."""
    for ftype, _flags, _sid, payload in frames:
        if ftype == GOAWAY:
            return struct.unpack(">L", payload[4:8])[0], payload[8:]
    return None


def _length(data: bytes) -> int:
    return int.from_bytes(data[:3], "big") if len(data) >= 3 else 0


def p99(samples: list[float]) -> float:
    """Nearest-rank 99th percentile."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class RawPeer:
    """A blocking HTTP/2 peer on its own socket: bytes out as given, frames in parsed."""

    def __init__(self, port: int, hello: bytes = b"", *, preface: bool = True) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._rest = b""
        self.frames: list[Frame] = []
        if preface:
            self.send(PREFACE + frame(SETTINGS, 0, 0, hello))

    def send(self, data: bytes) -> bool:
        """Send all of ``data``; False if the server closed the connection meanwhile."""
        try:
            self.sock.sendall(data)
        except OSError:
            return False
        return True

    def read_until(self, want: Callable[[Frame], bool], timeout: float = 5.0) -> bool:
        """Read frames until one that ``want`` accepts (True), the connection's end or the
        timeout (False). Every frame read is kept in ``frames``; each is offered to ``want``
        once."""
        deadline = time.monotonic() + timeout
        checked = 0
        while True:
            for f in self.frames[checked:]:
                checked += 1
                if want(f):
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 20)
            except OSError:  # a timeout, or the server reset the connection
                return False
            if not chunk:
                return False
            got, self._rest = parse_frames(self._rest + chunk)
            self.frames.extend(got)

    def read_count(self, want: Callable[[Frame], bool], n: int, timeout: float = 5.0) -> bool:
        """Read frames until ``n`` of them (counting those already read) satisfy ``want``."""
        matched = [0]

        def enough(f: Frame) -> bool:
            matched[0] += bool(want(f))
            return matched[0] >= n

        return self.read_until(enough, timeout)

    def wait_for_bytes(self, pattern: bytes, timeout: float = 5.0) -> bool:
        """Read until ``pattern`` has been received, without parsing frames: cheap on the
        GIL, for an attacker thread reading thousands of replies while the server is timed.
        What is read is not kept."""
        deadline = time.monotonic() + timeout
        tail = b""
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 20)
            except OSError:
                return False
            if not chunk:
                return False
            tail = tail[-len(pattern) :] + chunk
            if pattern in tail:
                return True
        return False

    def goaway(self, timeout: float = 5.0) -> tuple[int, bytes] | None:
        self.read_until(lambda f: f[0] == GOAWAY, timeout)
        return goaway_of(self.frames)

    def closed_within(self, timeout: float) -> bool:
        """Whether the server closes the connection within ``timeout`` (frames are kept)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 20)
            except TimeoutError:
                return False
            except OSError:
                return True
            if not chunk:
                return True
            got, self._rest = parse_frames(self._rest + chunk)
            self.frames.extend(got)
        return False

    def close(self) -> None:
        self.sock.close()


def stranger(port: int) -> RawPeer:
    """A peer that completes the handshake (preface, SETTINGS, SETTINGS ACK), waits for the
    server's ACK of its SETTINGS, and then says nothing."""
    peer = RawPeer(port)
    peer.send(frame(SETTINGS, ACK, 0))
    peer.read_until(lambda f: f[0] == SETTINGS and bool(f[1] & ACK))  # False: closed at once
    return peer


DISPLACED = (NO_ERROR, b"too many connections")  # the GOAWAY of a connection displaced


def displaced(peer: RawPeer) -> bool:
    """The peer got the GOAWAY of a connection displaced, and was closed."""
    return peer.closed_within(2.0) and goaway_of(peer.frames) == DISPLACED


def told_nothing(peers: list[RawPeer]) -> bool:
    """None of the peers has anything to read (no GOAWAY, no close) right now."""
    with selectors.DefaultSelector() as sel:
        for p in peers:
            sel.register(p.sock, selectors.EVENT_READ)
        return not sel.select(0)


class Honest:
    """An honest gRPC client on its own connection, in the server's event loop: one echo
    exchange at a time, each timed from its first byte out to its trailers."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        path: str,
        message: bytes,
        expect: bytes | None,
    ) -> None:
        self.reader, self.writer = reader, writer
        self.sid = 1
        self.block = request_block(path)
        self.message = message
        self.expect = expect  # the DATA every exchange must get back (None: any)
        self.latencies: list[float] = []
        self._rest = b""

    @classmethod
    async def connect(
        cls,
        port: int,
        path: str = "/t.T/Echo",
        message: bytes = b"honest",
        expect: bytes | None = grpc_msg(b"honest"),
    ) -> Honest:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(PREFACE + frame(SETTINGS, 0, 0))
        return cls(r, w, path, message, expect)

    async def exchange(self) -> bytes:
        sid, self.sid = self.sid, self.sid + 2
        start = time.perf_counter()
        self.writer.write(
            frame(HEADERS, END_HEADERS, sid, self.block)
            + frame(DATA, END_STREAM, sid, grpc_msg(self.message))
        )
        data = b""
        for _ in range(1000):
            ftype, flags, fsid, payload = await self._frame()
            if fsid != sid:
                continue
            if ftype == DATA:
                data += payload
            elif ftype == HEADERS and flags & END_STREAM:
                self.latencies.append(time.perf_counter() - start)
                if self.expect is not None:
                    assert data == self.expect
                return data
            elif ftype == RST_STREAM:
                raise AssertionError(f"honest stream {sid} reset")
        raise AssertionError("no end of the honest stream")

    async def _frame(self) -> Frame:
        while True:
            got, _ = parse_frames(self._rest[: 9 + _length(self._rest)])
            if got:
                self._rest = self._rest[9 + len(got[0][3]) :]
                return got[0]
            chunk = await asyncio.wait_for(self.reader.read(1 << 16), 5)
            if not chunk:
                raise AssertionError("the server closed the honest connection")
            self._rest += chunk

    async def keep_going(
        self, until: Awaitable[Any], minimum_s: float = 0.5, minimum_n: int = 20
    ) -> Any:
        """Exchanges, paced a little, until ``until`` is done, ``minimum_s`` has passed and
        ``minimum_n`` exchanges are done (on a loaded machine an attack may end within a few
        exchanges); returns what ``until`` returned."""
        task = asyncio.ensure_future(until)
        end = time.perf_counter() + minimum_s
        for _ in range(20_000):
            if task.done() and time.perf_counter() >= end and len(self.latencies) >= minimum_n:
                break
            await self.exchange()
            await asyncio.sleep(0.002)  # the load's pace: no assertion rests on it
        return await task

    def close(self) -> None:
        self.writer.close()


Test = Callable[[H2Server, int], Awaitable[None]]


async def echo(call: h2.Call) -> None:
    while (msg := await call.read()) is not h2.EOF:
        await call.write(msg)


async def sink(call: h2.Call) -> None:
    """Holds the call and reads nothing: what the peer sends stays buffered."""
    await asyncio.sleep(30)  # held until cancelled: nothing waits on it


async def big(call: h2.Call) -> None:
    """Answers each message with 64 copies of it."""
    while (msg := await call.read()) is not h2.EOF:
        await call.write(msg * 64)


async def abort_long(call: h2.Call) -> None:
    await call.read()
    raise h2.CallAbort(h2.StatusCode.INTERNAL, "x" * 100_000)


def methods() -> dict[str, Method]:
    ident = bytes
    return {
        "/t.T/Echo": Method(echo, ident, ident),
        "/t.T/Sink": Method(sink, ident, ident),
        "/t.T/Big": Method(big, ident, ident),
        "/t.T/Abort": Method(abort_long, ident, ident),
    }


def serve(test: Test, *, timeout: float = 20.0, **limits: Any) -> None:
    """Run ``test(server, port)`` against an H2Server with the test methods."""

    async def main() -> None:
        server = H2Server(methods(), **{"max_message": 64 * 1024, **limits})
        port = await server.listen("127.0.0.1", 0)
        try:
            await asyncio.wait_for(test(server, port), timeout)
        finally:
            await server.stop(0)

    asyncio.run(main())


async def settle(
    server: H2Server,
    done: Callable[[H2Server], bool],
    within: float = TIMEOUT_S,
    what: str = "the server let go of what the test waits for",
) -> bool:
    """Wait until ``done(server)`` (the server let go of something): True, or after
    ``within`` s an AssertionError naming ``what`` and the server's statistics then."""
    try:
        return await until_async(lambda: done(server), what, limit_s=within)
    except AssertionError as e:
        raise AssertionError(f"{e}; {server.statistics()}") from None


def nothing_held(server: H2Server) -> bool:
    s = server.statistics()
    return s.calls == 0 and s.buffered_bytes == 0 and s.queued_out_bytes == 0


async def honest_exchanges(port: int, n: int = 3) -> None:
    """An honest client's ``n`` echo exchanges on a connection of its own, then closed: each
    must be answered."""
    honest = await Honest.connect(port)
    try:
        for _ in range(n):
            await honest.exchange()
    finally:
        honest.close()
