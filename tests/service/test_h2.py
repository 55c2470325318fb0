"""The h2 transport (extproc/transport/h2/) at the frame level: a raw socket on 127.0.0.1 speaks
HTTP/2 to it byte by byte, including what Envoy rarely sends (CONTINUATION, padding, small
windows, resets), so each rule of the protocol we rely on is pinned. grpc-python's client is
used against it in test_service.py and Envoy in the end-to-end tests."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import hpack
import pytest

from extproc.transport import h2
from extproc.transport.h2 import H2Server, Method, modifies_table
from extproc.transport.h2.frames import (
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PADDED,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
)
from extproc.transport.h2.headers import HeaderDecoder
from extproc.transport.h2.limits import MAX_HEADER_LIST, OUR_MAX_FRAME
from testing.wait import until_async
from tests.service.h2_peer import request_headers


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">BHBBL", n >> 16, n & 0xFFFF, ftype, flags, sid) + payload


def grpc_msg(payload: bytes, compressed: int = 0) -> bytes:
    return struct.pack(">BL", compressed, len(payload)) + payload


class Client:
    """A bare HTTP/2 client: frames out as given, frames in parsed."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()

    @classmethod
    async def connect(cls, port: int, settings: bytes = b"") -> Client:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        c = cls(r, w)
        c.send(PREFACE + frame(SETTINGS, 0, 0, settings))
        return c

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    def headers_block(self, path: str) -> bytes:
        return bytes(self.encoder.encode(request_headers(path)))

    def open(self, sid: int, path: str, end_stream: bool = False) -> None:
        flags = END_HEADERS | (END_STREAM if end_stream else 0)
        self.send(frame(HEADERS, flags, sid, self.headers_block(path)))

    async def frame(self) -> tuple[int, int, int, bytes]:
        head = await asyncio.wait_for(self.reader.readexactly(9), 5)
        hi, lo, ftype, flags, sid = struct.unpack(">BHBBL", head)
        payload = await asyncio.wait_for(self.reader.readexactly(hi << 16 | lo), 5)
        return ftype, flags, sid & 0x7FFFFFFF, payload

    async def until(self, want: Callable[[int, int, int, bytes], bool]) -> list[Any]:
        """Frames up to and including the first that ``want`` accepts (SETTINGS and
        WINDOW_UPDATE of the connection set-up included)."""
        seen = []
        for _ in range(200):
            f = await self.frame()
            seen.append(f)
            if want(*f):
                return seen
        raise AssertionError(f"no such frame in {seen}")

    def decode(self, payload: bytes) -> dict[str, str]:
        return {k: v for k, v in self.decoder.decode(payload)}

    async def response(self, sid: int) -> tuple[dict[str, str], bytes, dict[str, str]]:
        """Headers, concatenated DATA, and trailers of one stream (other streams' frames are
        ignored)."""
        headers: dict[str, str] = {}
        data = b""
        for _ in range(500):
            ftype, flags, fsid, payload = await self.frame()
            if fsid != sid:
                continue
            if ftype == HEADERS:
                block = self.decode(payload)
                if flags & END_STREAM:
                    return headers, data, block
                headers = block
            elif ftype == DATA:
                data += payload
            elif ftype == RST_STREAM:
                raise AssertionError(f"stream {sid} reset: {payload.hex()}")
        raise AssertionError("no end of stream")

    def close(self) -> None:
        self.writer.close()


async def echo(call: h2.Call) -> None:
    while (msg := await call.read()) is not h2.EOF:
        await call.write(msg)


Started = Callable[[H2Server, dict[str, Any]], Awaitable[None]]


