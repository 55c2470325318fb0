"""The connection as a whole: its handshake, its settings, PINGs, windows, rate limits and
timeouts; the middle layer of the sans-IO connection (``flow.Flow`` below it,
``connection.Connection`` above it, which cuts the bytes into frames).

Connection-wide frames are handled here: SETTINGS (+ACK; a change of the peer's initial window
is one assignment, see ``flow``), PING (ACK), WINDOW_UPDATE (for the connection, and for a
stream: 0 is a stream PROTOCOL_ERROR, past 2^31-1 a stream FLOW_CONTROL_ERROR). A window that
grows marks the blocked calls for one flush at the end of the batch of frames, not one per
frame. Frames that do nothing useful or make us answer draw on the connection's token buckets
(``_take``; resets and refused streams, PINGs, SETTINGS, no-op frames), with the time of the
bytes being handled (``receive_data``'s ``now``): ENHANCE_YOUR_CALM when one runs dry.

Time comes from the shell: ``handshake_expired`` when the handshake timeout passed (its
timer), ``tick(now)`` at most a second apart. A connection with no open call for
``idle_timeout`` gets GOAWAY in two steps (RFC 9113 6.8): the first names stream 2^31-1, so
that streams on their way are still served, and the final one ``IDLE_DRAIN_S`` later, once no
call is open, then the close. While calls are open and the peer has been silent for
``ping_interval`` we PING it, and drop the connection after ``ping_timeout`` without the ACK.

At ``max_connections`` the server displaces a connection that no call keeps in place to take
a newcomer (``idle.IdleOrder`` chooses it from ``use_mark``; a call keeps its connection once
its first message arrived, unless its method says otherwise, ``Method.keeps_connection``):
``displace`` sends the final GOAWAY (NO_ERROR, naming the last stream served), cancels the
calls left (silent ones, watches) and closes.
"""

from __future__ import annotations

import logging

from extproc.transport.h2.flow import ConnectionFailure, Counters, Flow, Host
from extproc.transport.h2.frames import (
    ACK,
    DEFAULT_FRAME,
    DEFAULT_WINDOW,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    LARGEST_FRAME,
    MAX_WINDOW,
    NO_ERROR,
    PING,
    PROTOCOL_ERROR,
    S_ENABLE_PUSH,
    S_INITIAL_WINDOW_SIZE,
    S_MAX_CONCURRENT_STREAMS,
    S_MAX_FRAME_SIZE,
    S_MAX_HEADER_LIST_SIZE,
    SETTING,
    SETTINGS,
    U32,
    frame,
    window_update,
)
from extproc.transport.h2.limits import (
    IDLE_DRAIN_S,
    MAX_HEADER_LIST,
    MAX_SETTINGS_ENTRIES,
    NOOP_BURST,
    NOOP_RATE,
    OUR_MAX_FRAME,
    PING_BURST,
    PING_RATE,
    RESET_RATE,
    SETTINGS_BURST,
    SETTINGS_RATE,
    Budget,
    H2Limits,
)

__all__ = ["KEEPALIVE_PING", "Control"]

log = logging.getLogger("extproc.h2")

KEEPALIVE_PING = b"llm-keep"  # the payload of our keepalive PINGs


