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
grpc.aio server) stays available (``llm-extproc serve --transport grpc``) for comparison.

Theory of operation: a hostile peer. The peer is meant to be Envoy, but the server must hold
whatever a broken or hostile HTTP/2 client sends. Every resource a peer can make us spend is
bounded, and each bound is a constant below or an ``H2Server`` parameter (``H2Limits``; all of
them, with the reasons for their values, in docs/transport.md):

* Memory in: a stream may send at most one message's worth beyond what its method has read
  (the stream window, ``max_message`` + 5), and a connection at most ``connection_window``
  bytes beyond what all its methods have read. Bytes are credited back (WINDOW_UPDATE) only
  when a method reads the message they carried, or when the stream ends: what we buffer is
  exactly what the windows allow, and bytes beyond a window are a FLOW_CONTROL_ERROR. If the
  connection window fills with messages that are all incomplete (streams interleaved so that
  none can finish), nothing could ever be read again: the newest incomplete call is then
  ended with RESOURCE_EXHAUSTED until the oldest can complete (``_check_stall``).
* Memory out: bytes waiting for the peer's flow-control window, and bytes the transport holds
  because the peer does not read, are each bounded by ``send_queue`` (ENHANCE_YOUR_CALM above
  it); while the transport's buffer is above its high-water mark we stop reading the peer,
  so a peer that does not read cannot make us produce more (acks, refusals, answers).
* Headers: a HEADERS frame and a whole header block are at most ``MAX_HEADER_BLOCK`` bytes,
  checked from the frame header before the payload is buffered; a block is scanned before it
  is decoded (table-size updates only at its start and at most two, RFC 7541 4.2; at most
  ``MAX_HEADER_FIELDS`` fields), so decoding is bounded per block; blocks that leave the
  HPACK table alone are cached, ``HEADER_CACHE_BYTES`` in all.
* CPU: no frame costs work proportional to the number of calls (a SETTINGS change of the
  initial window is one assignment: each call's send window is kept relative to it; a window
  change flushes blocked calls once per batch of frames read, not once per frame). Frames
  that do nothing useful, and those that make us answer, are rate-limited per connection by
  token buckets (``_Budget``: RST_STREAM of streams we had not answered and refused streams,
  PING, SETTINGS, and empty or no-op frames), ENHANCE_YOUR_CALM when a bucket runs dry. The
  work done per read is bounded (``SLICE_WORK``): past it, the rest of the bytes wait for the
  next turn of the event loop, so other connections are served in between.
* Time and connections: the preface and first SETTINGS must arrive within
  ``handshake_timeout``; a connection with no open call for ``idle_timeout`` gets GOAWAY and is
  closed; while calls are open and the peer has been silent for ``ping_interval`` we PING it
  and close after ``ping_timeout`` without the ACK; TCP keepalive finds peers that vanished
  without a FIN; at most ``max_connections`` connections (more are closed at once) and
  ``max_streams`` open calls per connection (REFUSED_STREAM above).
* Nothing the peer sent is echoed: errors carry fixed messages, a ``grpc-message`` is at most
  ``MAX_GRPC_MESSAGE`` bytes, GOAWAY debug data is a fixed short string per error (the detail
  goes to our log), and no frame we send exceeds the peer's SETTINGS_MAX_FRAME_SIZE.

Writes: the frames that reading one batch of bytes produces (SETTINGS and PING acks, window
updates, refusals) go out in one ``write``; a call's answer goes out at once, headers and
message in one ``write``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import grpc
import hpack

__all__ = [
    "EOF",
    "Call",
    "CallAbort",
    "H2Limits",
    "H2Server",
    "H2Stats",
    "Method",
    "StatusCode",
    "modifies_table",
]

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
FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x6, 0x7, 0x8, 0x9
ENHANCE_YOUR_CALM = 0xB
# SETTINGS identifiers.
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 1, 2, 3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 4, 5, 6

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65535
DEFAULT_FRAME = 16384
# What we accept per frame. Fewer, larger frames for big request bodies; a frame is buffered
# whole before it is handled, so this is also what one connection's frame buffer can hold.
OUR_MAX_FRAME = 1 << 20

# --- header blocks ---------------------------------------------------------------------------
# Envoy's header block for an ext_proc stream is a few hundred bytes (pseudo-headers,
# content-type, te, a user agent); 8 KiB fits it dozens of times over, and bounds what one
# block costs to decode: ~3 ms in the worst case (Huffman strings, pure-Python HPACK, ~0.4 us
# a byte; 16 KiB would be ~6 ms, a visible stall for every other connection).
MAX_HEADER_BLOCK = 8 * 1024
# Announced as SETTINGS_MAX_HEADER_LIST_SIZE and enforced by the decoder (RFC 7541 sizes:
# name + value + 32 per field).
MAX_HEADER_LIST = MAX_HEADER_BLOCK
# Every field costs at least 32 bytes of header list: more fields than this cannot fit, and
# the scan refuses them before decoding.
MAX_HEADER_FIELDS = MAX_HEADER_LIST // 32
# CONTINUATION frames per header block: an honest block needs at most one (it fits a frame).
MAX_CONTINUATIONS = 16
# Decoded blocks kept per connection: key bytes, and per field its name and value plus
# HEADER_FIELD_COST for the Python objects around them (a tuple and two bytes objects, ~130
# bytes), so a block of many empty fields is counted for what it really holds.
HEADER_CACHE_BYTES = 64 * 1024
HEADER_FIELD_COST = 128

# --- outbound --------------------------------------------------------------------------------
# A grpc-message longer than this is cut (percent-encoded bytes): trailers always fit the
# smallest SETTINGS_MAX_FRAME_SIZE a peer may announce (16 KiB).
MAX_GRPC_MESSAGE = 1024
# The transport's write buffer: above HIGH we stop reading the peer until it is below LOW.
WRITE_HIGH = 256 * 1024
WRITE_LOW = 64 * 1024

# --- CPU per read ----------------------------------------------------------------------------
# Work handled per read callback before yielding to the event loop, in units of ~5 us: one per
# frame, and for a header block that must be decoded one per 8 bytes (pure-Python HPACK costs
# up to ~0.4 us a byte, Huffman strings the most) plus two per field (~8 us each), and eight
# for a call opened (its Call and task, and the task's first step in the next turn, ~40 us).
# A turn thus handles ~500 small frames (~2.5 ms), ~60 new calls, a few small blocks, or a
# single worst-case 8 KiB block (~3 ms, checked after it), and other connections are served
# in between: an exchange that needs two turns of the loop waits for at most two such slices
# per hostile connection. An honest read is a few frames, far below it (a burst of new
# streams yields every ~60 calls: two epoll_ctl calls per ~2.5 ms of work).
SLICE_WORK = 512
_DECODE_COST_SHIFT = 3
_CALL_WORK = 8
# SETTINGS entries per frame: the protocol defines six; more is a flood, not a configuration.
MAX_SETTINGS_ENTRIES = 32