def run(
    test: Started,
    extra: dict[str, Method] | None = None,
    max_message: int = 1000,
    **limits: Any,
) -> None:
    async def main() -> None:
        state: dict[str, Any] = {"cancelled": 0, "holding": 0, "started": asyncio.Event()}

        async def hold(call: h2.Call) -> None:
            state["holding"] += 1
            state["started"].set()
            try:
                await asyncio.sleep(30)  # holds the call until it is cancelled: nothing waits on it
            except asyncio.CancelledError:
                state["cancelled"] += 1
                raise

        async def big(call: h2.Call) -> None:
            msg = await call.read()
            await call.write(msg * 100)

        ident = bytes
        methods = {
            "/t.T/Echo": Method(echo, ident, ident),
            "/t.T/Hold": Method(hold, ident, ident),
            "/t.T/Big": Method(big, ident, ident),
            **(extra or {}),
        }
        server = H2Server(methods, max_message=max_message, **limits)
        state["port"] = await server.listen("127.0.0.1", 0)
        try:
            await asyncio.wait_for(test(server, state), 10)
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_echo_with_frames_split_byte_by_byte() -> None:
    async def t(server: H2Server, st: dict[str, Any]) -> None:
        c = await Client.connect(st["port"])
        wire = frame(HEADERS, END_HEADERS, 1, c.headers_block("/t.T/Echo"))
        wire += frame(DATA, 0, 1, grpc_msg(b"hello")[:3])
        wire += frame(DATA, END_STREAM, 1, grpc_msg(b"hello")[3:] + grpc_msg(b"world"))
        for i in range(len(wire)):
            c.send(wire[i : i + 1])
            await c.writer.drain()
        headers, data, trailers = await c.response(1)
        assert headers == {":status": "200", "content-type": "application/grpc"}
        assert data == grpc_msg(b"hello") + grpc_msg(b"world")
        assert trailers == {"grpc-status": "0"}
        c.close()

    run(t)


def test_settings_and_ping_are_acknowledged() -> None:
    async def t(server: H2Server, st: dict[str, Any]) -> None:
        c = await Client.connect(st["port"])
        c.send(frame(PING, 0, 0, b"12345678"))
        frames = await c.until(lambda ft, fl, sid, p: ft == PING)
        assert frames[-1] == (PING, 1, 0, b"12345678")
        assert (SETTINGS, 1, 0, b"") in frames  # our SETTINGS acknowledged
        ours = next(f for f in frames if f[0] == SETTINGS and f[1] == 0)
        settings = dict(struct.iter_unpack(">HL", ours[3]))
        # INITIAL_WINDOW_SIZE: one whole message (never below the protocol's default), not
        # 2^31-1: what a stream may send beyond what its method read is what we buffer.
        assert settings[4] == server.limits.stream_window == 100_000 + 5
        assert settings[3] == server.limits.max_streams  # MAX_CONCURRENT_STREAMS
        assert settings[6] == MAX_HEADER_LIST == 8 * 1024  # MAX_HEADER_LIST_SIZE
        # The connection window is opened to what a connection may buffer (4 messages).
        update = next(f for f in frames if f[0] == WINDOW_UPDATE)
        assert DEFAULT_WINDOW + struct.unpack(">L", update[3])[0] == 4 * 100_000
        c.close()

    run(t, max_message=100_000)


def test_unknown_method_is_unimplemented_trailers_only() -> None:
    async def t(server: H2Server, st: dict[str, Any]) -> None:
        c = await Client.connect(st["port"])
        c.open(1, "/t.T/Nope", end_stream=True)
        frames = await c.until(lambda ft, fl, sid, p: ft == HEADERS)
        _ftype, flags, sid, payload = frames[-1]
        assert flags & END_STREAM and sid == 1
        block = c.decode(payload)
        assert block[":status"] == "200" and block["grpc-status"] == "12"
        # A fixed message: nothing the peer sent is echoed back.
        assert block["grpc-message"] == "unknown method"
        c.close()

    run(t)


def test_continuation_and_padding() -> None:
    async def t(server: H2Server, st: dict[str, Any]) -> None:
        c = await Client.connect(st["port"])
        block = c.headers_block("/t.T/Echo")
        c.send(frame(HEADERS, PADDED, 1, bytes([3]) + block[:5] + b"\0\0\0"))
        c.send(frame(CONTINUATION, 0, 1, block[5:9]))
        c.send(frame(CONTINUATION, END_HEADERS, 1, block[9:]))
        c.send(frame(DATA, PADDED | END_STREAM, 1, bytes([4]) + grpc_msg(b"pad") + b"\0" * 4))
        _, data, trailers = await c.response(1)
        assert data == grpc_msg(b"pad") and trailers["grpc-status"] == "0"
        c.close()

    run(t)


def test_small_peer_window_holds_data_until_window_update() -> None:
    async def t(server: H2Server, st: dict[str, Any]) -> None:
        # INITIAL_WINDOW_SIZE 100 for our streams; the connection window stays 65535.
        c = await Client.connect(st["port"], struct.pack(">HL", 4, 100))
        c.open(1, "/t.T/Big")
        c.send(frame(DATA, END_STREAM, 1, grpc_msg(b"0123456789")))  # answer: 1,000 bytes
        got = b""
        while len(got) < 100:
            ftype, _flags, _sid, payload = await c.frame()
            if ftype == DATA:
                got += payload
        assert len(got) == 100  # exactly the window, then nothing more
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(c.reader.readexactly(1), 0.2)
        c.send(frame(WINDOW_UPDATE, 0, 1, struct.pack(">L", 10_000)))
        _, rest, trailers = await c.response(1)
        assert got + rest == grpc_msg(b"0123456789" * 100)
        assert trailers["grpc-status"] == "0"  # after all the data
        c.close()

    run(t)


