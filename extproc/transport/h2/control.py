"""The connection as a whole: the peer's SETTINGS and PINGs, the token buckets, the timers. A
part of the connection that, like the flow-control parts, does no I/O and knows no connection:
it checks a frame and returns the answer (the peer's window and frame size then go to
``flow.Outbound``), and ``tick`` returns what the time calls for.

Frames that do nothing useful or make us answer draw on token buckets (resets and refused
streams ``reset``, PINGs, SETTINGS, no-op frames ``noop``), at the time of the bytes being
handled: ENHANCE_YOUR_CALM when one runs dry. ``tick(now)`` comes at most a second apart. A
connection with no open call for ``idle_timeout`` gets GOAWAY in two steps (RFC 9113 6.8): the
first names stream 2^31-1, so that streams on their way are still served (``IDLE``), the final
one ``IDLE_DRAIN_S`` later, once no call is open, then the close (``DRAINED``). While calls are
open and the peer has been silent for ``ping_interval`` we PING it (``PING_DUE``), and drop the
connection after ``ping_timeout`` without the ACK (``PING_LOST``).
"""

from __future__ import annotations

from extproc.transport.h2 import frames
from extproc.transport.h2.frames import ACK, SETTING, ConnectionFailure, frame
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

__all__ = ["DRAINED", "IDLE", "KEEPALIVE_PING", "PING_DUE", "PING_LOST", "Control"]

KEEPALIVE_PING = b"llm-keep"  # the payload of our keepalive PINGs
IDLE, DRAINED, PING_DUE, PING_LOST = 1, 2, 3, 4  # what ``tick`` calls for
_ACK = frame(frames.SETTINGS, ACK, 0)


def _take(budget: Budget, now: float, why: str) -> None:
    if not budget.take(now):
        raise ConnectionFailure(frames.ENHANCE_YOUR_CALM, why)


class Control:
    """Settings, PINGs, token buckets and timers (see the module docstring)."""

    def __init__(self, limits: H2Limits, now: float) -> None:
        self._limits = limits
        self._resets = Budget(max(limits.max_streams, 100), RESET_RATE, now)
        self._pings = Budget(PING_BURST, PING_RATE, now)
        self._settings = Budget(SETTINGS_BURST, SETTINGS_RATE, now)
        self._noop = Budget(NOOP_BURST, NOOP_RATE, now)
        self._rx_seen = 0  # the peer's reads that ``tick`` last saw
        self._heard_at = now
        self._ping_sent_at: float | None = None
        self._seen_id = 0
        self._idle_since = now
        self._draining_since: float | None = None

    def our_settings(self) -> bytes:
        """The SETTINGS we open the connection with."""
        limits = self._limits
        entries = (
            (frames.S_MAX_CONCURRENT_STREAMS, limits.max_streams),
            (frames.S_INITIAL_WINDOW_SIZE, limits.stream_window),
            (frames.S_MAX_FRAME_SIZE, OUR_MAX_FRAME),
            (frames.S_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST),
        )
        return frame(frames.SETTINGS, 0, 0, b"".join(SETTING.pack(*e) for e in entries))

    def noop(self, now: float, why: str) -> None:
        _take(self._noop, now, why)

    def reset(self, now: float, why: str) -> None:
        _take(self._resets, now, why)

    def settings(self, flags: int, sid: int, payload: bytes, now: float) -> bytes:
        """A SETTINGS frame, checked whole: the ACK to send once it is applied (b"" for an
        ACK of ours)."""
        if sid:
            raise ConnectionFailure(frames.PROTOCOL_ERROR, "SETTINGS on a stream")
        _take(self._settings, now, "too many SETTINGS")
        if flags & ACK:
            if payload:
                raise ConnectionFailure(frames.FRAME_SIZE_ERROR, "bad SETTINGS")
            return b""
        if len(payload) % 6:
            raise ConnectionFailure(frames.FRAME_SIZE_ERROR, "bad SETTINGS")
        if len(payload) > MAX_SETTINGS_ENTRIES * 6:
            raise ConnectionFailure(frames.ENHANCE_YOUR_CALM, "too many settings")
        for ident, value in SETTING.iter_unpack(payload):
            if ident == frames.S_INITIAL_WINDOW_SIZE and value > frames.MAX_WINDOW:
                raise ConnectionFailure(frames.FLOW_CONTROL_ERROR, "bad SETTINGS")
            if ident == frames.S_MAX_FRAME_SIZE and not (
                frames.DEFAULT_FRAME <= value <= frames.LARGEST_FRAME
            ):
                raise ConnectionFailure(frames.PROTOCOL_ERROR, "bad SETTINGS")
            if ident == frames.S_ENABLE_PUSH and value > 1:
                raise ConnectionFailure(frames.PROTOCOL_ERROR, "bad SETTINGS")
            # HEADER_TABLE_SIZE: our header blocks never use the dynamic table. The others
            # concern streams we would open (none) or limits we stay far below.
        return _ACK

    def ping(self, flags: int, sid: int, payload: bytes, now: float) -> bytes:
        """A PING frame: the ACK to send (b"" for an ACK)."""
        if sid:
            raise ConnectionFailure(frames.PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise ConnectionFailure(frames.FRAME_SIZE_ERROR, "bad PING")
        _take(self._pings, now, "too many PINGs")
        if flags & ACK:
            if payload == KEEPALIVE_PING:
                self._ping_sent_at = None
            return b""
        return frame(frames.PING, ACK, 0, payload)

    def tick(self, now: float, calls: int, last_id: int, rx: int) -> int:
        """What the time calls for (0: nothing), given the open calls, the highest stream the
        peer opened and its reads so far."""
        limits = self._limits
        if self._draining_since is not None:
            if not calls and now - self._draining_since >= IDLE_DRAIN_S:
                return DRAINED
        elif calls or last_id != self._seen_id:
            self._seen_id = last_id
            self._idle_since = now
        elif now - self._idle_since >= limits.idle_timeout:
            self._draining_since = now
            return IDLE
        if rx != self._rx_seen:
            self._rx_seen = rx
            self._heard_at = now
        if self._ping_sent_at is not None:
            if now - self._ping_sent_at >= limits.ping_timeout:
                return PING_LOST
        elif calls and now - self._heard_at >= limits.ping_interval:
            self._ping_sent_at = now
            return PING_DUE
        return 0