# --- rate limits (token buckets per connection: burst, then per second) ------------------------
# RST_STREAM of a stream we had not yet answered, and streams refused: the rapid-reset pattern.
# Envoy resets ext_proc streams when clients leave and when streams are done (the 10,000-
# request disconnect storm of tests/e2e/test_faults.py: ~7,500 resets), but almost always
# after our first answer (it sends request headers at once and we answer in ~1 ms; 20 of those
# 7,500 came before it), so resets after an answer are free; the burst lets every stream of a
# connection go at once (``max_streams``).
RESET_RATE = 1000.0
PING_BURST, PING_RATE = 100, 10.0
SETTINGS_BURST, SETTINGS_RATE = 50, 5.0
# Empty DATA without END_STREAM, empty HEADERS/CONTINUATION, PRIORITY, unknown frame types,
# HEADERS for finished streams: frames that make us do work for nothing.
NOOP_BURST, NOOP_RATE = 100, 10.0

# --- time and connections --------------------------------------------------------------------
# Listen backlog: a reconnect storm (every Envoy worker at once, after a restart) must not
# overflow the accept queue (SYNs beyond it are retried after 1 s, Envoy's connect timeout).
BACKLOG = 4096
# TCP keepalive on accepted sockets: probes after 30 s of silence, every 5 s, 4 of them: a peer
# that vanished without a FIN is found within ~50 s and its calls (and slots) go back.
TCP_KEEPIDLE_S, TCP_KEEPINTVL_S, TCP_KEEPCNT = 30, 5, 4
# Unacknowledged data (or a zero window) for this long also ends a connection (Linux).
TCP_USER_TIMEOUT_MS = (TCP_KEEPIDLE_S + TCP_KEEPINTVL_S * TCP_KEEPCNT) * 1000
# After an idle GOAWAY (last stream 2^31-1, so streams in flight are still served), how long
# before the connection is closed.
IDLE_DRAIN_S = 1.0
# A closing connection whose peer does not read what is left is aborted after this long.
CLOSE_GRACE_S = 1.0
_KEEPALIVE_PING = b"llm-keep"

_HEADER = struct.Struct(">BHBBL")  # 24-bit length as (high byte, low 16 bits), type, flags, id
_U32 = struct.Struct(">L")
_SETTING = struct.Struct(">HL")

_PAUSED_FOR_WRITE, _PAUSED_FOR_SLICE = 1, 2
# A stall is looked for only once the peer can send (almost) nothing more: with bytes still
# on their way, incomplete messages may yet complete.
_STALL_WINDOW = 1024


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
# :status 415 (static name, literal value), for a request that is not gRPC.
_NOT_GRPC = _hpack_int(8, 4) + b"\x03415"


def _percent_encode(message: str) -> bytes:
    """grpc-message encoding: bytes outside 0x20-0x7E, and '%', as %XX; cut to
    MAX_GRPC_MESSAGE bytes, never inside an escape."""
    out = bytearray()
    for b in message.encode("utf-8"):
        piece = bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b
        if len(out) + len(piece) > MAX_GRPC_MESSAGE:
            break
        out += piece
    return bytes(out)


def _status_block(code: StatusCode, message: str) -> bytes:
    block = _literal(b"grpc-status", str(code.value[0]).encode())
    if message:
        block += _literal(b"grpc-message", _percent_encode(message))
    return block


_UNKNOWN_METHOD = _RESPONSE_HEADERS + _status_block(StatusCode.UNIMPLEMENTED, "unknown method")


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
        if shift > 28:  # no integer we accept needs more than 4 continuation bytes
            raise ValueError("HPACK integer too long")


class _BadBlock(ValueError):
    """A header block refused before decoding."""


def _scan_block(block: bytes) -> tuple[bool, int]:
    """Walk a header block's representations without decoding anything: refuse table-size
    updates that are not at its start or more than two of them (RFC 7541 4.2), and more
    fields than could fit MAX_HEADER_LIST. Returns whether decoding it changes the HPACK
    dynamic table (a literal with incremental indexing, or a size update), and its number of
    fields."""
    pos, n = 0, len(block)
    fields = updates = 0
    modifies = False
    try:
        while pos < n:
            b = block[pos]
            if b & 0x80:  # indexed field
                pos = _read_int(block, pos, 7)[1]
            elif b & 0xE0 == 0x20:  # dynamic table size update
                if fields:
                    raise _BadBlock("table size update after a field")
                updates += 1
                if updates > 2:
                    raise _BadBlock("more than two table size updates")
                modifies = True
                pos = _read_int(block, pos, 5)[1]
                continue
            else:  # a literal: 01xxxxxx indexes, 0000xxxx / 0001xxxx do not
                indexing = bool(b & 0x40)
                modifies = modifies or indexing
                index, pos = _read_int(block, pos, 6 if indexing else 4)
                if index == 0:
                    length, pos = _read_int(block, pos, 7)
                    pos += length
                length, pos = _read_int(block, pos, 7)
                pos += length
            fields += 1
            if fields > MAX_HEADER_FIELDS:
                raise _BadBlock("too many header fields")
    except IndexError:
        raise _BadBlock("truncated header block") from None
    except ValueError as e:
        if isinstance(e, _BadBlock):
            raise
        raise _BadBlock(str(e)) from None
    if pos != n:
        raise _BadBlock("truncated header block")
    return modifies, fields


def modifies_table(block: bytes) -> bool:
    """Whether decoding this header block changes the HPACK dynamic table (a literal with
    incremental indexing, or a table size update). Errs on the side of yes."""
    try:
        return _scan_block(block)[0]
    except _BadBlock:
        return True


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
        self.have = 0
        return joined

    def clear(self) -> None:
        self.parts = []
        self.have = 0


