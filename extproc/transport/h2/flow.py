"""The calls of one connection, the flow-control windows both ways, and the bytes going out.

This is the base layer of the sans-IO connection (``control.Control`` and
``connection.Connection``, the frames in, are built on it), the one a method's reads and
writes reach: ``Flow`` holds the open calls, credits what they read back to the peer, queues
what they write until the peer's windows take it, and ends them.
Nothing here does I/O: what needs the event loop or the transport (a method's task, a timer,
a write, a close) is asked of the ``Host``. Frames go to ``Host.write``: those that one batch of
received bytes produces (acks, window updates, refusals) in one write at the end of
``receive_data``, any other at once (a call's answer: headers and message in one write).

Receiving, the invariant is ``recv_window + credit + buffered == connection_window``: the peer
may send ``recv_window`` more bytes; ``buffered`` are held in calls (incomplete messages and
messages not read yet); ``credit`` was read (or dropped) and not yet given back. Credit goes
out (WINDOW_UPDATE) in batches (a quarter of the connection window, half a stream window), or
at once when the peer's window runs low or a stream waits to complete a message. If the
window fills with incomplete messages that none can complete, ``_check_stall`` ends the newest
until the oldest can.

Sending, each call's window is the peer's initial window plus ``call.send_delta``, so a
SETTINGS change is one assignment however many calls are open. An answer the windows do not
take is queued on its call (``call.pending``, trailers behind it) and the call is ``_blocked``;
what is queued is bounded by ``send_queue`` (ENHANCE_YOUR_CALM above it).

A call ends once its output is out (``end``): it is forgotten and what it held is given back;
one that answered before the client finished sending is reset (NO_ERROR) so that the client
stops (RFC 9113 8.1).
"""

from __future__ import annotations

import logging
from typing import Protocol

from extproc.transport.h2.call import PREFIX, Call, Method, StatusCode
from extproc.transport.h2.frames import (
    CANCEL,
    DATA,
    DEFAULT_FRAME,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    HEADER,
    HEADERS,
    NO_ERROR,
    frame,
    goaway,
    rst_stream,
    window_update,
)
from extproc.transport.h2.headers import RESPONSE_HEADERS, status_block
from extproc.transport.h2.limits import GOAWAY_LINGER_S, H2Limits

__all__ = ["ConnectionFailure", "Counters", "Flow", "Host"]

log = logging.getLogger("extproc.h2")


class Host(Protocol):
    """What the connection asks of the asyncio shell around it, at the moment it happens."""

    def write(self, data: bytes) -> None:
        """Send these bytes to the peer (dropped once the transport is closing)."""

    def start(self, call: Call, method: Method) -> None:
        """A call was opened: run its method."""

    def fail_soon(self, call: Call) -> None:
        """Call ``fail_due(call)`` one turn of the event loop from now."""

    def cancel(self, call: Call) -> None:
        """Stop the call's method (its task)."""

    def close(self, delay: float) -> None:
        """Close the transport ``delay`` seconds from now (0: now)."""

    def abort(self) -> None:
        """Drop the transport now."""

    def call_ended(self) -> None:
        """A call was forgotten (the server waits for the last one when it stops)."""


class ConnectionFailure(Exception):
    """A protocol error that ends the connection: GOAWAY with ``code`` and the fixed debug
    string ``why``; ``detail`` goes to our log only."""

    def __init__(self, code: int, why: str, detail: str = "") -> None:
        super().__init__(why)
        self.code = code
        self.why = why
        self.detail = detail


class Counters:
    """What a server's connections refused and ended, for ``H2Server.statistics``."""

    __slots__ = (
        "calm",
        "displaced",
        "protocol_errors",
        "refused_connections",
        "refused_streams",
        "stalls_broken",
        "timeouts",
    )

    def __init__(self) -> None:
        self.refused_connections = 0
        self.displaced = 0  # connections closed to make room for a new one
        self.refused_streams = 0
        self.calm = 0
        self.protocol_errors = 0
        self.timeouts = 0
        self.stalls_broken = 0


