"""A small gRPC server on asyncio: HTTP/2 framing written for the sidecar's two services.

Why not grpc.aio: profiling the sidecar under load (docs/performance.md) put ~85% of its CPU
in grpc.aio's machinery (the completion-queue poller thread, the hops between it and the
event loop, per-call objects), not in admission. Envoy is the only client that matters and
it speaks plain gRPC over HTTP/2 on long-lived connections, one stream per HTTP request. This
module implements exactly that server side, on the event loop's own transports (uvloop when
installed), with no threads:

* the connection: preface, SETTINGS (+ACK), PING (ACK), WINDOW_UPDATE, RST_STREAM, GOAWAY,
  HEADERS + CONTINUATION (HPACK decoding by the ``hpack`` package, one decoder per
  connection), DATA with padding, and flow control in both directions;
* gRPC on top: length-prefixed messages (no compression), response headers, trailers with
  ``grpc-status``/``grpc-message``, trailers-only errors (unknown method: UNIMPLEMENTED);
* a call object with the two methods the servicer uses, ``await read()`` (a message, or
  ``grpc.aio.EOF`` once the client half-closed) and ``await write(msg)``; a stream reset by
  the client, or a connection lost, cancels the call's task, as grpc.aio does.

What it does not do, by design: server push, priorities (ignored), compressed messages
(refused with UNIMPLEMENTED), HTTP/1.1. Both transports run the same servicer; ``grpc`` (the
grpc.aio server) stays available (``llm-extproc serve --transport grpc``).

Writes: the frames that reading one batch of bytes produces (SETTINGS and PING acks, window
updates, refusals) go out in one ``write``; a call's answer goes out at once, headers and
message in one ``write``. Nothing is held back when the peer reads slowly (the transport
buffers): answers are small and there is one per Envoy message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, cast

import grpc
import hpack

__all__ = ["EOF", "Call", "CallAbort", "H2Server", "Method", "StatusCode"]

log = logging.getLogger("extproc.h2")

EOF = grpc.aio.EOF
StatusCode = grpc.StatusCode

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 section 6) and flags.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# Error codes.
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
FRAME_SIZE_ERROR, CANCEL, COMPRESSION_ERROR = 0x6, 0x8, 0x9
# SETTINGS identifiers.
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 1, 2, 3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 4, 5, 6

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65535
DEFAULT_FRAME = 16384
# What we accept per frame. Fewer, larger frames for big request bodies.
OUR_MAX_FRAME = 1 << 20
# Receive windows: we read everything at once and never hold data back, so the windows only
# need to be large; they are topped up when half used.
OUR_WINDOW = MAX_WINDOW
_TOP_UP = 1 << 30
MAX_HEADER_BLOCK = 256 * 1024
# Open calls per connection (announced, and enforced with REFUSED_STREAM). Every request Envoy
# holds in a queue is one open call: far above any queue, and a bound on what one client costs.
MAX_CONCURRENT_STREAMS = 200_000

_HEADER = struct.Struct(">BHBBL")  # 24-bit length as (high byte, low 16 bits), type, flags, id
_U32 = struct.Struct(">L")


def _frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEADER.pack(n >> 16, n & 0xFFFF, ftype, flags, stream_id) + payload


def _hpack_int(value: int, prefix_bits: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((value,))
    out = bytearray((limit,))
    value -= limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A header as 'literal without indexing, new name': touches no HPACK dynamic table, so
    the peer's table size settings never matter to us."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


# :status 200 is entry 8 of HPACK's static table; content-type (entry 31) with a literal value.
_RESPONSE_HEADERS = b"\x88" + _hpack_int(31, 4) + _hpack_int(16, 7) + b"application/grpc"
_OK_TRAILERS = _literal(b"grpc-status", b"0")


def _percent_encode(message: str) -> bytes:
    """grpc-message encoding: bytes outside 0x20-0x7E, and '%', as %XX."""
    return b"".join(
        bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b
        for b in message.encode("utf-8")
    )


def _status_block(code: StatusCode, message: str) -> bytes:
    block = _literal(b"grpc-status", str(code.value[0]).encode())
    if message:
        block += _literal(b"grpc-message", _percent_encode(message))
    return block


def _read_int(block: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    limit = (1 << prefix_bits) - 1
    value = block[pos] & limit
    pos += 1
    if value < limit:
        return value, pos
    shift = 0
    while True:
        b = block[pos]
        pos += 1
        value += (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos


def modifies_table(block: bytes) -> bool:
    """Whether decoding this header block changes the HPACK dynamic table (a literal with
    incremental indexing, or a table size update). Errs on the side of yes."""
    pos, n = 0, len(block)
    try:
        while pos < n:
            b = block[pos]
            if b & 0x80:  # indexed field
                pos = _read_int(block, pos, 7)[1]
            elif b & 0xE0 == 0x00 or b & 0xF0 == 0x10:  # literal without / never indexed
                index, pos = _read_int(block, pos, 4)
                if index == 0:
                    length, pos = _read_int(block, pos, 7)
                    pos += length
                length, pos = _read_int(block, pos, 7)
                pos += length
            else:  # 01xxxxxx incremental indexing, 001xxxxx size update
                return True
    except IndexError:
        return True
    return pos != n


class _Pieces:
    """The start of something incomplete (a frame, a gRPC message) and the pieces that follow,
    joined once when ``need`` bytes are there, instead of re-copied on every read (a large
    body arrives in many 16 KiB frames)."""

    __slots__ = ("have", "need", "parts")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.have = 0
        self.need = 0

    def keep(self, start: bytes, need: int) -> None:
        self.parts = [start]
        self.have = len(start)
        self.need = need

    def add(self, data: bytes) -> bytes | None:
        """All the bytes so far once ``need`` of them are there (and forget them), else None."""
        self.parts.append(data)
        self.have += len(data)
        if self.have < self.need:
            return None
        joined = b"".join(self.parts)
        self.parts = []
        return joined


class _ConnectionFailure(Exception):
    """A protocol error that ends the connection (GOAWAY with ``code``)."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