class _Budget:
    """A token bucket: ``burst`` tokens, refilled at ``rate`` per second."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, burst: float, rate: float, now: float) -> None:
        self.burst = burst
        self.rate = rate
        self.tokens = burst
        self.stamp = now

    def take(self, now: float) -> bool:
        tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if tokens < 1.0:
            self.tokens = tokens
            return False
        self.tokens = tokens - 1.0
        return True


class _ConnectionFailure(Exception):
    """A protocol error that ends the connection: GOAWAY with ``code`` and the fixed debug
    string ``why``; ``detail`` goes to our log only."""

    def __init__(self, code: int, why: str, detail: str = "") -> None:
        super().__init__(why)
        self.code = code
        self.why = why
        self.detail = detail


@dataclass(frozen=True, slots=True, kw_only=True)
class H2Limits:
    """The bounds of one server, resolved (see ``H2Server`` for the parameters and
    docs/transport.md for why each value)."""

    max_message: int
    max_streams: int
    max_connections: int
    stream_window: int  # announced INITIAL_WINDOW_SIZE: one whole message beyond what was read
    connection_window: int  # bytes a connection may have in flight beyond what was read
    send_queue: int
    handshake_timeout: float
    idle_timeout: float
    ping_interval: float
    ping_timeout: float


@dataclass(frozen=True, slots=True, kw_only=True)
class H2Stats:
    """A snapshot of what the server holds and what it refused, for tests and debugging."""

    connections: int
    calls: int
    buffered_bytes: int  # request bytes held: incomplete messages and messages not yet read
    queued_out_bytes: int  # answer bytes waiting for the peer's flow-control window
    write_buffer_bytes: int  # bytes the transports hold because the peer has not read them
    header_cache_bytes: int
    refused_connections: int
    refused_streams: int
    calm: int  # connections ended with ENHANCE_YOUR_CALM
    protocol_errors: int  # connections ended with another error
    timeouts: int  # connections ended by the handshake, idle or PING timeout
    stalls_broken: int  # calls ended because the connection window filled with partial messages


class _Counters:
    __slots__ = (
        "calm",
        "protocol_errors",
        "refused_connections",
        "refused_streams",
        "stalls_broken",
        "timeouts",
    )

    def __init__(self) -> None:
        self.refused_connections = 0
        self.refused_streams = 0
        self.calm = 0
        self.protocol_errors = 0
        self.timeouts = 0
        self.stalls_broken = 0


class Call:
    """One gRPC call (one HTTP/2 stream): the context object handed to a method."""

    __slots__ = (
        "_conn",
        "_deserialize",
        "_failure",
        "_messages",
        "_partial",
        "_reader",
        "_serialize",
        "closed",
        "eof",
        "headers_sent",
        "held",
        "id",
        "pending",
        "recv_credit",
        "recv_window",
        "reset",
        "send_delta",
        "task",
    )

    def __init__(
        self,
        conn: _Connection,
        stream_id: int,
        recv_window: int,
        deserialize: Callable[[bytes], Any],
        serialize: Callable[[Any], bytes],
    ) -> None:
        self._conn = conn
        self.id = stream_id
        # Our send window on this stream is the peer's initial window plus this (window
        # updates received minus bytes sent), so a SETTINGS change costs nothing per call.
        self.send_delta = 0
        self.recv_window = recv_window  # what the peer may still send on this stream
        self.recv_credit = 0  # bytes read by the method, not yet given back to the peer
        self.held = 0  # bytes of this stream's DATA we hold: partial message + unread messages
        self._deserialize = deserialize
        self._serialize = serialize
        self._partial = _Pieces()  # an incomplete message
        self._messages: deque[tuple[Any, int]] = deque()  # (message, its bytes on the wire)
        self._reader: asyncio.Future[Any] | None = None
        # A bad message behind good ones not read yet: raised by read() after them, in order.
        self._failure: CallAbort | None = None
        self.eof = False  # the client half-closed
        self.reset = False  # the stream was reset (by the client, or because of an error)
        self.closed = False  # we sent our END_STREAM
        self.headers_sent = False
        self.pending: deque[list[Any]] = deque()  # [bytes, offset, is_frame] waiting for window
        self.task: asyncio.Task[None] | None = None

    # --- what a method uses --------------------------------------------------------------------

    async def read(self) -> Any:
        """The next message, or ``EOF`` once the client has half-closed the stream."""
        if self._messages:
            message, size = self._messages.popleft()
            self._conn.consumed(self, size)
            return message
        if self._failure is not None:
            raise self._failure
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
        when it opens (up to the connection's ``send_queue``)."""
        if self.reset:
            return  # the client is gone (the task is being cancelled): nobody to write to
        if self.closed:
            raise asyncio.InvalidStateError("write on a finished call")
        payload = self._serialize(message)
        self._conn.send_message(self, payload)

    # --- fed by the connection -----------------------------------------------------------------

    def _deliver(self, message: Any, size: int) -> None:
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(message)
            self._conn.consumed(self, size)
        else:
            self._messages.append((message, size))

    def partial_need(self) -> int:
        """Bytes still missing from the incomplete message (0: none)."""
        return self._partial.need - self._partial.have if self._partial.parts else 0

    def on_data(self, data: bytes, max_message: int) -> bool:
        """Take DATA bytes (already counted in ``held``); returns whether an incomplete
        message remains."""
        if self._partial.parts:
            joined = self._partial.add(data)
            if joined is None:
                return True
            data = joined
        buf = data
        pos, n = 0, len(buf)
        need = 5
        while n - pos >= 5:
            compressed = buf[pos]
            length = _U32.unpack_from(buf, pos + 1)[0]
            if length > max_message:
                raise CallAbort(
                    StatusCode.RESOURCE_EXHAUSTED, f"message larger than {max_message} bytes"
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
                raise CallAbort(StatusCode.INTERNAL, "cannot parse the message") from e
            self._deliver(message, 5 + length)
            pos = end
        if pos < n:
            self._partial.keep(buf[pos:], need)
            return True
        return False

    def on_end_stream(self) -> None:
        self.eof = True
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(EOF)

    def fail_after_queued(self, failure: CallAbort) -> bool:
        """A bad message arrived: if good ones wait to be read, fail after them (as grpc.aio
        does) and drop the incomplete rest; returns whether it did (else: fail now)."""
        if not self._messages:
            return False
        self._failure = failure
        self._partial.clear()
        self.held = sum(size for _, size in self._messages)  # the rest is dropped
        return True

    def drop_input(self) -> int:
        """Forget every byte held (the stream is over); returns how many."""
        held = self.held
        self.held = 0
        self._messages.clear()
        self._partial.clear()
        return held


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
        limits = server.limits
        self.limits = limits
        self.transport: asyncio.Transport | None = None
        self._partial = _Pieces()  # an incomplete frame (or preface)
        self._preface = False
        self._settings_seen = False  # the client's first SETTINGS arrived (handshake done)
        self._decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_LIST)
        # Envoy sends the same header block for every ext_proc stream (only indexed fields and
        # a literal :path). Blocks that leave the dynamic table alone decode the same way until
        # the table changes: cache them, and forget them all when it does.
        self._decoded: dict[bytes, list[tuple[bytes, bytes]]] = {}
        self._decoded_bytes = 0
        self.calls: dict[int, Call] = {}
        self._last_id = 0
        self._headers_for: int = 0  # a stream whose header block continues in CONTINUATION
        self._headers_block = bytearray()
        self._headers_end_stream = False
        self._headers_frames = 0
        # Sending.
        self.send_window = DEFAULT_WINDOW
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame = DEFAULT_FRAME
        self._blocked: dict[int, Call] = {}  # calls with DATA waiting for window, in order
        self.queued_out = 0  # bytes in those calls' pending DATA
        self._flush_wanted = False  # a window grew: flush blocked calls at the end of the batch
        # Receiving: invariant recv_window + credit + buffered == connection_window.
        self._recv_window = DEFAULT_WINDOW  # what the peer may still send (until our update)
        self._credit = 0  # bytes read (or dropped), not yet given back to the peer
        self.buffered = 0  # bytes held in calls: partial messages and messages not yet read
        self._partials: dict[int, Call] = {}  # calls holding an incomplete message, oldest first
        self._credit_at = max(1, limits.connection_window // 4)
        self._stream_credit_at = max(1, limits.stream_window // 2)
        # Out.
        self._out: list[bytes] = []
        self._batching = False  # while frames are read: what they make goes out in one write
        self._paused = 0  # why reading is paused (_PAUSED_FOR_*)
        self._backlog: bytes | None = None  # bytes read but left for the next turn of the loop
        self._work = 0
        # Rate limits.
        now = self.loop.time()
        self._resets = _Budget(max(limits.max_streams, 100), RESET_RATE, now)
        self._pings = _Budget(PING_BURST, PING_RATE, now)
        self._settings_budget = _Budget(SETTINGS_BURST, SETTINGS_RATE, now)
        self._noop = _Budget(NOOP_BURST, NOOP_RATE, now)
        # Time: the server's tick reads these (``tick``).
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._rx = 0  # reads so far; the tick notices a change
        self._rx_seen = 0
        self._heard_at = now
        self._ping_sent_at: float | None = None
        self._seen_id = 0
        self._idle_since = now
        self._draining_since: float | None = None
        self._goaway_sent = False
        self.closed = False
        self._lost = False

    # --- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        server = self.server
        limits = self.limits
        if len(server.connections) >= limits.max_connections:
            server.counters.refused_connections += 1
            self.closed = True
            transport.close()
            return
        server.connections.add(self)
        _keepalive(transport)
        with contextlib.suppress(AttributeError, ValueError):
            transport.set_write_buffer_limits(high=WRITE_HIGH, low=WRITE_LOW)  # type: ignore[attr-defined]
        settings = struct.pack(
            ">HLHLHLHL",
            S_MAX_CONCURRENT_STREAMS,
            limits.max_streams,
            S_INITIAL_WINDOW_SIZE,
            limits.stream_window,
            S_MAX_FRAME_SIZE,
            OUR_MAX_FRAME,
            S_MAX_HEADER_LIST_SIZE,
            MAX_HEADER_LIST,
        )
        self._write(_frame(SETTINGS, 0, 0, settings))
        grow = limits.connection_window - DEFAULT_WINDOW
        if grow > 0:
            self._write(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(grow)))
        self._recv_window = limits.connection_window
        self._handshake_timer = self.loop.call_later(
            limits.handshake_timeout, self._handshake_expired
        )

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return  # failed: what still arrives is read and dropped until we close
        if self._backlog is not None:  # read while we paused for the backlog: keep the order
            self._backlog += data
            return
        self._rx += 1
        self._batching = True
        self._work = 0
        try:
            self._data_received(data)
            if self._flush_wanted and not self.closed:
                self._flush_wanted = False
                self._flush_blocked()
            if self._partials and self._recv_window < _STALL_WINDOW:
                self._check_stall()
        except _ConnectionFailure as e:
            self._failed(e)
        except Exception:
            log.exception("HTTP/2 connection failed")
            self._fail(INTERNAL_ERROR, "internal error")
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
        if not self._preface:
            if len(data) < len(PREFACE):
                if not PREFACE.startswith(data):
                    raise _ConnectionFailure(PROTOCOL_ERROR, "bad preface")
                self._partial.keep(data, len(PREFACE))
                return
            if not data.startswith(PREFACE):
                raise _ConnectionFailure(PROTOCOL_ERROR, "bad preface")
            self._preface = True
            data = data[len(PREFACE) :]
        pos, n = 0, len(data)
        unpack = _HEADER.unpack_from
        need = 9
        while n - pos >= 9:
            hi, lo, ftype, flags, sid = unpack(data, pos)
            length = hi << 16 | lo
            if length > MAX_HEADER_BLOCK:
                # Checked from the frame header, before the payload is buffered.
                if length > OUR_MAX_FRAME:
                    raise _ConnectionFailure(FRAME_SIZE_ERROR, "frame too large", f"{length} bytes")
                if ftype == HEADERS or ftype == CONTINUATION:
                    raise _ConnectionFailure(
                        ENHANCE_YOUR_CALM, "header block too large", f"frame of {length} bytes"
                    )
                if ftype == DATA and length > self._recv_window:
                    raise _ConnectionFailure(
                        FLOW_CONTROL_ERROR, "flow control", f"DATA of {length} bytes"
                    )
            end = pos + 9 + length
            if end > n:
                need = 9 + length
                break
            self._on_frame(ftype, flags, sid & 0x7FFFFFFF, data[pos + 9 : end])
            pos = end
            if self.closed:
                return
            self._work += 1
            if self._work >= SLICE_WORK and pos < n:
                # Enough for one turn: the rest waits, so other connections get theirs.
                self._backlog = data[pos:]
                self._pause(_PAUSED_FOR_SLICE)
                self.loop.call_soon(self._resume_backlog)
                return
        if pos < n:
            self._partial.keep(data[pos:], need)

    def _resume_backlog(self) -> None:
        backlog, self._backlog = self._backlog, None
        if backlog is not None and not self.closed:
            self.data_received(backlog)
        if self._backlog is None:
            self._unpause(_PAUSED_FOR_SLICE)

    def pause_writing(self) -> None:
        # The peer reads slower than we write: stop reading it, so that it cannot make us
        # write more (acks, refusals, answers to new streams) until it catches up.
        self._pause(_PAUSED_FOR_WRITE)

    def resume_writing(self) -> None:
        self._unpause(_PAUSED_FOR_WRITE)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._lost = True
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        self.server.connections.discard(self)
        for call in list(self.calls.values()):
            self._cancel(call)
            call.drop_input()
        self.calls.clear()
        self._blocked.clear()
        self._partials.clear()
        self.buffered = 0
        self.queued_out = 0
        self._decoded.clear()
        self._decoded_bytes = 0
        self._backlog = None
        self._partial.clear()
        self.server.call_ended()

    # --- frames in -----------------------------------------------------------------------------

    def _on_frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if self._headers_for and ftype != CONTINUATION:
            raise _ConnectionFailure(PROTOCOL_ERROR, "expected CONTINUATION")
        if ftype == DATA:
            self._on_data(flags, sid, payload)
        elif ftype == HEADERS:
            self._on_headers(flags, sid, payload)
        elif not self._settings_seen and ftype != SETTINGS:
            raise _ConnectionFailure(PROTOCOL_ERROR, "expected SETTINGS")
        elif ftype == CONTINUATION:
            self._on_continuation(flags, sid, payload)
        elif ftype == RST_STREAM:
            self._on_rst_stream(sid, payload)
        elif ftype == SETTINGS:
            self._on_settings(flags, sid, payload)
        elif ftype == PING:
            self._on_ping(flags, sid, payload)
        elif ftype == WINDOW_UPDATE:
            self._on_window_update(sid, payload)
        elif ftype == GOAWAY:
            pass  # the peer opens no more streams; those open finish as usual
        elif ftype == PUSH_PROMISE:
            raise _ConnectionFailure(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        else:
            # PRIORITY and unknown frame types are ignored (RFC 9113 section 5.5), but not for
            # free.
            self._take(self._noop, "too many no-op frames")

    def _take(self, budget: _Budget, why: str) -> None:
        if not budget.take(self.loop.time()):
            raise _ConnectionFailure(ENHANCE_YOUR_CALM, why)

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        if not self._settings_seen:
            raise _ConnectionFailure(PROTOCOL_ERROR, "expected SETTINGS")
        if not sid:
            raise _ConnectionFailure(PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        self._recv_window -= size
        if self._recv_window < 0:
            raise _ConnectionFailure(FLOW_CONTROL_ERROR, "flow control", "connection window")
        call = self.calls.get(sid)
        if call is None or call.eof or call.reset:
            if sid > self._last_id:
                raise _ConnectionFailure(PROTOCOL_ERROR, "DATA on an idle stream")
            # A stream we have finished (or reset): its bytes count, and go back at once.
            self._give_back(size)
            if not size and not flags & END_STREAM:
                self._take(self._noop, "too many empty frames")
            return
        call.recv_window -= size
        if call.recv_window < 0:
            self._give_back(size)
            self._reset_call(call, FLOW_CONTROL_ERROR)
            return
        if call._failure is not None:
            # Input after a bad message is dropped, and its window goes back (stream and
            # connection): the client can finish sending, while the method reads the good
            # messages before it and the answer waits for the client's own window.
            self._give_back(size)
            call.recv_credit += size
            if call.recv_credit >= self._stream_credit_at:
                self._announce_stream(call)
            if flags & END_STREAM:
                call.on_end_stream()
            return
        content = payload
        if flags & PADDED:
            if not payload or payload[0] >= size:
                raise _ConnectionFailure(PROTOCOL_ERROR, "bad padding")
            content = payload[1 : size - payload[0]]
            self._give_back(size - len(content))
            call.recv_credit += size - len(content)
        if content:
            n = len(content)
            self.buffered += n
            call.held += n
            try:
                partial = call.on_data(content, self.limits.max_message)
            except CallAbort as e:
                self._partials.pop(sid, None)
                held = call.held
                if call.fail_after_queued(e):
                    dropped = held - call.held  # the bad message and what follows it
                    self.buffered -= dropped
                    self._give_back(dropped)
                    call.recv_credit += dropped
                    if call.recv_credit >= self._stream_credit_at:
                        self._announce_stream(call)
                else:
                    # One loop turn first: a method that the message before this one woke may
                    # still write its answer (grpc.aio sends it); then the call fails. Failing
                    # at once lost that answer now and then (tests/service/test_h2_fuzz.py).
                    # Meanwhile its input is dropped, and a read raises the failure.
                    call._failure = e
                    self.loop.call_soon(self._fail_soon, call)
                return
            if partial:
                self._partials[sid] = call
                need = call.partial_need()
                # The stream must be able to finish its message: give back what was read.
                if need > call.recv_window and call.recv_credit:
                    self._announce_stream(call)
                if need > self._recv_window and self._credit:
                    self._announce()
            elif self._partials:
                self._partials.pop(sid, None)
        elif not flags & END_STREAM:
            self._take(self._noop, "too many empty frames")
        if flags & END_STREAM:
            self._partials.pop(sid, None)
            call.on_end_stream()

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        if not self._settings_seen:
            raise _ConnectionFailure(PROTOCOL_ERROR, "expected SETTINGS")
        if not sid:
            raise _ConnectionFailure(PROTOCOL_ERROR, "HEADERS on stream 0")
        if flags & PADDED:
            pad = payload[0] if payload else 256
            if pad >= len(payload):
                raise _ConnectionFailure(PROTOCOL_ERROR, "bad padding")
            payload = payload[1 : len(payload) - pad]
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise _ConnectionFailure(FRAME_SIZE_ERROR, "bad HEADERS")
            payload = payload[5:]
        if not payload:
            self._take(self._noop, "too many empty frames")
        if flags & END_HEADERS:
            self._on_header_block(sid, payload, bool(flags & END_STREAM))
        else:
            self._headers_for = sid
            self._headers_block = bytearray(payload)
            self._headers_end_stream = bool(flags & END_STREAM)
            self._headers_frames = 1

    def _on_continuation(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != self._headers_for or not sid:
            raise _ConnectionFailure(PROTOCOL_ERROR, "unexpected CONTINUATION")
        if not payload:
            self._take(self._noop, "too many empty frames")
        self._headers_frames += 1
        if self._headers_frames > MAX_CONTINUATIONS + 1:
            raise _ConnectionFailure(ENHANCE_YOUR_CALM, "too many CONTINUATION frames")
        self._headers_block += payload
        if len(self._headers_block) > MAX_HEADER_BLOCK:
            raise _ConnectionFailure(ENHANCE_YOUR_CALM, "header block too large")
        if flags & END_HEADERS:
            self._headers_for = 0
            block, self._headers_block = bytes(self._headers_block), bytearray()
            self._on_header_block(sid, block, self._headers_end_stream)

    def _on_header_block(self, sid: int, block: bytes, end_stream: bool) -> None:
        headers = self.decode_headers(block)
        call = self.calls.get(sid)
        if call is not None:
            # Trailers of a stream in progress (gRPC clients send none): they must end it.
            if end_stream:
                self._partials.pop(sid, None)
                call.on_end_stream()
            elif not call.reset:
                self._reset_call(call, PROTOCOL_ERROR)
            return
        if sid <= self._last_id:
            # A late block for a stream we have finished: decoded (the HPACK table must stay
            # in step), then dropped.
            self._take(self._noop, "too many frames for closed streams")
            return
        if sid % 2 == 0:
            raise _ConnectionFailure(PROTOCOL_ERROR, "even stream id from a client")
        self._last_id = sid
        if self._goaway_sent or len(self.calls) >= self.limits.max_streams:
            self.server.counters.refused_streams += 1
            self._take(self._resets, "too many refused streams")
            self._write(_frame(RST_STREAM, 0, sid, _U32.pack(REFUSED_STREAM)))
            return
        path = b""
        content_type = b""
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b"content-type":
                content_type = value
        if not content_type.startswith(b"application/grpc"):
            self._write(_frame(HEADERS, END_HEADERS | END_STREAM, sid, _NOT_GRPC))
            return
        method = self.server.methods.get(path)
        if method is None:
            # A fixed message: nothing the peer sent is echoed back.
            self._write(_frame(HEADERS, END_HEADERS | END_STREAM, sid, _UNKNOWN_METHOD))
            return
        call = Call(self, sid, self.limits.stream_window, method.deserialize, method.serialize)
        self.calls[sid] = call
        self._work += _CALL_WORK
        if end_stream:
            call.on_end_stream()
        call.task = self.loop.create_task(self._run(call, method))

    def decode_headers(self, block: bytes) -> list[tuple[bytes, bytes]]:
        headers = self._decoded.get(block)
        if headers is not None:
            return headers
        try:
            modifies, fields = _scan_block(block)
        except _BadBlock as e:
            raise _ConnectionFailure(COMPRESSION_ERROR, "compression error", str(e)) from None
        self._work += (len(block) >> _DECODE_COST_SHIFT) + 2 * fields
        try:
            headers = cast(list[tuple[bytes, bytes]], self._decoder.decode(block, raw=True))
        except (hpack.HPACKError, ValueError, IndexError) as e:
            raise _ConnectionFailure(
                COMPRESSION_ERROR, "compression error", type(e).__name__
            ) from None
        if modifies:
            self._decoded.clear()
            self._decoded_bytes = 0
        else:
            cost = len(block) + sum(len(k) + len(v) + HEADER_FIELD_COST for k, v in headers)
            if self._decoded_bytes + cost > HEADER_CACHE_BYTES:
                self._decoded.clear()
                self._decoded_bytes = 0
            if cost <= HEADER_CACHE_BYTES:
                self._decoded[block] = headers
                self._decoded_bytes += cost
        return headers

    def _on_rst_stream(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionFailure(FRAME_SIZE_ERROR, "bad RST_STREAM")
        if not sid:
            raise _ConnectionFailure(PROTOCOL_ERROR, "RST_STREAM on stream 0")
        call = self.calls.get(sid)
        if call is None:
            if sid > self._last_id:
                raise _ConnectionFailure(PROTOCOL_ERROR, "RST_STREAM on an idle stream")
            return
        if not call.headers_sent:
            # Reset before we answered anything: the rapid-reset pattern, rate-limited.
            self._take(self._resets, "too many resets")
        call.reset = True
        self._drop_output(call)
        self._cancel(call)
        self._end(call)

    def _on_settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid:
            raise _ConnectionFailure(PROTOCOL_ERROR, "SETTINGS on a stream")
        self._take(self._settings_budget, "too many SETTINGS")
        if flags & ACK:
            if payload:
                raise _ConnectionFailure(FRAME_SIZE_ERROR, "bad SETTINGS")
            return
        if len(payload) % 6:
            raise _ConnectionFailure(FRAME_SIZE_ERROR, "bad SETTINGS")
        if len(payload) > MAX_SETTINGS_ENTRIES * 6:
            raise _ConnectionFailure(ENHANCE_YOUR_CALM, "too many settings")
        for ident, value in _SETTING.iter_unpack(payload):
            if ident == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionFailure(FLOW_CONTROL_ERROR, "bad SETTINGS")
                if value > self._peer_initial_window and self._blocked:
                    self._flush_wanted = True  # once, at the end of the batch
                self._peer_initial_window = value
            elif ident == S_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= 16777215:
                    raise _ConnectionFailure(PROTOCOL_ERROR, "bad SETTINGS")
                self._peer_max_frame = value
            elif ident == S_ENABLE_PUSH and value > 1:
                raise _ConnectionFailure(PROTOCOL_ERROR, "bad SETTINGS")
            # HEADER_TABLE_SIZE: our header blocks never use the dynamic table. The others
            # concern streams we would open (none) or limits we stay far below.
        self._write(_frame(SETTINGS, ACK, 0))
        if not self._settings_seen:
            self._settings_seen = True
            if self._handshake_timer is not None:
                self._handshake_timer.cancel()
                self._handshake_timer = None

    def _on_ping(self, flags: int, sid: int, payload: bytes) -> None:
        if sid:
            raise _ConnectionFailure(PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise _ConnectionFailure(FRAME_SIZE_ERROR, "bad PING")
        self._take(self._pings, "too many PINGs")
        if flags & ACK:
            if payload == _KEEPALIVE_PING:
                self._ping_sent_at = None
            return
        self._write(_frame(PING, ACK, 0, payload))

    def _on_window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionFailure(FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if not sid:
            if not increment:
                raise _ConnectionFailure(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise _ConnectionFailure(FLOW_CONTROL_ERROR, "flow control", "window overflow")
            if self._blocked:
                self._flush_wanted = True  # once, at the end of the batch
            return
        call = self.calls.get(sid)
        if call is None:
            if sid > self._last_id:
                raise _ConnectionFailure(PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
            return  # a stream we have finished: updates may still be in flight (RFC 9113 6.9)
        if call.reset:
            return
        if not increment:
            self._reset_call(call, PROTOCOL_ERROR)
            return
        if self._peer_initial_window + call.send_delta + increment > MAX_WINDOW:
            self._reset_call(call, FLOW_CONTROL_ERROR)
            return
        call.send_delta += increment
        if call.pending:
            self._flush_call(call)  # only what this update unblocks

    # --- receive windows -----------------------------------------------------------------------

    def consumed(self, call: Call, size: int) -> None:
        """A method read a message of ``size`` bytes: give them back to the peer."""
        self.buffered -= size
        call.held -= size
        self._give_back(size)
        if not call.eof and not call.reset:
            call.recv_credit += size
            if call.recv_credit >= self._stream_credit_at or call._partial.parts:
                self._announce_stream(call)

    def _give_back(self, size: int) -> None:
        """Bytes no longer held (read, dropped, or padding): the connection may send them
        again. Announced in batches, or at once when the peer's window runs low."""
        self._credit += size
        if self._credit >= self._credit_at or self._recv_window < self.limits.stream_window:
            self._announce()

    def _announce(self) -> None:
        if self._credit and not self.closed:
            self._write(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._credit)))
            self._recv_window += self._credit
        self._credit = 0

    def _announce_stream(self, call: Call) -> None:
        if call.recv_credit and not self.closed:
            self._write(_frame(WINDOW_UPDATE, 0, call.id, _U32.pack(call.recv_credit)))
            call.recv_window += call.recv_credit
        call.recv_credit = 0

    def _check_stall(self) -> None:
        """The connection window is used up and some calls hold incomplete messages.
        If none of them can complete with the windows the peer has, and no complete message
        is waiting to be read (reading it gives window back), nothing can ever move: end the
        newest incomplete calls (RESOURCE_EXHAUSTED) until the oldest can complete."""
        self._announce()
        partials = self._partials
        partial_bytes = 0
        for call in partials.values():
            need = call.partial_need()
            if need <= self._recv_window and need <= call.recv_window + call.recv_credit:
                return  # it can finish
            partial_bytes += call._partial.have
        if self.buffered > partial_bytes:
            return  # complete messages wait to be read: reading them gives window back
        oldest = next(iter(partials.values()))
        while len(partials) > 1:
            need = oldest.partial_need()
            if need <= self._recv_window and need <= oldest.recv_window + oldest.recv_credit:
                break
            newest = next(reversed(partials.values()))
            self.server.counters.stalls_broken += 1
            self._fail_call(newest, StatusCode.RESOURCE_EXHAUSTED, "receive buffer full")
            self._announce()
        if oldest.recv_credit:
            self._announce_stream(oldest)

    # --- calls ---------------------------------------------------------------------------------

    async def _run(self, call: Call, method: Method) -> None:
        try:
            await method.handler(call)
        except asyncio.CancelledError:
            if not call.reset and not self.closed:
                # Cancelled by us (server stop): tell the client the stream is over.
                call.reset = True
                self._write(_frame(RST_STREAM, 0, call.id, _U32.pack(CANCEL)))
            self._end(call)
            return
        except CallAbort as e:
            if not (call.reset or call.closed or self.closed):
                self._finish(call, _status_block(e.code, e.message))
            self._end(call)
            return
        except Exception as e:
            if not (call.reset or call.closed or self.closed):
                log.exception("gRPC method failed")
                self._finish(call, _status_block(StatusCode.UNKNOWN, f"{type(e).__name__}"))
            self._end(call)
            return
        if not (call.reset or call.closed or self.closed):
            self._finish(call, _OK_TRAILERS)
        self._end(call)

    def _fail_call(self, call: Call, code: StatusCode, message: str) -> None:
        """End a call with a status (a bad message, or no room): trailers, then RST_STREAM
        NO_ERROR so the client stops sending; cancel its method."""
        self._drop_output(call)
        if not call.closed:
            self._finish(call, _status_block(code, message))
        if not call.eof:
            self._write(_frame(RST_STREAM, 0, call.id, _U32.pack(NO_ERROR)))
        call.reset = True  # nothing more is read or written
        self._cancel(call)
        self._end(call)

    def _fail_soon(self, call: Call) -> None:
        failure = call._failure
        if self.closed or call.reset or call.closed or self.calls.get(call.id) is not call:
            return  # over already: the method met the failure in a read, or the peer left
        assert failure is not None
        self._fail_call(call, failure.code, failure.message)

    def _reset_call(self, call: Call, code: int) -> None:
        """A stream error: RST_STREAM with ``code``, and the call is over."""
        self._drop_output(call)
        self._write(_frame(RST_STREAM, 0, call.id, _U32.pack(code)))
        call.reset = True
        self._cancel(call)
        self._end(call)

    def _finish(self, call: Call, status_block: bytes) -> None:
        block = status_block if call.headers_sent else _RESPONSE_HEADERS + status_block
        call.headers_sent = True
        frame = _frame(HEADERS, END_HEADERS | END_STREAM, call.id, block)
        if call.pending:
            call.pending.append([frame, 0, True])  # after the DATA still waiting for window
        else:
            self._write(frame)
        call.closed = True

    def _end(self, call: Call) -> None:
        """The call is over for us once its output is out: forget it and give back what it
        held. A call that answered before the client finished sending is reset (NO_ERROR),
        so that the client stops (RFC 9113 8.1)."""
        if call.pending or self.calls.get(call.id) is not call:
            return
        del self.calls[call.id]
        if self._partials:
            self._partials.pop(call.id, None)
        held = call.drop_input()
        if held:
            self.buffered -= held
            self._give_back(held)
        if call.closed and not call.eof and not call.reset:
            call.reset = True
            self._write(_frame(RST_STREAM, 0, call.id, _U32.pack(NO_ERROR)))
        self.server.call_ended()

    def _drop_output(self, call: Call) -> None:
        if call.pending:
            for data, offset, is_frame in call.pending:
                if not is_frame:
                    self.queued_out -= len(data) - offset
            call.pending.clear()
        self._blocked.pop(call.id, None)

    def _cancel(self, call: Call) -> None:
        task = call.task
        if task is not None and not task.done():
            task.cancel()

    # --- frames out ----------------------------------------------------------------------------

    def send_message(self, call: Call, payload: bytes) -> None:
        if self.closed:
            return
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
            and size <= self._peer_initial_window + call.send_delta
            and size <= self._peer_max_frame
        ):
            self.send_window -= size
            call.send_delta -= size
            self._write(head + _HEADER.pack(size >> 16, size & 0xFFFF, DATA, 0, call.id) + data)
            return
        if head:
            self._write(head)
        call.pending.append([data, 0, False])
        self.queued_out += size
        self._blocked[call.id] = call
        self._flush_call(call)
        if self.queued_out > self.limits.send_queue:
            self._failed(_ConnectionFailure(ENHANCE_YOUR_CALM, "send queue full"))

    def _flush_blocked(self) -> None:
        """Send what the windows now allow, in the order the calls got blocked; stop when the
        connection window is used up."""
        for call in list(self._blocked.values()):
            if self.send_window <= 0 or self.closed:
                break
            self._flush_call(call)

    def _flush_call(self, call: Call) -> None:
        pending = call.pending
        while pending:
            entry = pending[0]
            data, offset, is_frame = entry
            if is_frame:  # the trailers, queued behind data: they need no window
                pending.popleft()
                self._write(data)
                continue
            room = min(
                self.send_window,
                self._peer_initial_window + call.send_delta,
                self._peer_max_frame,
            )
            if room <= 0:
                break
            chunk = data[offset : offset + room]
            n = len(chunk)
            self.send_window -= n
            call.send_delta -= n
            self.queued_out -= n
            self._write(_frame(DATA, 0, call.id, chunk))
            if offset + n < len(data):
                entry[1] = offset + n
            else:
                pending.popleft()
        if not pending:
            self._blocked.pop(call.id, None)
            if call.closed or call.reset:
                self._end(call)

    def _write(self, data: bytes) -> None:
        if self._batching:
            self._out.append(data)
        else:
            transport = self.transport
            if transport is not None and not transport.is_closing():
                transport.write(data)
                if self._paused & _PAUSED_FOR_WRITE:
                    self._check_write_buffer()

    def _flush_out(self) -> None:
        out, self._out = self._out, []
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(b"".join(out))
            if self._paused & _PAUSED_FOR_WRITE:
                self._check_write_buffer()

    def _check_write_buffer(self) -> None:
        """While the peer does not read, what it leaves in our transport is bounded too."""
        assert self.transport is not None
        if self.transport.get_write_buffer_size() > self.limits.send_queue and not self.closed:
            self.server.counters.calm += 1
            log.warning("closing an HTTP/2 connection (write buffer full): the peer does not read")
            self._abort()

    def _pause(self, why: int) -> None:
        transport = self.transport
        if not self._paused and transport is not None and not transport.is_closing():
            transport.pause_reading()
        self._paused |= why

    def _unpause(self, why: int) -> None:
        was = self._paused
        self._paused &= ~why
        transport = self.transport
        if was and not self._paused and transport is not None and not transport.is_closing():
            transport.resume_reading()

    def _goaway(self, code: int, why: str = "", last_id: int | None = None) -> None:
        """GOAWAY naming the last stream we serve; with ``last_id`` (the first of two, when
        idle) it announces the end but new streams are still taken until the final one."""
        if self._goaway_sent:
            return
        if last_id is None:
            self._goaway_sent = True
            last_id = self._last_id
        self._write(_frame(GOAWAY, 0, 0, struct.pack(">LL", last_id, code) + why.encode()))

    def _close(self) -> None:
        self.closed = True
        self._flush_out()
        if self.transport is not None:
            self.transport.close()
            # A peer that does not read keeps a closing transport open: abort it then.
            self.loop.call_later(CLOSE_GRACE_S, self._abort)

    def _abort(self) -> None:
        self.closed = True
        if self.transport is not None and not self._lost:
            self.transport.abort()

    def _failed(self, e: _ConnectionFailure) -> None:
        log.warning("closing an HTTP/2 connection (%s): %s", e.why, e.detail[:200])
        counters = self.server.counters
        if e.code == ENHANCE_YOUR_CALM:
            counters.calm += 1
        else:
            counters.protocol_errors += 1
        self._fail(e.code, e.why)

    def _fail(self, code: int, why: str) -> None:
        """A connection error: cancel every call, GOAWAY, and close a moment later. Closing at
        once, with the peer's bytes still unread, would make the kernel send a reset, which can
        destroy the GOAWAY before the peer reads it."""
        if self.closed:
            return
        self._goaway(code, why)
        self.closed = True
        for call in list(self.calls.values()):
            self._cancel(call)
        self._flush_out()
        self.loop.call_later(0.1, self._close)

    # --- time ----------------------------------------------------------------------------------

    def _handshake_expired(self) -> None:
        self._handshake_timer = None
        if not self._settings_seen and not self.closed:
            self.server.counters.timeouts += 1
            log.warning("closing an HTTP/2 connection: no preface and SETTINGS in time")
            self._fail(PROTOCOL_ERROR, "handshake timeout")

    def tick(self, now: float) -> None:
        """Called by the server on every tick (at most a second apart): idle connections,
        silent peers."""
        if self.closed:
            return
        limits = self.limits
        if self._draining_since is not None:
            if not self.calls and now - self._draining_since >= IDLE_DRAIN_S:
                self._goaway(NO_ERROR, "idle")  # final: names the last stream served
                self._close()
                return
        elif self.calls or self._last_id != self._seen_id:
            self._seen_id = self._last_id
            self._idle_since = now
        elif now - self._idle_since >= limits.idle_timeout:
            # Two steps (RFC 9113 6.8): a first GOAWAY naming the highest possible stream, so
            # that streams already on their way are still served; the close comes later.
            self.server.counters.timeouts += 1
            self._goaway(NO_ERROR, "idle", last_id=MAX_WINDOW)
            self._draining_since = now
            return
        if self._rx != self._rx_seen:
            self._rx_seen = self._rx
            self._heard_at = now
        if self._ping_sent_at is not None:
            if now - self._ping_sent_at >= limits.ping_timeout:
                self.server.counters.timeouts += 1
                log.warning("closing an HTTP/2 connection: no PING ACK in time")
                for call in list(self.calls.values()):
                    self._cancel(call)
                self._abort()
        elif self.calls and now - self._heard_at >= limits.ping_interval:
            self._ping_sent_at = now
            self._write(_frame(PING, 0, 0, _KEEPALIVE_PING))

    # --- server stop ---------------------------------------------------------------------------

    def begin_shutdown(self) -> None:
        self._goaway(NO_ERROR)

    def abort(self) -> None:
        for call in list(self.calls.values()):
            self._cancel(call)
        self.loop.call_soon(self._close)


def _keepalive(transport: asyncio.BaseTransport) -> None:
    """TCP keepalive on an accepted TCP socket (not a Unix one): a peer that vanished without
    a FIN (a node lost, a cable pulled) is noticed, and its calls end."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (
        ("TCP_KEEPIDLE", TCP_KEEPIDLE_S),
        ("TCP_KEEPINTVL", TCP_KEEPINTVL_S),
        ("TCP_KEEPCNT", TCP_KEEPCNT),
        ("TCP_USER_TIMEOUT", TCP_USER_TIMEOUT_MS),
    ):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, option, value in options:
        with contextlib.suppress(OSError):
            sock.setsockopt(level, option, value)


class H2Server:
    """Serves ``methods`` (gRPC path -> Method) on TCP or Unix addresses.

    ``max_message``: the largest gRPC message accepted (RESOURCE_EXHAUSTED above); a stream may
    send one message beyond what its method read. ``max_streams``: open calls per connection
    (announced, REFUSED_STREAM above). ``max_connections``: more are closed at once.
    ``connection_window``: request bytes a connection may have buffered (default 4 messages).
    ``send_queue``: answer bytes a connection may hold for a peer that does not take them
    (window closed, or not reading; default 4 messages). ``handshake_timeout``: for the
    preface and first SETTINGS. ``idle_timeout``: a connection without calls this long is
    closed. ``ping_interval`` / ``ping_timeout``: with calls open and the peer silent this
    long we PING it, and close without the ACK in time.
    """

    def __init__(
        self,
        methods: dict[str, Method],
        *,
        max_message: int,
        max_streams: int = 4096,
        max_connections: int = 256,
        connection_window: int | None = None,
        send_queue: int | None = None,
        handshake_timeout: float = 5.0,
        idle_timeout: float = 600.0,
        ping_interval: float = 30.0,
        ping_timeout: float = 20.0,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.methods = {path.encode(): m for path, m in methods.items()}
        stream_window = min(MAX_WINDOW, max(max_message + 5, DEFAULT_WINDOW))
        self.limits = H2Limits(
            max_message=max_message,
            max_streams=max_streams,
            max_connections=max_connections,
            stream_window=stream_window,
            connection_window=min(
                MAX_WINDOW, max(stream_window, connection_window or 4 * max_message)
            ),
            send_queue=max(stream_window, send_queue or 4 * max_message),
            handshake_timeout=handshake_timeout,
            idle_timeout=idle_timeout,
            ping_interval=ping_interval,
            ping_timeout=ping_timeout,
        )
        self.counters = _Counters()
        self.connections: set[_Connection] = set()
        self._servers: list[asyncio.Server] = []
        self._stopped = asyncio.Event()
        self._stopping = False
        self._idle = asyncio.Event()  # set, once stopping, when no call is left
        # The tick that runs idle and keepalive checks: often enough for the shortest timeout.
        self._tick_s = min(1.0, idle_timeout / 4, ping_interval / 4, ping_timeout / 4)
        self._ticker: asyncio.TimerHandle | None = None

    @property
    def max_message(self) -> int:
        return self.limits.max_message

    def call_ended(self) -> None:
        if self._stopping and not any(c.calls for c in self.connections):
            self._idle.set()

    def statistics(self) -> H2Stats:
        conns = list(self.connections)
        c = self.counters
        write_buffer = 0
        for conn in conns:
            t = conn.transport
            if t is not None and not t.is_closing():
                write_buffer += t.get_write_buffer_size()
        return H2Stats(
            connections=len(conns),
            calls=sum(len(conn.calls) for conn in conns),
            buffered_bytes=sum(conn.buffered for conn in conns),
            queued_out_bytes=sum(conn.queued_out for conn in conns),
            write_buffer_bytes=write_buffer,
            header_cache_bytes=sum(conn._decoded_bytes for conn in conns),
            refused_connections=c.refused_connections,
            refused_streams=c.refused_streams,
            calm=c.calm,
            protocol_errors=c.protocol_errors,
            timeouts=c.timeouts,
            stalls_broken=c.stalls_broken,
        )

    def _tick(self) -> None:
        now = self.loop.time()
        for conn in list(self.connections):
            conn.tick(now)
        self._ticker = self.loop.call_later(self._tick_s, self._tick)

    def _start_ticking(self) -> None:
        if self._ticker is None:
            self._ticker = self.loop.call_later(self._tick_s, self._tick)

    async def listen(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen on host:port (port 0: any); returns the port."""
        server = await self.loop.create_server(
            lambda: _Connection(self),
            host,
            port,
            ssl=ssl_context,
            reuse_address=True,
            backlog=BACKLOG,
            ssl_handshake_timeout=self.limits.handshake_timeout if ssl_context else None,
        )
        self._servers.append(server)
        self._start_ticking()
        return int(server.sockets[0].getsockname()[1])

    async def listen_unix(self, path: str, ssl_context: ssl.SSLContext | None = None) -> None:
        server = await self.loop.create_unix_server(
            lambda: _Connection(self),
            path,
            ssl=ssl_context,
            backlog=BACKLOG,
            ssl_handshake_timeout=self.limits.handshake_timeout if ssl_context else None,
        )
        self._servers.append(server)
        self._start_ticking()

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
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._stopped.set()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()
