"""The calls of one connection and what goes out: the part of ``connection.Connection`` that
the frames of streams reach once cut and checked, and the calls' ``Owner``.

``Session`` holds the open calls (``calls``; ``last_id``, the highest stream the peer opened;
``keeping``, those that keep the connection in place) and the output: what one batch of received
bytes produces goes out in one write at its end (``batch``), anything else at once (a call's
answer: headers and message in one write). It owns the flow-control parts and ``Control``, and
writes what they return; it ends calls and the connection (``goaway``, ``fail``, ``displace``;
then ``closed``). A call ends once its output is out (``end``): forgotten, what it held given
back, and reset (NO_ERROR) if it answered before the client finished sending, so that the client
stops (RFC 9113 8.1). A bad message fails its call after the good ones before it; incomplete
messages that fill the connection window and none of which can complete are ended, the newest
first, until the oldest can (``check_stall``, RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from extproc.transport.h2 import frames
from extproc.transport.h2.call import Call, Method, StatusCode
from extproc.transport.h2.control import Control
from extproc.transport.h2.flow import Inbound, Outbound
from extproc.transport.h2.frames import ConnectionFailure, frame, goaway, rst_stream
from extproc.transport.h2.headers import status_block
from extproc.transport.h2.limits import CALL_WORK, GOAWAY_LINGER_S, Counters, H2Limits

__all__ = ["Host", "Session"]

log = logging.getLogger("extproc.h2")


class Host(Protocol):
    """What the connection asks of the asyncio shell, as it happens: ``write`` (dropped once the
    transport is closing), ``start`` a call's method (a task), ``fail_soon`` (``fail_due`` one
    turn later), ``cancel`` a method, ``close`` (``delay`` s later), ``abort``, ``call_ended``."""

    def write(self, data: bytes) -> None: ...
    def start(self, call: Call, method: Method) -> None: ...
    def fail_soon(self, call: Call) -> None: ...
    def cancel(self, call: Call) -> None: ...
    def close(self, delay: float) -> None: ...
    def abort(self) -> None: ...
    def call_ended(self) -> None: ...


class Session:
    """The calls and the output of one connection (see the module docstring)."""

    def __init__(self, host: Host, limits: H2Limits, counters: Counters, now: float) -> None:
        self.host = host
        self.limits = limits
        self.counters = counters
        self.inbound = Inbound(limits)
        self.outbound = Outbound()
        self.control = Control(limits, now)
        self.calls: dict[int, Call] = {}
        self.keeping = 0
        self.last_id = 0
        self.closed = False
        self._goaway_sent = False
        self._out: list[bytes] = []  # frames of the batch being received, written at its end
        self._batching = False

    def write(self, data: bytes) -> None:
        if self._batching:
            self._out.append(data)
        else:
            self.host.write(data)

    def send(self, data: bytes) -> None:  # what a part returned, unless b"", or once closed
        if data and not self.closed:
            self.write(data)

    def batch(self, read: Callable[[bytes], None], data: bytes) -> None:
        """``read(data)``: one write at its end; a protocol error ends the connection."""
        self._batching = True
        try:
            read(data)
        except ConnectionFailure as e:
            self.failed(e)
        except Exception:
            log.exception("HTTP/2 connection failed")
            self.fail(frames.INTERNAL_ERROR, "internal error")
        finally:
            self._batching = False
            if self._out:
                self._flush()

    def _flush(self) -> None:
        out, self._out = self._out, []
        self.host.write(b"".join(out))

    def headers(self, sid: int, end_stream: bool, method: Method | bytes, now: float) -> int:
        """A header block (``method``: its path's, or the answer to a request we do not serve):
        trailers, or a new stream refused, answered, or opened (returns the work it costs)."""
        call = self.calls.get(sid)
        if call is not None:
            # Trailers of a stream in progress (gRPC clients send none): they must end it.
            if end_stream:
                self.inbound.ended(call)
                call.on_end_stream()
            elif not call.reset:
                self.reset_call(call, frames.PROTOCOL_ERROR)
            return 0
        if sid <= self.last_id:
            # A late block for a stream we have finished: decoded (the HPACK table must stay
            # in step), then dropped.
            self.control.noop(now, "too many frames for closed streams")
            return 0
        if sid % 2 == 0:
            raise ConnectionFailure(frames.PROTOCOL_ERROR, "even stream id from a client")
        self.last_id = sid
        if self._goaway_sent or len(self.calls) >= self.limits.max_streams:
            self.counters.refused_streams += 1
            self.control.reset(now, "too many refused streams")
            self.write(rst_stream(sid, frames.REFUSED_STREAM))
            return 0
        if isinstance(method, bytes):
            self.write(frame(frames.HEADERS, frames.END_HEADERS | frames.END_STREAM, sid, method))
            return 0
        call = Call(self, sid, self.limits.stream_window, method)
        self.calls[sid] = call
        if end_stream:
            call.on_end_stream()
        self.host.start(call, method)
        return CALL_WORK

    def kept(self, call: Call) -> None:  # its first message came: it keeps its connection
        call.first_due = False
        call.keeps_place = True
        self.keeping += 1

    def reset_by_peer(self, sid: int, payload: bytes, now: float) -> None:
        if len(payload) != 4:
            raise ConnectionFailure(frames.FRAME_SIZE_ERROR, "bad RST_STREAM")
        if not sid:
            raise ConnectionFailure(frames.PROTOCOL_ERROR, "RST_STREAM on stream 0")
        call = self.calls.get(sid)
        if call is None:
            if sid > self.last_id:
                raise ConnectionFailure(frames.PROTOCOL_ERROR, "RST_STREAM on an idle stream")
            return
        if not call.headers_sent:
            # Reset before we answered anything: the rapid-reset pattern, rate-limited.
            self.control.reset(now, "too many resets")
        call.reset = True
        self.outbound.drop(call)
        self.host.cancel(call)
        self.end(call)

    def window_update(self, sid: int, payload: bytes) -> None:
        """WINDOW_UPDATE: 0 is a PROTOCOL_ERROR, past 2^31-1 a FLOW_CONTROL_ERROR (on a stream,
        a stream error)."""
        if len(payload) != 4:
            raise ConnectionFailure(frames.FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
        increment = frames.U32.unpack(payload)[0] & 0x7FFFFFFF
        if not sid:
            if not increment:
                raise ConnectionFailure(frames.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.outbound.opened(increment)
            return
        call = self.calls.get(sid)
        if call is None:
            if sid > self.last_id:
                raise ConnectionFailure(frames.PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
            return  # a stream we have finished: updates may still be in flight (RFC 9113 6.9)
        if call.reset:
            return
        error = self.outbound.stream_opened(call, increment)
        if error:
            self.reset_call(call, error)
        elif call.pending:
            self.flush_call(call)  # only what this update unblocks

    # --- the calls' reads and writes, and their end --------------------------------------------

    def consumed(self, call: Call, size: int) -> None:
        """A method read a message of ``size`` bytes: give them back to the peer."""
        out = self.inbound.read(call, size)
        if out and not self.closed:
            self.write(out)

    def send_message(self, call: Call, payload: bytes) -> None:
        """One gRPC message on an open call: what the windows do not take waits, up to
        ``send_queue`` for the connection (ENHANCE_YOUR_CALM past it)."""
        if self.closed:
            return
        out = self.outbound.message(call, payload)
        if out:
            self.write(out)
        if call.pending and self.outbound.queued > self.limits.send_queue:
            self.failed(ConnectionFailure(frames.ENHANCE_YOUR_CALM, "send queue full"))

    def complete(self, call: Call, status: bytes) -> None:
        """The method returned ``status`` (a status block): answered unless over, and ended."""
        if not (call.reset or call.closed or self.closed):
            out = self.outbound.trailers(call, status)
            if out:
                self.write(out)
        self.end(call)

    def cancelled(self, call: Call) -> None:
        """The method was cancelled: if by us (server stop), the client is told (RST_STREAM)."""
        if not call.reset and not self.closed:
            call.reset = True
            self.write(rst_stream(call.id, frames.CANCEL))
        self.end(call)

    def fail_due(self, call: Call) -> None:
        """``Host.fail_soon``'s turn came: end the call with its failure, unless it is over."""
        failure = call.failure
        if self.closed or call.reset or call.closed or self.calls.get(call.id) is not call:
            return  # over already: the method met the failure in a read, or the peer left
        assert failure is not None
        self.reset_call(call, frames.NO_ERROR, status_block(failure.code, failure.message))

    def bad_message(self, call: Call) -> None:
        """A bad message (``call.failure``) fails the call after the good ones before it, or
        one loop turn later if none, so that a method the one before woke may still answer (as
        grpc.aio does: tests/service/test_h2_fuzz.py). Meanwhile its input is dropped."""
        held = call.held
        if call.fail_after_queued():
            self.send(self.inbound.release(call, held - call.held, held=True))
        else:
            self.host.fail_soon(call)

    def reset_call(self, call: Call, code: int, status: bytes | None = None) -> None:
        """A stream error: RST_STREAM ``code``, the method cancelled; a call failed with
        ``status`` gets its trailers first, and the RST_STREAM only if the client still sends."""
        self.outbound.drop(call)
        if status is not None and not call.closed:
            self.write(self.outbound.trailers(call, status))
        if status is None or not call.eof:
            self.write(rst_stream(call.id, code))
        call.reset = True  # nothing more is read or written
        self.host.cancel(call)
        self.end(call)

    def flush_call(self, call: Call) -> None:
        self.send(self.outbound.flush(call))
        if not call.pending and (call.closed or call.reset):
            self.end(call)

    def flush_blocked(self) -> None:
        """A window grew: what the windows now allow, in the order the calls got blocked."""
        outbound = self.outbound
        for call in outbound.flushing():
            if outbound.window <= 0 or self.closed:
                break
            self.flush_call(call)

    def check_stall(self) -> None:
        """The connection window is used up and calls hold incomplete messages (see above)."""
        inbound = self.inbound
        self.send(inbound.announce())
        oldest = inbound.stalled()
        if oldest is None:
            return
        full = status_block(StatusCode.RESOURCE_EXHAUSTED, "receive buffer full")
        while (newest := inbound.victim()) is not None:
            self.counters.stalls_broken += 1
            self.reset_call(newest, frames.NO_ERROR, full)
            self.send(inbound.announce())
        self.send(inbound.announce_stream(oldest))

    def end(self, call: Call) -> None:
        """The call is over for us, once its output is out (see above)."""
        if call.pending or self.calls.get(call.id) is not call:
            return
        del self.calls[call.id]
        if call.keeps_place:
            self.keeping -= 1
        if call.held or self.inbound.partials:  # else there is nothing to forget
            self.send(self.inbound.forget(call))
        if call.closed and not call.eof and not call.reset:
            call.reset = True
            self.write(rst_stream(call.id, frames.NO_ERROR))
        self.host.call_ended()

    # --- the end of the connection -------------------------------------------------------------

    def use_mark(self) -> int | None:
        """For ``idle.IdleOrder``: None while a call keeps the connection, else ``last_id``."""
        return None if self.keeping else self.last_id

    def goaway(self, code: int, why: str = "", last_id: int | None = None) -> None:
        """GOAWAY naming the last stream we serve; with ``last_id`` (the first of two, when
        idle) it announces the end but new streams are still taken until the final one."""
        if self._goaway_sent:
            return
        if last_id is None:
            self._goaway_sent = True
            last_id = self.last_id
        self.write(goaway(last_id, code, why.encode()))

    def failed(self, e: ConnectionFailure) -> None:
        log.warning("closing an HTTP/2 connection (%s): %s", e.why, e.detail[:200])
        if e.code == frames.ENHANCE_YOUR_CALM:
            self.counters.calm += 1
        else:
            self.counters.protocol_errors += 1
        self.fail(e.code, e.why)

    def fail(self, code: int, why: str) -> None:
        """A connection error: GOAWAY, every call cancelled, closed ``GOAWAY_LINGER_S`` later."""
        if self.closed:
            return
        self.goaway(code, why)
        self.closed = True
        self.cancel_all()
        self.close(GOAWAY_LINGER_S)

    def displace(self) -> None:
        """A newcomer takes the place (no call keeps it): final GOAWAY, calls cancelled, close."""
        if self.closed:
            return
        self.counters.displaced += 1
        self.goaway(frames.NO_ERROR, "too many connections")
        self.cancel_all()
        self.close()

    def close(self, delay: float = 0.0) -> None:
        self.closed = True
        self._flush()
        self.host.close(delay)

    def shut(self) -> None:  # the shell closes the transport: nothing more is read or sent
        self.closed = True

    def cancel_all(self) -> None:
        cancel = self.host.cancel
        for call in list(self.calls.values()):
            cancel(call)

    def lost(self) -> None:
        """The transport is gone: cancel every call and forget everything held."""
        self.closed = True
        cancel = self.host.cancel
        for call in list(self.calls.values()):
            cancel(call)
            call.drop_input()
        self.calls.clear()
        self.keeping = 0
        self.inbound.clear()
        self.outbound.clear()