class Flow:
    """The calls, windows and output of one connection (see the module docstring)."""

    def __init__(self, host: Host, limits: H2Limits, counters: Counters) -> None:
        self.host = host
        self.limits = limits
        self.counters = counters
        self.calls: dict[int, Call] = {}
        # Open calls that keep the connection from being displaced (``Call.keeps_place``:
        # their first message arrived, and their method keeps its connection); ``idle``
        # reads it through ``use_mark``.
        self.keeping = 0
        self.closed = False  # failed or closing: nothing more is read, nothing more is sent
        self._last_id = 0  # the highest stream the peer opened
        self._goaway_sent = False
        self._out: list[bytes] = []  # frames of the batch being received, written at its end
        self._batching = False
        # Sending.
        self.send_window = DEFAULT_WINDOW
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame = DEFAULT_FRAME
        self._blocked: dict[int, Call] = {}  # calls with DATA waiting for window, in order
        self.queued_out = 0  # bytes in those calls' pending DATA
        # Receiving: invariant recv_window + credit + buffered == connection_window.
        self._recv_window = DEFAULT_WINDOW  # what the peer may still send (until our update)
        self._credit = 0  # bytes read (or dropped), not yet given back to the peer
        self.buffered = 0  # bytes held in calls: partial messages and messages not yet read
        self._partials: dict[int, Call] = {}  # calls holding an incomplete message, oldest first
        self._credit_at = max(1, limits.connection_window // 4)
        self._stream_credit_at = max(1, limits.stream_window // 2)

    def _write(self, data: bytes) -> None:
        if self._batching:
            self._out.append(data)
        else:
            self.host.write(data)

    def _flush_out(self) -> None:
        out, self._out = self._out, []
        self.host.write(b"".join(out))

    # --- receive windows -----------------------------------------------------------------------

    def consumed(self, call: Call, size: int) -> None:
        """A method read a message of ``size`` bytes: give them back to the peer."""
        self.buffered -= size
        call.held -= size
        self._give_back(size)
        if not call.eof and not call.reset:
            call.recv_credit += size
            if call.recv_credit >= self._stream_credit_at or call.partial.parts:
                self._announce_stream(call)

    def _give_back(self, size: int) -> None:
        """Bytes no longer held (read, dropped, or padding): the connection may send them
        again. Announced in batches, or at once when the peer's window runs low."""
        self._credit += size
        if self._credit >= self._credit_at or self._recv_window < self.limits.stream_window:
            self._announce()

    def _announce(self) -> None:
        if self._credit and not self.closed:
            self._write(window_update(0, self._credit))
            self._recv_window += self._credit
        self._credit = 0

    def _announce_stream(self, call: Call) -> None:
        if call.recv_credit and not self.closed:
            self._write(window_update(call.id, call.recv_credit))
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
            partial_bytes += call.partial.have
        if self.buffered > partial_bytes:
            return  # complete messages wait to be read: reading them gives window back
        oldest = next(iter(partials.values()))
        while len(partials) > 1:
            need = oldest.partial_need()
            if need <= self._recv_window and need <= oldest.recv_window + oldest.recv_credit:
                break
            newest = next(reversed(partials.values()))
            self.counters.stalls_broken += 1
            self._fail_call(newest, StatusCode.RESOURCE_EXHAUSTED, "receive buffer full")
            self._announce()
        if oldest.recv_credit:
            self._announce_stream(oldest)

    # --- the end of a call ---------------------------------------------------------------------

    def complete(self, call: Call, status: bytes) -> None:
        """The method returned (``status``: the trailers' status block): answer, unless the
        stream or the connection is over already, and end the call."""
        if not (call.reset or call.closed or self.closed):
            self._finish(call, status)
        self.end(call)

    def cancelled(self, call: Call) -> None:
        """The method was cancelled: by us (server stop), tell the client the stream is over;
        by the client (a reset, the connection lost), there is nobody to tell."""
        if not call.reset and not self.closed:
            call.reset = True
            self._write(rst_stream(call.id, CANCEL))
        self.end(call)

    def fail_due(self, call: Call) -> None:
        """``Host.fail_soon``'s turn came: end the call with its failure, unless it is over."""
        failure = call.failure
        if self.closed or call.reset or call.closed or self.calls.get(call.id) is not call:
            return  # over already: the method met the failure in a read, or the peer left
        assert failure is not None
        self._fail_call(call, failure.code, failure.message)

    def _bad_message(self, call: Call) -> None:
        """A bad message arrived (``call.failure``): after the good ones queued before it,
        or, with none, one loop turn from now, so that a method the message before it woke
        may still write its answer (grpc.aio sends it; failing at once lost that answer now
        and then, tests/service/test_h2_fuzz.py). Meanwhile its input is dropped."""
        self._partials.pop(call.id, None)
        held = call.held
        if call.fail_after_queued():
            dropped = held - call.held  # the bad message and what follows it
            self.buffered -= dropped
            self._give_back(dropped)
            call.recv_credit += dropped
            if call.recv_credit >= self._stream_credit_at:
                self._announce_stream(call)
        else:
            self.host.fail_soon(call)

    def _fail_call(self, call: Call, code: StatusCode, message: str) -> None:
        """End a call with a status (a bad message, or no room): trailers, then RST_STREAM
        NO_ERROR so the client stops sending; cancel its method."""
        self._drop_output(call)
        if not call.closed:
            self._finish(call, status_block(code, message))
        if not call.eof:
            self._write(rst_stream(call.id, NO_ERROR))
        call.reset = True  # nothing more is read or written
        self.host.cancel(call)
        self.end(call)

    def _reset_call(self, call: Call, code: int) -> None:
        """A stream error: RST_STREAM with ``code``, and the call is over."""
        self._drop_output(call)
        self._write(rst_stream(call.id, code))
        call.reset = True
        self.host.cancel(call)
        self.end(call)

    def _finish(self, call: Call, status: bytes) -> None:
        block = status if call.headers_sent else RESPONSE_HEADERS + status
        call.headers_sent = True
        trailers = frame(HEADERS, END_HEADERS | END_STREAM, call.id, block)
        if call.pending:
            call.pending.append([trailers, 0, True])  # after the DATA still waiting for window
        else:
            self._write(trailers)
        call.closed = True

    def end(self, call: Call) -> None:
        """The call is over for us once its output is out: forget it and give back what it
        held. A call that answered before the client finished sending is reset (NO_ERROR),
        so that the client stops (RFC 9113 8.1)."""
        if call.pending or self.calls.get(call.id) is not call:
            return
        del self.calls[call.id]
        if call.keeps_place:
            self.keeping -= 1
        if self._partials:
            self._partials.pop(call.id, None)
        held = call.drop_input()
        if held:
            self.buffered -= held
            self._give_back(held)
        if call.closed and not call.eof and not call.reset:
            call.reset = True
            self._write(rst_stream(call.id, NO_ERROR))
        self.host.call_ended()

    def _drop_output(self, call: Call) -> None:
        if call.pending:
            for data, offset, is_frame in call.pending:
                if not is_frame:
                    self.queued_out -= len(data) - offset
            call.pending.clear()
        self._blocked.pop(call.id, None)

    # --- frames out ----------------------------------------------------------------------------

    def send_message(self, call: Call, payload: bytes) -> None:
        """One gRPC message on the call's stream: the response headers first if they have not
        gone yet; what the windows do not take now waits on the call."""
        if self.closed:
            return
        n = len(payload)
        data = PREFIX.pack(0, n) + payload
        head = b""
        if not call.headers_sent:
            call.headers_sent = True
            head = frame(HEADERS, END_HEADERS, call.id, RESPONSE_HEADERS)
        size = n + 5
        if (
            not call.pending
            and size <= self.send_window
            and size <= self._peer_initial_window + call.send_delta
            and size <= self._peer_max_frame
        ):
            self.send_window -= size
            call.send_delta -= size
            self._write(head + HEADER.pack(size >> 16, size & 0xFFFF, DATA, 0, call.id) + data)
            return
        if head:
            self._write(head)
        call.pending.append([data, 0, False])
        self.queued_out += size
        self._blocked[call.id] = call
        self._flush_call(call)
        if self.queued_out > self.limits.send_queue:
            self._failed(ConnectionFailure(ENHANCE_YOUR_CALM, "send queue full"))

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
            self._write(frame(DATA, 0, call.id, chunk))
            if offset + n < len(data):
                entry[1] = offset + n
            else:
                pending.popleft()
        if not pending:
            self._blocked.pop(call.id, None)
            if call.closed or call.reset:
                self.end(call)

    # --- the end of the connection -------------------------------------------------------------

    def _goaway(self, code: int, why: str = "", last_id: int | None = None) -> None:
        """GOAWAY naming the last stream we serve; with ``last_id`` (the first of two, when
        idle) it announces the end but new streams are still taken until the final one."""
        if self._goaway_sent:
            return
        if last_id is None:
            self._goaway_sent = True
            last_id = self._last_id
        self._write(goaway(last_id, code, why.encode()))

    def _failed(self, e: ConnectionFailure) -> None:
        log.warning("closing an HTTP/2 connection (%s): %s", e.why, e.detail[:200])
        if e.code == ENHANCE_YOUR_CALM:
            self.counters.calm += 1
        else:
            self.counters.protocol_errors += 1
        self._fail(e.code, e.why)

    def _fail(self, code: int, why: str) -> None:
        """A connection error: cancel every call, GOAWAY, and close a moment later (see
        ``GOAWAY_LINGER_S``)."""
        if self.closed:
            return
        self._goaway(code, why)
        self.closed = True
        self._cancel_all()
        self._flush_out()
        self.host.close(GOAWAY_LINGER_S)

    def _cancel_all(self) -> None:
        cancel = self.host.cancel
        for call in list(self.calls.values()):
            cancel(call)

    def _close(self) -> None:
        self.closed = True
        self._flush_out()
        self.host.close(0.0)
