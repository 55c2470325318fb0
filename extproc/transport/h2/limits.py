"""The bounds of the h2 server: every resource a peer can make it spend, with its value and why.

Two kinds. ``H2Limits`` holds the bounds that follow from a server's parameters (the message
size, the streams, the connections, the windows and queues sized from them, the timeouts),
resolved once by ``H2Limits.resolve``; their defaults are the ``DEFAULT_*`` constants. The
other constants are the same for every server. docs/transport.md lists them all, with the
test that pins each.

``Budget`` is the token bucket the connection draws on for frames that do nothing useful or
that make it answer (resets, PINGs, SETTINGS, empty frames); it is given the time, as the
connection is. ``Counters`` counts, for a whole server, what its connections refused and ended.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict, Unpack

from extproc.transport.h2.frames import DEFAULT_WINDOW, MAX_WINDOW

__all__ = [
    "BACKLOG",
    "CALL_WORK",
    "CLOSE_GRACE_S",
    "DECODE_COST_SHIFT",
    "DEFAULT_HANDSHAKE_TIMEOUT_S",
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_STREAMS",
    "DEFAULT_PING_INTERVAL_S",
    "DEFAULT_PING_TIMEOUT_S",
    "GOAWAY_LINGER_S",
    "HEADER_CACHE_BYTES",
    "HEADER_FIELD_COST",
    "IDLE_DRAIN_S",
    "MAX_CONTINUATIONS",
    "MAX_GRPC_MESSAGE",
    "MAX_HEADER_BLOCK",
    "MAX_HEADER_FIELDS",
    "MAX_HEADER_LIST",
    "MAX_SETTINGS_ENTRIES",
    "NOOP_BURST",
    "NOOP_RATE",
    "OUR_MAX_FRAME",
    "PING_BURST",
    "PING_RATE",
    "RESET_RATE",
    "SETTINGS_BURST",
    "SETTINGS_RATE",
    "SLICE_WORK",
    "STALL_WINDOW",
    "TCP_KEEPCNT",
    "TCP_KEEPIDLE_S",
    "TCP_KEEPINTVL_S",
    "TCP_USER_TIMEOUT_MS",
    "WRITE_HIGH",
    "WRITE_LOW",
    "Budget",
    "Counters",
    "H2Limits",
    "LimitOptions",
]

# --- frames in -------------------------------------------------------------------------------
# What we accept per frame. Fewer, larger frames for big request bodies; a frame is buffered
# whole before it is handled, so this is also what one connection's frame buffer can hold.
OUR_MAX_FRAME = 1 << 20
# SETTINGS entries per frame: the protocol defines six; more is a flood, not a configuration.
MAX_SETTINGS_ENTRIES = 32
# A stall is looked for only once the peer can send (almost) nothing more: with bytes still
# on their way, incomplete messages may yet complete.
STALL_WINDOW = 1024

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
DECODE_COST_SHIFT = 3
CALL_WORK = 8

# --- rate limits (token buckets per connection: burst, then per second) ------------------------
# RST_STREAM of a stream we had not yet answered, and streams refused: the rapid-reset pattern.
# Envoy resets ext_proc streams when clients leave and when streams are done (the 10,000-
# request disconnect storm of tests/e2e/test_faults.py: ~7,500 resets), but almost always
# after our first answer (it sends request headers at once and we answer in ~1 ms; 20 of those
# 7,500 came before it), so resets after an answer are free; the burst lets every stream of a
# connection go at once (``max_streams``, at least 100).
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
# After a connection error's GOAWAY, how long before the close: closing at once, with the
# peer's bytes still unread, would make the kernel send a reset, which can destroy the GOAWAY
# before the peer reads it.
GOAWAY_LINGER_S = 0.1
# A closing connection whose peer does not read what is left is aborted after this long.
CLOSE_GRACE_S = 1.0
# No time bound on a call's first message: a call keeps its connection from being displaced
# at max_connections from the frame that completes its first message, and not before
# (``idle``). A grace (say 1 s) in which a silent call counted would be renewed by every
# stream a peer opens: one silent HEADERS a second per connection would hold every place.

# --- the defaults of H2Server's parameters (see H2Limits.resolve) ------------------------------
DEFAULT_MAX_STREAMS = 4096
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0
DEFAULT_IDLE_TIMEOUT_S = 600.0
DEFAULT_PING_INTERVAL_S = 30.0
DEFAULT_PING_TIMEOUT_S = 20.0


class LimitOptions(TypedDict, total=False):
    """``H2Server``'s parameters beside ``max_message``, all optional: their defaults are the
    ``DEFAULT_*`` above (``connection_window`` and ``send_queue``: four messages)."""

    max_streams: int
    max_connections: int
    connection_window: int | None
    send_queue: int | None
    handshake_timeout: float
    idle_timeout: float
    ping_interval: float
    ping_timeout: float


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

    @classmethod
    def resolve(cls, *, max_message: int, **options: Unpack[LimitOptions]) -> H2Limits:
        """The bounds from ``H2Server``'s parameters, with the defaults for those not given.
        The windows and queues follow from the message size: a stream window of one message
        (at least the protocol's default), a connection window and a send queue of four
        messages unless given (never below one stream window)."""
        unknown = options.keys() - LimitOptions.__optional_keys__
        if unknown:
            raise TypeError(f"unknown H2Server parameters: {', '.join(sorted(unknown))}")
        stream_window = min(MAX_WINDOW, max(max_message + 5, DEFAULT_WINDOW))
        connection_window = options.get("connection_window") or 4 * max_message
        send_queue = options.get("send_queue") or 4 * max_message
        return cls(
            max_message=max_message,
            max_streams=options.get("max_streams", DEFAULT_MAX_STREAMS),
            max_connections=options.get("max_connections", DEFAULT_MAX_CONNECTIONS),
            stream_window=stream_window,
            connection_window=min(MAX_WINDOW, max(stream_window, connection_window)),
            send_queue=max(stream_window, send_queue),
            handshake_timeout=options.get("handshake_timeout", DEFAULT_HANDSHAKE_TIMEOUT_S),
            idle_timeout=options.get("idle_timeout", DEFAULT_IDLE_TIMEOUT_S),
            ping_interval=options.get("ping_interval", DEFAULT_PING_INTERVAL_S),
            ping_timeout=options.get("ping_timeout", DEFAULT_PING_TIMEOUT_S),
        )


class Budget:
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


@dataclass(slots=True)
class Counters:
    """What a server's connections refused and ended, for ``H2Server.statistics``."""

    refused_connections: int = 0
    displaced: int = 0  # connections closed to make room for a new one
    refused_streams: int = 0
    calm: int = 0
    protocol_errors: int = 0
    timeouts: int = 0
    stalls_broken: int = 0
