"""The server side of one HTTP/2 connection, sans I/O: bytes in, frames out, time given.

``Connection`` is a synchronous state machine in the manner of h11's ``Connection`` and
python-hyper h2's ``H2Connection``: ``receive_data(data, now)`` takes what the socket read,
and ``tick(now)``, ``handshake_expired()``, ``shutdown()`` and the calls' reads and writes
(``consumed``, ``send_message``, ``complete``) are the other ways in; the frames they produce
go to its host's ``write``. It owns no socket, no event loop and no clock; the asyncio shell
(``server.ServerProtocol``, the host) feeds it, writes what it is given, keeps the timers and
runs each call's method. It is built in three layers, one module each:
``flow.Flow`` (the calls, the windows, the output), ``control.Control`` (connection-wide
frames, rate limits, time) and this one, which cuts the bytes into frames and handles the
frames of streams (DATA, HEADERS, CONTINUATION, RST_STREAM).

Events go to the shell as calls on its ``Host`` at the moment they happen, not as a list
returned afterwards, because their order is the order in which the event loop serves the
calls: a call opened by a HEADERS frame must start (its task is scheduled) before the read
that a later frame of the same batch completes for another call, or calls would be admitted
out of the order their frames came in. The same holds for messages: ``Call.deliver`` hands a
message to a waiting read as its DATA frame is handled.

The preface comes first, then SETTINGS before anything else; PRIORITY and unknown types are
ignored (RFC 9113 5.5), at a price (the no-op budget); PUSH_PROMISE is a protocol error. A
protocol error ends the connection (``ConnectionFailure``: GOAWAY with a fixed debug string,
every call cancelled); a stream error ends only the stream. A frame is checked from its header
before its payload is buffered (``OUR_MAX_FRAME``; ``MAX_HEADER_BLOCK`` for HEADERS and
CONTINUATION; the connection window for DATA). The work done per ``receive_data`` is bounded
(``SLICE_WORK``: frames, header bytes and fields decoded, calls opened): past it the rest of
the bytes are kept, ``receive_data`` returns True, and the shell calls ``resume`` on the next
turn of the loop, so that other connections are served in between.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from extproc.transport.h2.call import Call, Method
from extproc.transport.h2.control import Control
from extproc.transport.h2.flow import ConnectionFailure, Counters, Host
from extproc.transport.h2.frames import (
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADER,
    HEADERS,
    INTERNAL_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    Pieces,
    frame,
    rst_stream,
)
from extproc.transport.h2.headers import (
    NOT_GRPC,
    UNKNOWN_METHOD,
    BadBlock,
    HeaderDecoder,
    Headers,
    request_path,
)
from extproc.transport.h2.limits import (
    CALL_WORK,
    MAX_CONTINUATIONS,
    MAX_HEADER_BLOCK,
    OUR_MAX_FRAME,
    SLICE_WORK,
    STALL_WINDOW,
    H2Limits,
)

__all__ = ["Connection"]

log = logging.getLogger("extproc.h2")


class Connection(Control):
    """One HTTP/2 connection of the server, sans I/O (see the module docstring). ``methods``
    maps a gRPC path to its method; ``counters`` are the server's, shared by its
    connections; ``now`` is the loop time it starts at."""

    def __init__(
        self,
        host: Host,
        methods: Mapping[bytes, Method],
        limits: H2Limits,
        counters: Counters,
        now: float,
    ) -> None:
        super().__init__(host, limits, counters, now)
        self.methods = methods
        self._partial = Pieces()  # an incomplete frame (or preface)
        self._preface = False
        self._headers = HeaderDecoder()
        self._headers_for = 0  # a stream whose header block continues in CONTINUATION
        self._headers_block = bytearray()
        self._headers_end_stream = False
        self._headers_frames = 0
        self._backlog: bytes | None = None  # bytes received but left for the next turn
        self._work = 0

    @property
    def header_cache_bytes(self) -> int:
        return self._headers.cached_bytes

    # --- bytes in ------------------------------------------------------------------------------

    def receive_data(self, data: bytes, now: float) -> bool:
        """Handle what the peer sent; returns whether bytes are left for the next turn of the
        event loop (then call ``resume`` on it, and read no more until it returns False)."""
        if self.closed:
            return False  # failed: what still arrives is read and dropped until we close
        if self._backlog is not None:  # read while we paused for the backlog: keep the order
            self._backlog += data
            return True
        self._rx += 1
        self._now = now
        self._work = 0
        self._batching = True
        try:
            if self._partial.parts:
                data = self._partial.add(data) or b""  # b"": the frame is still incomplete
            if data and not self._preface:
                data = self._after_preface(data)
            pos, n = 0, len(data)
            unpack = HEADER.unpack_from
            need = 9
            while n - pos >= 9:
                hi, lo, ftype, flags, sid = unpack(data, pos)
                length = hi << 16 | lo
                if length > MAX_HEADER_BLOCK:
                    self._check_length(length, ftype)  # before the payload is buffered
                end = pos + 9 + length
                if end > n:
                    need = 9 + length
                    break
                self._on_frame(ftype, flags, sid & 0x7FFFFFFF, data[pos + 9 : end])
                pos = end
                if self.closed:
                    pos = n
                    break
                self._work += 1
                if self._work >= SLICE_WORK and pos < n:
                    self._backlog = data[pos:]  # enough for one turn: the rest waits
                    pos = n
                    break
            if pos < n:
                self._partial.keep(data[pos:], need)
            if self._flush_wanted and not self.closed:
                self._flush_wanted = False
                self._flush_blocked()
            if self._partials and self._recv_window < STALL_WINDOW:
                self._check_stall()
        except ConnectionFailure as e:
            self._failed(e)
        except Exception:
            log.exception("HTTP/2 connection failed")
            self._fail(INTERNAL_ERROR, "internal error")
        finally:
            self._batching = False
            if self._out:
                self._flush_out()
        return self._backlog is not None

    def resume(self, now: float) -> bool:
        """Handle the bytes left by the last turn (``receive_data``'s True)."""
        backlog, self._backlog = self._backlog, None
        if backlog is not None and not self.closed:
            return self.receive_data(backlog, now)
        return False

    def _after_preface(self, data: bytes) -> bytes:
        """The bytes after the client preface, once it is all there (until then b"")."""
        if len(data) < len(PREFACE):
            if not PREFACE.startswith(data):
                raise ConnectionFailure(PROTOCOL_ERROR, "bad preface")
            self._partial.keep(data, len(PREFACE))
            return b""
        if not data.startswith(PREFACE):
            raise ConnectionFailure(PROTOCOL_ERROR, "bad preface")
        self._preface = True
        return data[len(PREFACE) :]

    def _check_length(self, length: int, ftype: int) -> None:
        """A frame above MAX_HEADER_BLOCK, refused from its header when it cannot be right."""
        if length > OUR_MAX_FRAME:
            raise ConnectionFailure(FRAME_SIZE_ERROR, "frame too large", f"{length} bytes")
        if ftype == HEADERS or ftype == CONTINUATION:
            raise ConnectionFailure(
                ENHANCE_YOUR_CALM, "header block too large", f"frame of {length} bytes"
            )
        if ftype == DATA and length > self._recv_window:
            raise ConnectionFailure(FLOW_CONTROL_ERROR, "flow control", f"DATA of {length} bytes")

    def _on_frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if self._headers_for and ftype != CONTINUATION:
            raise ConnectionFailure(PROTOCOL_ERROR, "expected CONTINUATION")
        if ftype == DATA:
            self._on_data(flags, sid, payload)
        elif ftype == HEADERS:
            self._on_headers(flags, sid, payload)
        elif not self._settings_seen and ftype != SETTINGS:
            raise ConnectionFailure(PROTOCOL_ERROR, "expected SETTINGS")
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
            raise ConnectionFailure(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        else:
            # PRIORITY and unknown frame types are ignored (RFC 9113 section 5.5), but not for
            # free.
            self._take(self._noop, "too many no-op frames")

    # --- DATA ----------------------------------------------------------------------------------

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        if not self._settings_seen:
            raise ConnectionFailure(PROTOCOL_ERROR, "expected SETTINGS")
        if not sid:
            raise ConnectionFailure(PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        self._recv_window -= size
        if self._recv_window < 0:
            raise ConnectionFailure(FLOW_CONTROL_ERROR, "flow control", "connection window")
        call = self.calls.get(sid)
        if call is None or call.eof or call.reset:
            if sid > self._last_id:
                raise ConnectionFailure(PROTOCOL_ERROR, "DATA on an idle stream")
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
        if call.failure is not None:
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
                raise ConnectionFailure(PROTOCOL_ERROR, "bad padding")
            content = payload[1 : size - payload[0]]
            self._give_back(size - len(content))
            call.recv_credit += size - len(content)
        if content:
            n = len(content)
            self.buffered += n
            call.held += n
            taken = call.on_data(content, self.limits.max_message)
            if taken:
                # A waiting read took a message as it arrived: read, as ``consumed`` counts
                # it (no incomplete message was held at that point).
                self.buffered -= taken
                call.held -= taken
                self._give_back(taken)
                call.recv_credit += taken
                if call.recv_credit >= self._stream_credit_at:
                    self._announce_stream(call)
            if call.failure is not None:
                self._bad_message(call)
                return
            if call.first_due and (taken or call.held > call.partial.have):
                # Its first message is here (taken by a read, or queued beside what is left
                # of an incomplete one): from now on the call keeps its connection in place.
                # Checked only until then: one attribute per DATA frame after it.
                call.first_due = False
                call.keeps_place = True
                self.keeping += 1
            if call.partial.parts:
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

    # --- HEADERS -------------------------------------------------------------------------------

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        if not self._settings_seen:
            raise ConnectionFailure(PROTOCOL_ERROR, "expected SETTINGS")
        if not sid:
            raise ConnectionFailure(PROTOCOL_ERROR, "HEADERS on stream 0")
        if flags & PADDED:
            pad = payload[0] if payload else 256
            if pad >= len(payload):
                raise ConnectionFailure(PROTOCOL_ERROR, "bad padding")
            payload = payload[1 : len(payload) - pad]
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise ConnectionFailure(FRAME_SIZE_ERROR, "bad HEADERS")
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
            raise ConnectionFailure(PROTOCOL_ERROR, "unexpected CONTINUATION")
        if not payload:
            self._take(self._noop, "too many empty frames")
        self._headers_frames += 1
        if self._headers_frames > MAX_CONTINUATIONS + 1:
            raise ConnectionFailure(ENHANCE_YOUR_CALM, "too many CONTINUATION frames")
        self._headers_block += payload
        if len(self._headers_block) > MAX_HEADER_BLOCK:
            raise ConnectionFailure(ENHANCE_YOUR_CALM, "header block too large")
        if flags & END_HEADERS:
            self._headers_for = 0
            block, self._headers_block = bytes(self._headers_block), bytearray()
            self._on_header_block(sid, block, self._headers_end_stream)

    def _on_header_block(self, sid: int, block: bytes, end_stream: bool) -> None:
        headers = self._headers.cache.get(block)
        if headers is None:
            headers = self._decode(block)
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
            raise ConnectionFailure(PROTOCOL_ERROR, "even stream id from a client")
        self._last_id = sid
        if self._goaway_sent or len(self.calls) >= self.limits.max_streams:
            self.counters.refused_streams += 1
            self._take(self._resets, "too many refused streams")
            self._write(rst_stream(sid, REFUSED_STREAM))
            return
        path = request_path(headers)
        if path is None:
            self._write(frame(HEADERS, END_HEADERS | END_STREAM, sid, NOT_GRPC))
            return
        method = self.methods.get(path)
        if method is None:
            self._write(frame(HEADERS, END_HEADERS | END_STREAM, sid, UNKNOWN_METHOD))
            return
        call = Call(
            self,
            sid,
            self.limits.stream_window,
            method.deserialize,
            method.serialize,
            method.keeps_connection,
        )
        self.calls[sid] = call
        self._work += CALL_WORK
        if end_stream:
            call.on_end_stream()
        self.host.start(call, method)

    def _decode(self, block: bytes) -> Headers:
        try:
            headers, work = self._headers.decode(block)
        except BadBlock as e:
            raise ConnectionFailure(COMPRESSION_ERROR, "compression error", str(e)) from None
        self._work += work
        return headers

    def _on_rst_stream(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionFailure(FRAME_SIZE_ERROR, "bad RST_STREAM")
        if not sid:
            raise ConnectionFailure(PROTOCOL_ERROR, "RST_STREAM on stream 0")
        call = self.calls.get(sid)
        if call is None:
            if sid > self._last_id:
                raise ConnectionFailure(PROTOCOL_ERROR, "RST_STREAM on an idle stream")
            return
        if not call.headers_sent:
            # Reset before we answered anything: the rapid-reset pattern, rate-limited.
            self._take(self._resets, "too many resets")
        call.reset = True
        self._drop_output(call)
        self.host.cancel(call)
        self.end(call)

    # --- the end ---------------------------------------------------------------------------------

    def lost(self) -> None:
        """The transport is gone: cancel every call and forget everything held."""
        self.closed = True
        cancel = self.host.cancel
        for call in list(self.calls.values()):
            cancel(call)
            call.drop_input()
        self.calls.clear()
        self.keeping = 0
        self._blocked.clear()
        self._partials.clear()
        self.buffered = 0
        self.queued_out = 0
        self._headers.clear()
        self._backlog = None
        self._partial.clear()
