"""The server side of one HTTP/2 connection, sans I/O: bytes in, frames out, time given.

``Connection`` is a synchronous state machine in the manner of h11's ``Connection`` and
python-hyper h2's ``H2Connection``: ``receive_data(data, now)`` takes what the socket read, and
``tick(now)``, ``handshake_expired()``, ``shutdown()`` and the calls' reads and writes (to its
session) are the other ways in; the frames they produce go to its host's ``write``. It owns no
socket, no event loop and no clock: the asyncio shell (``server.ServerProtocol``, the host)
feeds it, writes what it is given, keeps the timers and runs the calls' methods. It cuts the
bytes into frames and checks them; parts with their own state, which know the host but never
the connection, do the rest: its ``session.Session`` (the calls, the output, the ends), the
session's ``flow.Inbound`` and ``flow.Outbound`` (the windows) and ``control.Control``
(SETTINGS, PING, token buckets, timers), which it uses too, and its ``headers.HeaderDecoder``.

Events go to the host as calls at the moment they happen, not as a list returned afterwards:
their order is the order in which the event loop serves the calls, and a call opened by a
HEADERS frame must start before a later frame of the same batch completes another call's read
(``Call.deliver``), or calls would be admitted out of the order their frames came in.

The preface comes first, then SETTINGS before anything else; PRIORITY and unknown types are
ignored (RFC 9113 5.5), at a price (the no-op budget); PUSH_PROMISE is a protocol error. A
protocol error ends the connection (``ConnectionFailure``: GOAWAY with a fixed debug string,
every call cancelled); a stream error ends only the stream. A frame is checked from its header
before its payload is buffered (``OUR_MAX_FRAME``; ``MAX_HEADER_BLOCK`` for HEADERS and
CONTINUATION; the connection window for DATA). The work per ``receive_data`` is bounded
(``SLICE_WORK``: frames, header bytes and fields decoded, calls opened): past it the rest waits,
``receive_data`` returns True, and the shell calls ``resume`` on the next turn of the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from extproc.transport.h2 import frames
from extproc.transport.h2.call import Method
from extproc.transport.h2.control import DRAINED, IDLE, KEEPALIVE_PING, PING_DUE, PING_LOST
from extproc.transport.h2.frames import DATA, END_STREAM, HEADER, PADDED, ConnectionFailure, Pieces
from extproc.transport.h2.headers import NOT_GRPC, UNKNOWN_METHOD, HeaderDecoder, request_path
from extproc.transport.h2.limits import (
    MAX_CONTINUATIONS,
    MAX_HEADER_BLOCK,
    OUR_MAX_FRAME,
    SLICE_WORK,
    STALL_WINDOW,
    Counters,
    H2Limits,
)
from extproc.transport.h2.session import Host, Session

__all__ = ["Connection"]

log = logging.getLogger("extproc.h2")

_KEEPALIVE = frames.frame(frames.PING, 0, 0, KEEPALIVE_PING)


class Connection:
    """One HTTP/2 connection, sans I/O: ``methods`` maps a gRPC path to its method,
    ``counters`` are the server's, ``now`` is the loop time it starts at."""

    def __init__(
        self,
        host: Host,
        methods: Mapping[bytes, Method],
        limits: H2Limits,
        counters: Counters,
        now: float,
    ) -> None:
        self.methods = methods
        self.limits = limits
        self.session = session = Session(host, limits, counters, now)
        self.inbound, self.outbound = session.inbound, session.outbound  # shared with it
        self.control = session.control
        # The ways in that are the session's, bound here: no call in between.
        self.calls, self.send_message = session.calls, session.send_message
        self.complete, self.cancelled = session.complete, session.cancelled
        self.fail_due, self.use_mark = session.fail_due, session.use_mark
        self.displace, self.shut = session.displace, session.shut
        self.cancel_calls = session.cancel_all
        self.handshake_done = False  # the client's first SETTINGS arrived
        self._now = now  # the time of the bytes being handled
        self._rx = 0  # reads so far: ``Control.tick`` notices a change
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
    def closed(self) -> bool:
        return self.session.closed

    @property
    def keeping(self) -> int:
        return self.session.keeping

    @property
    def buffered(self) -> int:
        return self.inbound.buffered

    @property
    def queued_out(self) -> int:
        return self.outbound.queued

    @property
    def header_cache_bytes(self) -> int:
        return self._headers.cached_bytes

    def initiate(self) -> None:
        """Our SETTINGS, and the connection window opened to ``connection_window``."""
        self.session.write(self.control.our_settings())
        self.session.send(self.inbound.open(self.limits.connection_window))

    def receive_data(self, data: bytes, now: float) -> bool:
        """Handle what the peer sent; returns whether bytes are left for the next turn of the
        event loop (then call ``resume`` on it, and read no more until it returns False)."""
        session = self.session
        if session.closed:
            return False  # failed: what still arrives is read and dropped until we close
        if self._backlog is not None:  # read while we paused for the backlog: keep the order
            self._backlog += data
            return True
        self._rx += 1
        self._now = now
        self._work = 0
        session.batch(self._read, data)
        return self._backlog is not None

    def resume(self, now: float) -> bool:
        """Handle the bytes left by the last turn (``receive_data``'s True)."""
        backlog, self._backlog = self._backlog, None
        if backlog is not None and not self.session.closed:
            return self.receive_data(backlog, now)
        return False

    def _read(self, data: bytes) -> None:
        session = self.session
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
            if ftype == DATA and not self._headers_for:
                self._on_data(flags, sid & 0x7FFFFFFF, data[pos + 9 : end])
            else:
                self._on_frame(ftype, flags, sid & 0x7FFFFFFF, data[pos + 9 : end])
            pos = end
            if session.closed:
                pos = n
                break
            self._work += 1
            if self._work >= SLICE_WORK and pos < n:
                self._backlog = data[pos:]  # enough for one turn: the rest waits
                pos = n
                break
        if pos < n:
            self._partial.keep(data[pos:], need)
        if self.outbound.flush_wanted and not session.closed:
            session.flush_blocked()  # once a batch, however many frames grew a window
        if self.inbound.partials and self.inbound.window < STALL_WINDOW:
            session.check_stall()

    def _after_preface(self, data: bytes) -> bytes:
        """The bytes after the client preface, once it is all there (until then b"")."""
        preface = frames.PREFACE
        if not (data.startswith(preface) or preface.startswith(data)):
            raise ConnectionFailure(frames.PROTOCOL_ERROR, "bad preface")
        if len(data) < len(preface):
            self._partial.keep(data, len(preface))
            return b""
        self._preface = True
        return data[len(preface) :]

    def _check_length(self, length: int, ftype: int) -> None:
        """A frame above MAX_HEADER_BLOCK, refused from its header when it cannot be right."""
        if length > OUR_MAX_FRAME:
            raise ConnectionFailure(frames.FRAME_SIZE_ERROR, "frame too large", f"{length} bytes")
        if ftype == frames.HEADERS or ftype == frames.CONTINUATION:
            raise ConnectionFailure(
                frames.ENHANCE_YOUR_CALM, "header block too large", f"frame of {length} bytes"
            )
        if ftype == DATA and length > self.inbound.window:
            raise ConnectionFailure(
                frames.FLOW_CONTROL_ERROR, "flow control", f"DATA of {length} bytes"
            )

    # --- frames --------------------------------------------------------------------------------

    def _on_frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        """Any frame but DATA outside a header block (``_read`` hands those on)."""
        if self._headers_for and ftype != frames.CONTINUATION:
            raise ConnectionFailure(frames.PROTOCOL_ERROR, "expected CONTINUATION")
        if not self.handshake_done and ftype != frames.SETTINGS:
            raise ConnectionFailure(frames.PROTOCOL_ERROR, "expected SETTINGS")
        if ftype == frames.HEADERS:
            self._on_headers(flags, sid, payload)
        elif ftype == frames.CONTINUATION:
            self._on_continuation(flags, sid, payload)
        elif ftype == frames.RST_STREAM:
            self.session.reset_by_peer(sid, payload, self._now)
        elif ftype == frames.SETTINGS:
            ack = self.control.settings(flags, sid, payload, self._now)
            if ack:  # not an ACK of ours: the peer's settings, checked
                self.outbound.settings(payload)
                self.session.write(ack)
                self.handshake_done = True
        elif ftype == frames.PING:
            self.session.send(self.control.ping(flags, sid, payload, self._now))
        elif ftype == frames.WINDOW_UPDATE:
            self.session.window_update(sid, payload)
        elif ftype == frames.GOAWAY:
            pass  # the peer opens no more streams; those open finish as usual
        elif ftype == frames.PUSH_PROMISE:
            raise ConnectionFailure(frames.PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        else:  # PRIORITY and unknown types are ignored (RFC 9113 5.5), but not for free
            self.control.noop(self._now, "too many no-op frames")

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        if not self.handshake_done:
            raise ConnectionFailure(frames.PROTOCOL_ERROR, "expected SETTINGS")
        if not sid:
            raise ConnectionFailure(frames.PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        inbound = self.inbound
        session = self.session
        call = session.calls.get(sid)
        if not inbound.take(call, size):
            if call is None or call.eof or call.reset:
                if sid > session.last_id:
                    raise ConnectionFailure(frames.PROTOCOL_ERROR, "DATA on an idle stream")
                # A stream we have finished (or reset): its bytes count, and go back at once.
                session.send(inbound.give_back(size))
                if not size and not flags & END_STREAM:
                    self.control.noop(self._now, "too many empty frames")
            else:  # past the stream's window
                session.send(inbound.give_back(size))
                session.reset_call(call, frames.FLOW_CONTROL_ERROR)
            return
        if call.failure is not None:
            # Input after a bad message is dropped, and its window goes back (stream and
            # connection): the client can finish sending, while the method reads the good
            # messages before it and the answer waits for the client's own window.
            session.send(inbound.release(call, size))
            if flags & END_STREAM:
                call.on_end_stream()
            return
        content = payload
        if flags & PADDED:
            if not payload or payload[0] >= size:
                raise ConnectionFailure(frames.PROTOCOL_ERROR, "bad padding")
            content = payload[1 : size - payload[0]]
            session.send(inbound.release(call, size - len(content), due=False))
        if content:
            taken = call.on_data(content, self.limits.max_message)
            out = inbound.received(call, len(content), taken)
            if out:
                session.write(out)
            if call.failure is not None:
                session.bad_message(call)
                return
            if call.first_due and (taken or call.held > call.partial.have):
                # Its first message is here (taken by a read, or queued beside what is left
                # of an incomplete one). Checked only until then: one attribute per DATA frame.
                session.kept(call)
        elif not flags & END_STREAM:
            self.control.noop(self._now, "too many empty frames")
        if flags & END_STREAM:
            if inbound.partials:
                inbound.ended(call)
            call.on_end_stream()

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        if not sid:
            raise ConnectionFailure(frames.PROTOCOL_ERROR, "HEADERS on stream 0")
        if flags & PADDED:
            pad = payload[0] if payload else 256
            if pad >= len(payload):
                raise ConnectionFailure(frames.PROTOCOL_ERROR, "bad padding")
            payload = payload[1 : len(payload) - pad]
        if flags & frames.PRIORITY_FLAG:
            if len(payload) < 5:
                raise ConnectionFailure(frames.FRAME_SIZE_ERROR, "bad HEADERS")
            payload = payload[5:]
        if not payload:
            self.control.noop(self._now, "too many empty frames")
        if flags & frames.END_HEADERS:
            self._on_header_block(sid, payload, bool(flags & END_STREAM))
        else:
            self._headers_for = sid
            self._headers_block = bytearray(payload)
            self._headers_end_stream = bool(flags & END_STREAM)
            self._headers_frames = 1

    def _on_continuation(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != self._headers_for or not sid:
            raise ConnectionFailure(frames.PROTOCOL_ERROR, "unexpected CONTINUATION")
        if not payload:
            self.control.noop(self._now, "too many empty frames")
        self._headers_frames += 1
        if self._headers_frames > MAX_CONTINUATIONS + 1:
            raise ConnectionFailure(frames.ENHANCE_YOUR_CALM, "too many CONTINUATION frames")
        self._headers_block += payload
        if len(self._headers_block) > MAX_HEADER_BLOCK:
            raise ConnectionFailure(frames.ENHANCE_YOUR_CALM, "header block too large")
        if flags & frames.END_HEADERS:
            self._headers_for = 0
            block, self._headers_block = bytes(self._headers_block), bytearray()
            self._on_header_block(sid, block, self._headers_end_stream)

    def _on_header_block(self, sid: int, block: bytes, end_stream: bool) -> None:
        headers = self._headers.cache.get(block)
        if headers is None:
            headers, work = self._headers.decode(block)  # or a COMPRESSION_ERROR
            self._work += work
        path = request_path(headers)
        method = NOT_GRPC if path is None else self.methods.get(path, UNKNOWN_METHOD)
        self._work += self.session.headers(sid, end_stream, method, self._now)

    def tick(self, now: float) -> None:
        """The server's tick (at most a second apart): idle connections, silent peers."""
        session = self.session
        if session.closed:
            return
        due = self.control.tick(now, len(session.calls), session.last_id, self._rx)
        if due == PING_DUE:
            session.write(_KEEPALIVE)
        elif due == IDLE:  # the first of two GOAWAYs: streams on their way are still served
            session.counters.timeouts += 1
            session.goaway(frames.NO_ERROR, "idle", last_id=frames.MAX_WINDOW)
        elif due == DRAINED:
            session.goaway(frames.NO_ERROR, "idle")  # final: names the last stream served
            session.close()
        elif due == PING_LOST:
            session.counters.timeouts += 1
            log.warning("closing an HTTP/2 connection: no PING ACK in time")
            session.cancel_all()
            session.shut()
            session.host.abort()

    def handshake_expired(self) -> None:
        """The handshake timeout passed: without the preface and first SETTINGS, fail."""
        if not self.handshake_done and not self.session.closed:
            self.session.counters.timeouts += 1
            log.warning("closing an HTTP/2 connection: no preface and SETTINGS in time")
            self.session.fail(frames.PROTOCOL_ERROR, "handshake timeout")

    def shutdown(self) -> None:
        """The server stops: GOAWAY, new streams refused, open ones finish."""
        self.session.goaway(frames.NO_ERROR)

    def lost(self) -> None:
        """The transport is gone: cancel every call and forget everything held."""
        self.session.lost()
        self._headers.clear()
        self._backlog = None
        self._partial.clear()