class Control(Flow):
    """Connection-wide frames, rate limits and time (see the module docstring)."""

    def __init__(self, host: Host, limits: H2Limits, counters: Counters, now: float) -> None:
        super().__init__(host, limits, counters)
        self._settings_seen = False  # the client's first SETTINGS arrived (handshake done)
        self._flush_wanted = False  # a window grew: flush blocked calls at the end of the batch
        self._now = now  # the time of the bytes being handled
        # Rate limits.
        self._resets = Budget(max(limits.max_streams, 100), RESET_RATE, now)
        self._pings = Budget(PING_BURST, PING_RATE, now)
        self._settings_budget = Budget(SETTINGS_BURST, SETTINGS_RATE, now)
        self._noop = Budget(NOOP_BURST, NOOP_RATE, now)
        # Time: ``tick`` reads these.
        self._rx = 0  # reads so far; the tick notices a change
        self._rx_seen = 0
        self._heard_at = now
        self._ping_sent_at: float | None = None
        self._seen_id = 0
        self._idle_since = now
        self._draining_since: float | None = None

    @property
    def handshake_done(self) -> bool:
        return self._settings_seen

    def initiate(self) -> None:
        """Our SETTINGS, and the connection window opened to ``connection_window``."""
        limits = self.limits
        settings = b"".join(
            SETTING.pack(ident, value)
            for ident, value in (
                (S_MAX_CONCURRENT_STREAMS, limits.max_streams),
                (S_INITIAL_WINDOW_SIZE, limits.stream_window),
                (S_MAX_FRAME_SIZE, OUR_MAX_FRAME),
                (S_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST),
            )
        )
        self._write(frame(SETTINGS, 0, 0, settings))
        grow = limits.connection_window - DEFAULT_WINDOW
        if grow > 0:
            self._write(window_update(0, grow))
        self._recv_window = limits.connection_window

    def _take(self, budget: Budget, why: str) -> None:
        if not budget.take(self._now):
            raise ConnectionFailure(ENHANCE_YOUR_CALM, why)

    # --- connection-wide frames ---------------------------------------------------------------

    def _on_settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid:
            raise ConnectionFailure(PROTOCOL_ERROR, "SETTINGS on a stream")
        self._take(self._settings_budget, "too many SETTINGS")
        if flags & ACK:
            if payload:
                raise ConnectionFailure(FRAME_SIZE_ERROR, "bad SETTINGS")
            return
        if len(payload) % 6:
            raise ConnectionFailure(FRAME_SIZE_ERROR, "bad SETTINGS")
        if len(payload) > MAX_SETTINGS_ENTRIES * 6:
            raise ConnectionFailure(ENHANCE_YOUR_CALM, "too many settings")
        for ident, value in SETTING.iter_unpack(payload):
            if ident == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ConnectionFailure(FLOW_CONTROL_ERROR, "bad SETTINGS")
                if value > self._peer_initial_window and self._blocked:
                    self._flush_wanted = True  # once, at the end of the batch
                self._peer_initial_window = value
            elif ident == S_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= LARGEST_FRAME:
                    raise ConnectionFailure(PROTOCOL_ERROR, "bad SETTINGS")
                self._peer_max_frame = value
            elif ident == S_ENABLE_PUSH and value > 1:
                raise ConnectionFailure(PROTOCOL_ERROR, "bad SETTINGS")
            # HEADER_TABLE_SIZE: our header blocks never use the dynamic table. The others
            # concern streams we would open (none) or limits we stay far below.
        self._write(frame(SETTINGS, ACK, 0))
        self._settings_seen = True

    def _on_ping(self, flags: int, sid: int, payload: bytes) -> None:
        if sid:
            raise ConnectionFailure(PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise ConnectionFailure(FRAME_SIZE_ERROR, "bad PING")
        self._take(self._pings, "too many PINGs")
        if flags & ACK:
            if payload == KEEPALIVE_PING:
                self._ping_sent_at = None
            return
        self._write(frame(PING, ACK, 0, payload))

    def _on_window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionFailure(FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
        increment = U32.unpack(payload)[0] & 0x7FFFFFFF
        if not sid:
            if not increment:
                raise ConnectionFailure(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ConnectionFailure(FLOW_CONTROL_ERROR, "flow control", "window overflow")
            if self._blocked:
                self._flush_wanted = True  # once, at the end of the batch
            return
        call = self.calls.get(sid)
        if call is None:
            if sid > self._last_id:
                raise ConnectionFailure(PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
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

    # --- time, and the end --------------------------------------------------------------------

    def handshake_expired(self) -> None:
        """The handshake timeout passed: without the preface and first SETTINGS, fail."""
        if not self._settings_seen and not self.closed:
            self.counters.timeouts += 1
            log.warning("closing an HTTP/2 connection: no preface and SETTINGS in time")
            self._fail(PROTOCOL_ERROR, "handshake timeout")

    def tick(self, now: float) -> None:
        """The server's tick (at most a second apart): idle connections, silent peers."""
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
            self.counters.timeouts += 1
            self._goaway(NO_ERROR, "idle", last_id=MAX_WINDOW)
            self._draining_since = now
            return
        if self._rx != self._rx_seen:
            self._rx_seen = self._rx
            self._heard_at = now
        if self._ping_sent_at is not None:
            if now - self._ping_sent_at >= limits.ping_timeout:
                self.counters.timeouts += 1
                log.warning("closing an HTTP/2 connection: no PING ACK in time")
                self._cancel_all()
                self.closed = True
                self.host.abort()
        elif self.calls and now - self._heard_at >= limits.ping_interval:
            self._ping_sent_at = now
            self._write(frame(PING, 0, 0, KEEPALIVE_PING))

    def use_mark(self) -> int | None:
        """None while a call that keeps the connection in place is open (``keeping``: its
        first message arrived and its method keeps its connection); else the highest stream
        the peer opened (0: none), which grows with use. ``idle.IdleOrder`` reads it."""
        return None if self.keeping else self._last_id

    def displace(self) -> None:
        """A newcomer takes this connection's place (no call keeps it: it has none, or only
        calls without a first message, or watches): the final GOAWAY, NO_ERROR, the calls
        still open cancelled, then the close."""
        if self.closed:
            return
        self.counters.displaced += 1
        self._goaway(NO_ERROR, "too many connections")
        self._cancel_all()
        self._close()

    def shutdown(self) -> None:
        """The server stops: GOAWAY, new streams refused, open ones finish."""
        self._goaway(NO_ERROR)

    def cancel_calls(self) -> None:
        """The server's grace is over: cancel every call (the shell closes next)."""
        self._cancel_all()