class Call:
    """One gRPC call (one HTTP/2 stream): the context object handed to a method."""

    __slots__ = (
        "_conn",
        "_deserialize",
        "_messages",
        "_partial",
        "_reader",
        "_serialize",
        "closed",
        "eof",
        "headers_sent",
        "id",
        "pending",
        "recv_unacked",
        "reset",
        "send_window",
        "task",
    )

    def __init__(
        self,
        conn: _Connection,
        stream_id: int,
        send_window: int,
        deserialize: Callable[[bytes], Any],
        serialize: Callable[[Any], bytes],
    ) -> None:
        self._conn = conn
        self.id = stream_id
        self.send_window = send_window
        self._deserialize = deserialize
        self._serialize = serialize
        self._partial = _Pieces()  # an incomplete message
        self._messages: deque[Any] = deque()
        self._reader: asyncio.Future[Any] | None = None
        self.eof = False  # the client half-closed
        self.reset = False  # the stream was reset (by the client, or because of an error)
        self.closed = False  # we sent our END_STREAM
        self.headers_sent = False
        self.pending: deque[tuple[bytes, bool]] = deque()  # DATA waiting for window
        self.recv_unacked = 0
        self.task: asyncio.Task[None] | None = None

    # --- what a method uses --------------------------------------------------------------------

    async def read(self) -> Any:
        """The next message, or ``EOF`` once the client has half-closed the stream."""
        if self._messages:
            return self._messages.popleft()
        if self.eof:
            return EOF
        fut: asyncio.Future[Any] = self._conn.loop.create_future()
        self._reader = fut
        try:
            return await fut
        finally:
            self._reader = None

    async def write(self, message: Any) -> None:
        """Send one message. Never blocks: what the peer's window does not take yet is sent
        when it opens."""
        if self.reset:
            return  # the client is gone (the task is being cancelled): nobody to write to
        if self.closed:
            raise asyncio.InvalidStateError("write on a finished call")
        payload = self._serialize(message)
        self._conn.send_message(self, payload)

    # --- fed by the connection -----------------------------------------------------------------

    def _deliver(self, message: Any) -> None:
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(message)
        else:
            self._messages.append(message)

    def on_data(self, data: bytes, max_message: int) -> None:
        if self._partial.parts:
            joined = self._partial.add(data)
            if joined is None:
                return
            data = joined
        buf = data
        pos, n = 0, len(buf)
        need = 5
        while n - pos >= 5:
            compressed = buf[pos]
            length = _U32.unpack_from(buf, pos + 1)[0]
            if length > max_message:
                raise CallAbort(
                    StatusCode.RESOURCE_EXHAUSTED,
                    f"message of {length} bytes is larger than {max_message}",
                )
            if compressed:
                raise CallAbort(StatusCode.UNIMPLEMENTED, "compressed messages not supported")
            end = pos + 5 + length
            if end > n:
                need = 5 + length
                break
            try:
                message = self._deserialize(buf[pos + 5 : end])
            except Exception as e:
                raise CallAbort(StatusCode.INTERNAL, f"cannot parse the message: {e}") from e
            self._deliver(message)
            pos = end
        if pos < n:
            self._partial.keep(buf[pos:], need)

    def on_end_stream(self) -> None:
        self.eof = True
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(EOF)