def test_reset_cancels_only_that_call() -> None:
    async def t(server: H2Server, st: dict[str, Any]) -> None:
        c = await Client.connect(st["port"])
        c.open(1, "/t.T/Hold")
        c.send(frame(DATA, 0, 1, grpc_msg(b"x")))
        await st["started"].wait()
        c.open(3, "/t.T/Echo")
        c.send(frame(RST_STREAM, 0, 1, struct.pack(">L", 0x8)))
        c.send(frame(DATA, END_STREAM, 3, grpc_msg(b"still here")))
        _, data, _trailers = await c.response(3)
        assert data == grpc_msg(b"still here")
        assert st["cancelled"] == 1
        c.close()

    run(t)


def test_connection_lost_cancels_every_call() -> None:
    async def t(server: H2Server, st: dict[str, Any]) -> None:
        c = await Client.connect(st["port"])
        for sid in (1, 3, 5):
            c.open(sid, "/t.T/Hold")
        await until_async(lambda: st["holding"] == 3, "the three calls' methods running")
        c.writer.transport.abort()
        await until_async(lambda: st["cancelled"] == 3, "the three calls cancelled")
        assert not any(conn.connection.calls for conn in server.connections)

    run(t)


@pytest.mark.parametrize(
    "message, code",
    [(grpc_msg(b"z", compressed=1), "12"), (grpc_msg(b"x" * 1001), "8")],
    ids=["compressed", "too-large"],
)
def test_bad_messages_end_the_call_with_a_status(message: bytes, code: str) -> None:
    async def t(server: H2Server, st: dict[str, Any]) -> None:
        c = await Client.connect(st["port"])
        c.open(1, "/t.T/Hold")
        await st["started"].wait()
        c.send(frame(DATA, 0, 1, message))
        _, _, trailers = await c.response(1)
        assert trailers["grpc-status"] == code
        await until_async(lambda: st["cancelled"], "the method stopped too")
        assert st["cancelled"] == 1
        c.open(3, "/t.T/Echo")  # the connection still serves
        c.send(frame(DATA, END_STREAM, 3, grpc_msg(b"ok")))
        assert (await c.response(3))[1] == grpc_msg(b"ok")
        c.close()

    run(t)


def test_an_answer_written_just_before_a_bad_message_still_goes_out() -> None:
    """A good message and a too-large one in one read: the echo method, woken by the first,
    writes its answer before the call fails, as grpc.aio does (the fuzz found it)."""

    reading = asyncio.Event()

    async def echo_noting(call: h2.Call) -> None:
        reading.set()  # then into read() without yielding: waiting there once the test wakes
        await echo(call)

    async def t(server: H2Server, st: dict[str, Any]) -> None:
        c = await Client.connect(st["port"])
        c.open(1, "/t.T/EchoNoting")
        await until_async(reading.is_set, "the method waiting in read")
        c.send(
            frame(DATA, 0, 1, grpc_msg(b"first"))
            + frame(DATA, END_STREAM, 1, grpc_msg(b"x" * 1001))
        )
        _, data, trailers = await c.response(1)
        assert (data, trailers["grpc-status"]) == (grpc_msg(b"first"), "8")
        c.close()

    run(t, {"/t.T/EchoNoting": Method(echo_noting, bytes, bytes)})


def test_bad_preface_closes_with_goaway() -> None:
    async def t(server: H2Server, st: dict[str, Any]) -> None:
        r, w = await asyncio.open_connection("127.0.0.1", st["port"])
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        data = await asyncio.wait_for(r.read(), 5)  # until the server closes
        frames, pos = [], 0
        while pos + 9 <= len(data):
            n = int.from_bytes(data[pos : pos + 3], "big")
            frames.append((data[pos + 3], data[pos + 9 : pos + 9 + n]))
            pos += 9 + n
        goaway = [p for ft, p in frames if ft == GOAWAY]
        assert goaway and struct.unpack(">LL", goaway[0][:8])[1] == 0x1  # PROTOCOL_ERROR
        w.close()

    run(t)