class CallAbort(Exception):
    """Ends a call with a gRPC status: raised by a method, or for a bad message."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# A method: (call) -> awaitable, plus how its messages are read and written.
class Method:
    __slots__ = ("deserialize", "handler", "serialize")

    def __init__(
        self,
        handler: Callable[[Call], Awaitable[None]],
        deserialize: Callable[[bytes], Any],
        serialize: Callable[[Any], bytes],
    ) -> None:
        self.handler = handler
        self.deserialize = deserialize
        self.serialize = serialize


class _Connection(asyncio.Protocol):
    def __init__(self, server: H2Server) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self._partial = _Pieces()  # an incomplete frame (or preface)
        self._preface = False
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = MAX_HEADER_BLOCK
        # Envoy sends the same header block for every ext_proc stream (only indexed fields and
        # a literal :path). Blocks that leave the dynamic table alone decode the same way until
        # the table changes: cache them, and forget them all when it does.
        self._decoded: dict[bytes, list[tuple[bytes, bytes]]] = {}
        self.calls: dict[int, Call] = {}
        self._last_id = 0
        self._headers_for: int = 0  # a stream whose header block continues in CONTINUATION
        self._headers_block = b""
        self._headers_end_stream = False
        self.send_window = DEFAULT_WINDOW
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame = DEFAULT_FRAME
        self._recv_unacked = 0
        self._blocked: dict[int, Call] = {}  # calls with DATA waiting for window
        self._out: list[bytes] = []
        self._batching = False  # while frames are read: what they make goes out in one write
        self._goaway_sent = False
        self.closed = False

    # --- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self.server.connections.add(self)
        settings = struct.pack(
            ">HLHLHLHL",
            S_MAX_CONCURRENT_STREAMS,
            MAX_CONCURRENT_STREAMS,
            S_INITIAL_WINDOW_SIZE,
            OUR_WINDOW,
            S_MAX_FRAME_SIZE,
            OUR_MAX_FRAME,
            S_MAX_HEADER_LIST_SIZE,
            MAX_HEADER_BLOCK,
        )
        self._write(_frame(SETTINGS, 0, 0, settings))
        self._write(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(OUR_WINDOW - DEFAULT_WINDOW)))

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return  # failed: what still arrives is read and dropped until we close
        self._batching = True
        try:
            self._data_received(data)
        finally:
            self._batching = False
            if self._out:
                self._flush_out()

    def _data_received(self, data: bytes) -> None:
        if self._partial.parts:
            joined = self._partial.add(data)
            if joined is None:
                return
            data = joined
        try:
            if not self._preface:
                if len(data) < len(PREFACE):
                    if not PREFACE.startswith(data):
                        raise _ConnectionFailure(PROTOCOL_ERROR, "not an HTTP/2 client preface")
                    self._partial.keep(data, len(PREFACE))
                    return
                if not data.startswith(PREFACE):
                    raise _ConnectionFailure(PROTOCOL_ERROR, "not an HTTP/2 client preface")
                self._preface = True
                data = data[len(PREFACE) :]
            pos, n = 0, len(data)
            unpack = _HEADER.unpack_from
            need = 9
            while n - pos >= 9:
                hi, lo, ftype, flags, sid = unpack(data, pos)
                length = hi << 16 | lo
                if length > OUR_MAX_FRAME:
                    raise _ConnectionFailure(FRAME_SIZE_ERROR, "frame larger than announced")
                end = pos + 9 + length
                if end > n:
                    need = 9 + length
                    break
                self._on_frame(ftype, flags, sid & 0x7FFFFFFF, data[pos + 9 : end])
                pos = end
                if self.closed:
                    return
            if pos < n:
                self._partial.keep(data[pos:], need)
        except _ConnectionFailure as e:
            log.warning("closing an HTTP/2 connection: %s", e)
            self._fail(e.code, str(e))
        except Exception:
            log.exception("HTTP/2 connection failed")
            self._fail(INTERNAL_ERROR, "internal error")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        for call in list(self.calls.values()):
            self._cancel(call)
        self.calls.clear()
        self._blocked.clear()
        self.server.call_ended()

    # --- frames in -----------------------------------------------------------------------------

    def _on_frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if self._headers_for and ftype != CONTINUATION:
            raise _ConnectionFailure(PROTOCOL_ERROR, "expected CONTINUATION")
        if ftype == DATA:
            self._on_data(flags, sid, payload)
        elif ftype == HEADERS:
            self._on_headers(flags, sid, payload)
        elif ftype == CONTINUATION:
            if sid != self._headers_for or not sid:
                raise _ConnectionFailure(PROTOCOL_ERROR, "unexpected CONTINUATION")
            self._headers_block += payload
            if len(self._headers_block) > MAX_HEADER_BLOCK:
                raise _ConnectionFailure(PROTOCOL_ERROR, "header block too large")
            if flags & END_HEADERS:
                self._headers_for = 0
                block, self._headers_block = self._headers_block, b""
                self._on_header_block(sid, block, self._headers_end_stream)
        elif ftype == RST_STREAM:
            call = self.calls.pop(sid, None)
            if call is not None:
                call.reset = True
                self._blocked.pop(sid, None)
                self._cancel(call)
                self.server.call_ended()
        elif ftype == SETTINGS:
            if sid:
                raise _ConnectionFailure(PROTOCOL_ERROR, "SETTINGS on a stream")
            if not flags & ACK:
                self._on_settings(payload)
        elif ftype == PING:
            if len(payload) != 8:
                raise _ConnectionFailure(FRAME_SIZE_ERROR, "PING of the wrong size")
            if not flags & ACK:
                self._write(_frame(PING, ACK, 0, payload))
        elif ftype == WINDOW_UPDATE:
            self._on_window_update(sid, payload)
        elif ftype == GOAWAY:
            pass  # the peer opens no more streams; those open finish as usual
        elif ftype == PUSH_PROMISE:
            raise _ConnectionFailure(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # PRIORITY and unknown frame types are ignored (RFC 9113 section 5.5).

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        if not sid:
            raise _ConnectionFailure(PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        self._recv_unacked += size
        if self._recv_unacked >= _TOP_UP:
            self._write(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._recv_unacked)))
            self._recv_unacked = 0
        call = self.calls.get(sid)
        if call is None or call.eof:
            return  # a stream we have finished (or reset); its bytes still count above
        if flags & PADDED:
            if not payload or payload[0] >= size:
                raise _ConnectionFailure(PROTOCOL_ERROR, "bad padding")
            payload = payload[1 : size - payload[0]]
        call.recv_unacked += size
        if call.recv_unacked >= _TOP_UP:
            self._write(_frame(WINDOW_UPDATE, 0, sid, _U32.pack(call.recv_unacked)))
            call.recv_unacked = 0
        try:
            if payload:
                call.on_data(payload, self.server.max_message)
        except CallAbort as e:
            self._fail_call(call, e.code, e.message)
            return
        if flags & END_STREAM:
            call.on_end_stream()

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        if not sid:
            raise _ConnectionFailure(PROTOCOL_ERROR, "HEADERS on stream 0")
        if flags & PADDED:
            pad = payload[0] if payload else 256
            if pad >= len(payload):
                raise _ConnectionFailure(PROTOCOL_ERROR, "bad padding")
            payload = payload[1 : len(payload) - pad]
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if flags & END_HEADERS:
            self._on_header_block(sid, payload, bool(flags & END_STREAM))
        else:
            self._headers_for = sid
            self._headers_block = payload
            self._headers_end_stream = bool(flags & END_STREAM)

    def _on_header_block(self, sid: int, block: bytes, end_stream: bool) -> None:
        headers = self.decode_headers(block)
        call = self.calls.get(sid)
        if call is not None or sid <= self._last_id:
            # Trailers of a stream in progress (gRPC clients send none), or a late block for
            # a stream we have finished: it can only end the stream.
            if call is not None and end_stream:
                call.on_end_stream()
            return
        if sid % 2 == 0:
            raise _ConnectionFailure(PROTOCOL_ERROR, "even stream id from a client")
        self._last_id = sid
        if self._goaway_sent or len(self.calls) >= MAX_CONCURRENT_STREAMS:
            self._write(_frame(RST_STREAM, 0, sid, _U32.pack(0x7)))  # REFUSED_STREAM
            return
        path = b""
        content_type = b""
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b"content-type":
                content_type = value
        method = self.server.methods.get(path)
        if not content_type.startswith(b"application/grpc"):
            self._write(
                _frame(
                    HEADERS,
                    END_HEADERS | END_STREAM,
                    sid,
                    _hpack_int(8, 4) + b"\x03415",  # :status 415 (static name, literal value)
                )
            )
            return
        if method is None:
            self._write(
                _frame(
                    HEADERS,
                    END_HEADERS | END_STREAM,
                    sid,
                    _RESPONSE_HEADERS
                    + _status_block(
                        StatusCode.UNIMPLEMENTED, f"unknown method {path.decode('latin-1')}"
                    ),
                )
            )
            return
        call = Call(self, sid, self._peer_initial_window, method.deserialize, method.serialize)
        self.calls[sid] = call
        if end_stream:
            call.on_end_stream()
        call.task = self.loop.create_task(self._run(call, method))

    def decode_headers(self, block: bytes) -> list[tuple[bytes, bytes]]:
        headers = self._decoded.get(block)
        if headers is None:
            try:
                headers = cast(list[tuple[bytes, bytes]], self._decoder.decode(block, raw=True))
            except hpack.HPACKError as e:
                raise _ConnectionFailure(COMPRESSION_ERROR, f"HPACK: {e}") from e
            if modifies_table(block) or len(self._decoded) >= 64:
                self._decoded.clear()
            else:
                self._decoded[block] = headers
        return headers

    def _on_settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            raise _ConnectionFailure(FRAME_SIZE_ERROR, "SETTINGS of the wrong size")
        for i in range(0, len(payload), 6):
            ident, value = struct.unpack_from(">HL", payload, i)
            if ident == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionFailure(FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for call in self.calls.values():
                    call.send_window += delta
            elif ident == S_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= 16777215:
                    raise _ConnectionFailure(PROTOCOL_ERROR, "bad SETTINGS_MAX_FRAME_SIZE")
                self._peer_max_frame = value
            # HEADER_TABLE_SIZE: our header blocks never use the dynamic table. The others
            # concern streams we would open (none) or limits we stay far below.
        self._write(_frame(SETTINGS, ACK, 0))
        self._flush_blocked()

    def _on_window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionFailure(FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if not sid:
            if not increment:
                raise _ConnectionFailure(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise _ConnectionFailure(FLOW_CONTROL_ERROR, "connection window overflow")
            self._flush_blocked()
            return
        call = self.calls.get(sid)
        if call is not None:
            call.send_window += increment
            if call.pending:
                self._flush_blocked()

    # --- calls ---------------------------------------------------------------------------------

    async def _run(self, call: Call, method: Method) -> None:
        try:
            await method.handler(call)
        except asyncio.CancelledError:
            if not call.reset and not self.closed:
                # Cancelled by us (server stop): tell the client the stream is over.
                call.reset = True
                self._write(_frame(RST_STREAM, 0, call.id, _U32.pack(CANCEL)))
            self._forget(call)
            return
        except CallAbort as e:
            if not (call.reset or call.closed or self.closed):
                self._finish(call, _status_block(e.code, e.message))
            self._forget(call)
            return
        except Exception as e:
            if not (call.reset or call.closed or self.closed):
                log.exception("gRPC method failed")
                self._finish(call, _status_block(StatusCode.UNKNOWN, f"{type(e).__name__}"))
            self._forget(call)
            return
        if not (call.reset or call.closed or self.closed):
            self._finish(call, _OK_TRAILERS)
        if not call.pending:
            self._forget(call)

    def _fail_call(self, call: Call, code: StatusCode, message: str) -> None:
        """A bad message on a call: end it with a status, cancel its method."""
        if not call.closed:
            self._finish(call, _status_block(code, message))
        call.reset = True  # nothing more is read or written
        self._cancel(call)
        self._forget(call)

    def _finish(self, call: Call, status_block: bytes) -> None:
        block = status_block if call.headers_sent else _RESPONSE_HEADERS + status_block
        call.headers_sent = True
        frame = _frame(HEADERS, END_HEADERS | END_STREAM, call.id, block)
        if call.pending:
            call.pending.append((frame, True))  # after the DATA still waiting for window
        else:
            self._write(frame)
        call.closed = True

    def _forget(self, call: Call) -> None:
        if self.calls.get(call.id) is call and not call.pending:
            del self.calls[call.id]
            self.server.call_ended()

    def _cancel(self, call: Call) -> None:
        task = call.task
        if task is not None and not task.done():
            task.cancel()

    # --- frames out ----------------------------------------------------------------------------

    def send_message(self, call: Call, payload: bytes) -> None:
        n = len(payload)
        data = struct.pack(">BL", 0, n) + payload
        head = b""
        if not call.headers_sent:
            call.headers_sent = True
            head = _frame(HEADERS, END_HEADERS, call.id, _RESPONSE_HEADERS)
        size = n + 5
        if (
            not call.pending
            and size <= self.send_window
            and size <= call.send_window
            and size <= self._peer_max_frame
        ):
            self.send_window -= size
            call.send_window -= size
            self._write(head + _HEADER.pack(size >> 16, size & 0xFFFF, DATA, 0, call.id) + data)
            return
        if head:
            self._write(head)
        call.pending.append((data, False))
        self._blocked[call.id] = call
        self._flush_blocked()

    def _flush_blocked(self) -> None:
        """Send what the windows now allow, in the order the calls got blocked."""
        for sid, call in list(self._blocked.items()):
            while call.pending:
                data, is_frame = call.pending[0]
                if is_frame:  # the trailers, queued behind data: they need no window
                    call.pending.popleft()
                    self._write(data)
                    continue
                room = min(self.send_window, call.send_window, self._peer_max_frame)
                if room <= 0:
                    break
                chunk, rest = data[:room], data[room:]
                self.send_window -= len(chunk)
                call.send_window -= len(chunk)
                self._write(_frame(DATA, 0, sid, chunk))
                if rest:
                    call.pending[0] = (rest, False)
                else:
                    call.pending.popleft()
            if not call.pending:
                del self._blocked[sid]
                if call.closed or call.reset:
                    self._forget(call)

    def _write(self, data: bytes) -> None:
        if self._batching:
            self._out.append(data)
        elif self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _flush_out(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))

    def _goaway(self, code: int, why: str = "") -> None:
        if self._goaway_sent:
            return
        self._goaway_sent = True
        self._write(_frame(GOAWAY, 0, 0, struct.pack(">LL", self._last_id, code) + why.encode()))

    def _close(self) -> None:
        self.closed = True
        self._flush_out()
        if self.transport is not None:
            self.transport.close()

    def _fail(self, code: int, why: str) -> None:
        """A connection error: cancel every call, GOAWAY, and close a moment later. Closing at
        once, with the peer's bytes still unread, would make the kernel send a reset, which can
        destroy the GOAWAY before the peer reads it."""
        self._goaway(code, why)
        self.closed = True
        for call in list(self.calls.values()):
            self._cancel(call)
        self._flush_out()
        self.loop.call_later(0.1, self._close)

    # --- server stop ---------------------------------------------------------------------------

    def begin_shutdown(self) -> None:
        self._goaway(NO_ERROR)

    def abort(self) -> None:
        for call in list(self.calls.values()):
            self._cancel(call)
        self.loop.call_soon(self._close)


class H2Server:
    """Serves ``methods`` (gRPC path -> Method) on one TCP or Unix address."""

    def __init__(
        self,
        methods: dict[str, Method],
        *,
        max_message: int,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.methods = {path.encode(): m for path, m in methods.items()}
        self.max_message = max_message
        self.connections: set[_Connection] = set()
        self._servers: list[asyncio.Server] = []
        self._stopped = asyncio.Event()
        self._stopping = False
        self._idle = asyncio.Event()  # set, once stopping, when no call is left

    def call_ended(self) -> None:
        if self._stopping and not any(c.calls for c in self.connections):
            self._idle.set()

    async def listen(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen on host:port (port 0: any); returns the port."""
        server = await self.loop.create_server(
            lambda: _Connection(self), host, port, ssl=ssl_context, reuse_address=True
        )
        self._servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    async def listen_unix(self, path: str, ssl_context: ssl.SSLContext | None = None) -> None:
        server = await self.loop.create_unix_server(
            lambda: _Connection(self), path, ssl=ssl_context
        )
        self._servers.append(server)

    async def stop(self, grace: float) -> None:
        """Stop accepting, tell clients (GOAWAY), give open calls ``grace`` seconds, then
        cancel what is left and close every connection."""
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.begin_shutdown()
        self._stopping = True
        if any(c.calls for c in self.connections):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace)
        for conn in list(self.connections):
            conn.abort()
        await asyncio.sleep(0)  # let the cancelled calls unwind
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._stopped.set()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()