def test_stop_refuses_new_streams_and_lets_open_ones_finish() -> None:
    async def t(server: H2Server, st: dict[str, Any]) -> None:
        c = await Client.connect(st["port"])
        c.open(1, "/t.T/Echo")
        await until_async(
            lambda: any(1 in p.connection.calls for p in server.connections),
            "stream 1 open on the server",
        )
        stopping = asyncio.ensure_future(server.stop(2.0))
        frames = await c.until(lambda ft, fl, sid, p: ft == GOAWAY)
        assert struct.unpack(">LL", frames[-1][3][:8]) == (1, 0)  # last stream 1, NO_ERROR
        c.open(3, "/t.T/Echo")
        frames = await c.until(lambda ft, fl, sid, p: ft == RST_STREAM)
        assert frames[-1][2] == 3 and frames[-1][3] == struct.pack(">L", 0x7)  # REFUSED
        c.send(frame(DATA, END_STREAM, 1, grpc_msg(b"last")))
        _, data, trailers = await c.response(1)
        assert data == grpc_msg(b"last") and trailers["grpc-status"] == "0"
        await stopping
        c.close()

    run(t)


def test_header_cache_is_exact_while_the_table_changes() -> None:
    """Blocks that leave the HPACK table alone are cached; any that changes it clears the
    cache, so a cached block is never decoded against a stale table."""
    e = hpack.Encoder()
    first = e.encode([(":path", "/a"), ("x-k", "1")])  # adds x-k: 1 to the table
    again = e.encode([(":path", "/a"), ("x-k", "1")])  # indexed only
    assert modifies_table(first) and not modifies_table(again)
    shrink = e.encode([("x-k", "2")])  # adds x-k: 2 at the top: "again" now means other things
    assert modifies_table(shrink)

    decoder = HeaderDecoder()
    fresh = hpack.Decoder()
    for block in (first, again, again, shrink, again, again):
        assert decoder.decode(block)[0] == fresh.decode(block, raw=True)
    assert list(decoder.cache) == [again]  # cached again after the table changed


def test_streams_above_the_limit_are_refused() -> None:
    async def t(server: H2Server, st: dict[str, Any]) -> None:
        c = await Client.connect(st["port"])
        for sid in (1, 3, 5):
            c.open(sid, "/t.T/Hold")
        frames = await c.until(lambda ft, fl, sid, p: ft == RST_STREAM)
        assert frames[-1][2] == 5 and frames[-1][3] == struct.pack(">L", 0x7)  # REFUSED
        assert sorted(next(iter(server.connections)).connection.calls) == [1, 3]
        c.close()

    run(t, max_streams=2)


def test_frame_above_the_announced_size_ends_the_connection() -> None:
    async def t(server: H2Server, st: dict[str, Any]) -> None:
        c = await Client.connect(st["port"])
        c.open(1, "/t.T/Echo")
        c.send(frame(DATA, 0, 1, b"\0" * (OUR_MAX_FRAME + 1)))
        frames = await c.until(lambda ft, fl, sid, p: ft == GOAWAY)
        assert struct.unpack(">LL", frames[-1][3][:8])[1] == 0x6  # FRAME_SIZE_ERROR
        try:  # closed (reset, if our unread bytes were still in its socket)
            assert await asyncio.wait_for(c.reader.read(), 5) == b""
        except ConnectionResetError:
            pass
        c.close()

    run(t)


def test_large_message_in_many_frames_and_reads() -> None:
    """A 600 KB message in 16 KiB DATA frames (what Envoy sends for a big body), written in
    7,000-byte pieces so that frames and the message both arrive split."""
    body = bytes(range(256)) * 2400

    async def t(server: H2Server, st: dict[str, Any]) -> None:
        # The answer is as large: open our windows for it.
        c = await Client.connect(st["port"], struct.pack(">HL", 4, 1 << 30))
        c.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", 1 << 30)))
        c.open(1, "/t.T/Echo")
        msg = grpc_msg(body)
        wire = b"".join(
            frame(DATA, END_STREAM if i + 16384 >= len(msg) else 0, 1, msg[i : i + 16384])
            for i in range(0, len(msg), 16384)
        )
        for i in range(0, len(wire), 7000):
            c.send(wire[i : i + 7000])
        _, data, trailers = await c.response(1)
        assert data == msg and trailers["grpc-status"] == "0"
        c.close()

    run(t, max_message=1 << 20)
