"""The h2 transport's sans-IO connection, driven with bytes: no event loop, no sockets, no
sleeps. The time is a number the test moves (``tests/service/h2_sansio.py``).

Table-driven: every protocol error the connection answers with GOAWAY (its code and fixed
debug string), the stream errors it answers with RST_STREAM, the token buckets (exactly the
burst passes, the next frame is refused, the rate refills), flow control both ways (credit in
batches, a closed peer window, the send queue, the stall breaker), bad messages, header
validation, the timeouts, the slice of work per read, stop and loss. The socket tests
(test_h2.py, test_h2_hostile.py, test_h2_fuzz.py) run the same rules through the asyncio
server; where a hostile test only needs the connection, its twin here says so.
"""

from __future__ import annotations

import hpack
import pytest

from extproc.transport.h2 import EOF, CallAbort, Method, StatusCode
from extproc.transport.h2.control import KEEPALIVE_PING
from extproc.transport.h2.frames import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    HEADER,
    HEADERS,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTING,
    SETTINGS,
    U32,
    WINDOW_UPDATE,
    frame,
)
from extproc.transport.h2.headers import NOT_GRPC, OK_TRAILERS
from extproc.transport.h2.limits import (
    GOAWAY_LINGER_S,
    HEADER_CACHE_BYTES,
    IDLE_DRAIN_S,
    MAX_HEADER_BLOCK,
    MAX_HEADER_LIST,
    NOOP_BURST,
    OUR_MAX_FRAME,
    PING_BURST,
    PING_RATE,
    SETTINGS_BURST,
    SLICE_WORK,
)
from tests.service.h2_peer import grpc_msg, request_block
from tests.service.h2_sansio import MAX_MESSAGE, METHODS, Peer, Raw, goaway_of, held

ECHO = request_block("/t.T/Echo")
SINK = request_block("/t.T/Sink")


def opened(raw: Raw, sid: int = 1, block: bytes = SINK) -> None:
    raw.send(frame(HEADERS, END_HEADERS, sid, block))
    assert raw.take_events() == [("start", sid)]


def feed(raw: Raw, data: bytes) -> None:
    """Send, then the turns of the loop a backlog needs."""
    more = raw.send(data)
    while more:
        more = raw.conn.resume(raw.now)


def header(length: int, ftype: int, sid: int) -> bytes:
    return HEADER.pack(length >> 16, length & 0xFFFF, ftype, 0, sid)


def setting(ident: int, value: int) -> bytes:
    return frame(SETTINGS, 0, 0, SETTING.pack(ident, value))


# --- the handshake -----------------------------------------------------------------------------


def test_the_handshake_announces_the_bounds() -> None:
    raw = Raw(handshake=False)
    (settings, update) = raw.announced
    assert settings[:3] == (SETTINGS, 0, 0)
    assert dict(SETTING.iter_unpack(settings[3])) == {
        3: raw.limits.max_streams,
        4: MAX_MESSAGE + 5,
        5: OUR_MAX_FRAME,
        6: MAX_HEADER_LIST,
    }
    assert update == (WINDOW_UPDATE, 0, 0, U32.pack(4 * MAX_MESSAGE - DEFAULT_WINDOW))
    assert not raw.conn.handshake_done
    raw.send(PREFACE[:10])
    raw.send(PREFACE[10:] + frame(SETTINGS, 0, 0))
    assert raw.read() == [(SETTINGS, ACK, 0, b"")] and raw.conn.handshake_done


def test_an_exchange_with_h2s_client() -> None:
    peer = Peer()
    sid = peer.open()
    peer.pump()
    assert peer.take_events() == [("start", sid)]
    call = peer.conn.calls[sid]
    peer.h2.send_data(sid, grpc_msg(b"hello"))
    peer.pump()
    assert call.take() == b"hello" and call.take() is None
    peer.conn.send_message(call, b"world")
    peer.h2.end_stream(sid)
    peer.pump()
    assert call.take() is EOF
    peer.conn.complete(call, OK_TRAILERS)
    peer.pump()
    headers, data, trailers = peer.answer_of(sid)
    assert headers == {":status": "200", "content-type": "application/grpc"}
    assert (data, trailers) == (grpc_msg(b"world"), {"grpc-status": "0"})
    assert peer.conn.calls == {} and peer.host.ended == 1
    assert held(peer.conn) == {"calls": 0, "buffered": 0, "queued": 0}


# --- protocol errors: GOAWAY ------------------------------------------------------------------

BIG_BLOCK = b"\x00\x01x\x00" * 1300  # 5,200 bytes of empty literals, no table change
CONNECTION_ERRORS = {
    "data-on-stream-0": (frame(DATA, 0, 0, b"x"), PROTOCOL_ERROR, b"DATA on stream 0"),
    "data-on-idle-stream": (frame(DATA, 0, 1, b"x"), PROTOCOL_ERROR, b"DATA on an idle stream"),
    "headers-on-stream-0": (
        frame(HEADERS, END_HEADERS, 0, ECHO),
        PROTOCOL_ERROR,
        b"HEADERS on stream 0",
    ),
    "even-stream": (
        frame(HEADERS, END_HEADERS, 2, ECHO),
        PROTOCOL_ERROR,
        b"even stream id from a client",
    ),
    "push-promise": (
        frame(PUSH_PROMISE, END_HEADERS, 1, U32.pack(2)),
        PROTOCOL_ERROR,
        b"PUSH_PROMISE from a client",
    ),
    "frame-too-large": (header(OUR_MAX_FRAME + 1, DATA, 1), FRAME_SIZE_ERROR, b"frame too large"),
    "headers-too-large": (
        header(MAX_HEADER_BLOCK + 1, HEADERS, 1),
        ENHANCE_YOUR_CALM,
        b"header block too large",
    ),
    "data-beyond-the-connection-window": (
        header(4 * MAX_MESSAGE + 1, DATA, 1),
        FLOW_CONTROL_ERROR,
        b"flow control",
    ),
    "expected-continuation": (
        frame(HEADERS, 0, 1, ECHO[:3]) + frame(PING, 0, 0, b"12345678"),
        PROTOCOL_ERROR,
        b"expected CONTINUATION",
    ),
    "unexpected-continuation": (
        frame(CONTINUATION, END_HEADERS, 1, ECHO),
        PROTOCOL_ERROR,
        b"unexpected CONTINUATION",
    ),
    "too-many-continuations": (
        frame(HEADERS, 0, 1, b"\x82") + frame(CONTINUATION, 0, 1, b"\x82") * 17,
        ENHANCE_YOUR_CALM,
        b"too many CONTINUATION frames",
    ),
    "block-too-large-over-continuation": (
        frame(HEADERS, 0, 1, BIG_BLOCK) + frame(CONTINUATION, END_HEADERS, 1, BIG_BLOCK),
        ENHANCE_YOUR_CALM,
        b"header block too large",
    ),
    "data-padding": (
        frame(HEADERS, END_HEADERS, 1, SINK) + frame(DATA, PADDED, 1, b"\x0ax"),
        PROTOCOL_ERROR,
        b"bad padding",
    ),
    "headers-padding": (
        frame(HEADERS, END_HEADERS | PADDED, 1, bytes([200]) + ECHO),
        PROTOCOL_ERROR,
        b"bad padding",
    ),
    "headers-priority-cut": (
        frame(HEADERS, END_HEADERS | PRIORITY_FLAG, 1, b"\0\0"),
        FRAME_SIZE_ERROR,
        b"bad HEADERS",
    ),
    "rst-length": (frame(RST_STREAM, 0, 1, b"\0"), FRAME_SIZE_ERROR, b"bad RST_STREAM"),
    "rst-on-stream-0": (
        frame(RST_STREAM, 0, 0, U32.pack(8)),
        PROTOCOL_ERROR,
        b"RST_STREAM on stream 0",
    ),
    "rst-idle": (
        frame(RST_STREAM, 0, 1, U32.pack(8)),
        PROTOCOL_ERROR,
        b"RST_STREAM on an idle stream",
    ),
    "settings-on-a-stream": (frame(SETTINGS, 0, 1), PROTOCOL_ERROR, b"SETTINGS on a stream"),
    "settings-length": (frame(SETTINGS, 0, 0, b"\0" * 5), FRAME_SIZE_ERROR, b"bad SETTINGS"),
    "settings-ack-payload": (frame(SETTINGS, ACK, 0, b"\0" * 6), FRAME_SIZE_ERROR, b"bad SETTINGS"),
    "too-many-settings": (
        frame(SETTINGS, 0, 0, SETTING.pack(1, 0) * 33),
        ENHANCE_YOUR_CALM,
        b"too many settings",
    ),
    "initial-window-too-large": (setting(4, 2**31), FLOW_CONTROL_ERROR, b"bad SETTINGS"),
    "max-frame-too-small": (setting(5, 16383), PROTOCOL_ERROR, b"bad SETTINGS"),
    "max-frame-too-large": (setting(5, 2**24), PROTOCOL_ERROR, b"bad SETTINGS"),
    "enable-push-2": (setting(2, 2), PROTOCOL_ERROR, b"bad SETTINGS"),
    "ping-on-a-stream": (frame(PING, 0, 1, b"12345678"), PROTOCOL_ERROR, b"PING on a stream"),
    "ping-length": (frame(PING, 0, 0, b"1234567"), FRAME_SIZE_ERROR, b"bad PING"),
    "window-update-length": (
        frame(WINDOW_UPDATE, 0, 0, b"\0" * 3),
        FRAME_SIZE_ERROR,
        b"bad WINDOW_UPDATE",
    ),
    "window-update-of-0": (
        frame(WINDOW_UPDATE, 0, 0, U32.pack(0)),
        PROTOCOL_ERROR,
        b"WINDOW_UPDATE of 0",
    ),
    "window-overflow": (
        frame(WINDOW_UPDATE, 0, 0, U32.pack(MAX_WINDOW)),
        FLOW_CONTROL_ERROR,
        b"flow control",
    ),
    "window-update-idle": (
        frame(WINDOW_UPDATE, 0, 1, U32.pack(1)),
        PROTOCOL_ERROR,
        b"WINDOW_UPDATE on an idle stream",
    ),
    "three-table-size-updates": (
        frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\x20\x20\x20" + ECHO),
        COMPRESSION_ERROR,
        b"compression error",
    ),
    "table-size-update-after-a-field": (
        frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\x82\x20" + ECHO),
        COMPRESSION_ERROR,
        b"compression error",
    ),
    "too-many-fields": (
        frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\x00\x00\x00" * 300),
        COMPRESSION_ERROR,
        b"compression error",
    ),
    "hpack-integer-cut-short": (
        frame(HEADERS, END_HEADERS, 1, b"\xff"),
        COMPRESSION_ERROR,
        b"compression error",
    ),
}


@pytest.mark.parametrize("wire, code, debug", CONNECTION_ERRORS.values(), ids=CONNECTION_ERRORS)
def test_protocol_errors_end_the_connection(wire: bytes, code: int, debug: bytes) -> None:
    raw = Raw()
    raw.send(wire)
    goaway = goaway_of(raw.read())
    assert goaway is not None and goaway[1:] == (code, debug), goaway
    assert raw.conn.closed and ("close", GOAWAY_LINGER_S) in raw.take_events()
    counted = raw.counters.calm if code == ENHANCE_YOUR_CALM else raw.counters.protocol_errors
    assert counted == 1
    raw.send(frame(PING, 0, 0, b"12345678"))  # read and dropped, until the close
    assert raw.read() == []


BEFORE_SETTINGS = {
    "bad-preface": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"bad preface"),
    "bad-preface-start": (b"PRI * HTTP/1.1", b"bad preface"),
    "ping-first": (PREFACE + frame(PING, 0, 0, b"12345678"), b"expected SETTINGS"),
    "headers-first": (PREFACE + frame(HEADERS, END_HEADERS, 1, ECHO), b"expected SETTINGS"),
    "data-first": (PREFACE + frame(DATA, 0, 1, b"x"), b"expected SETTINGS"),
}


@pytest.mark.parametrize("wire, debug", BEFORE_SETTINGS.values(), ids=BEFORE_SETTINGS)
def test_the_preface_and_settings_come_first(wire: bytes, debug: bytes) -> None:
    raw = Raw(handshake=False)
    raw.send(wire)
    assert goaway_of(raw.read()) == (0, PROTOCOL_ERROR, debug)


# --- stream errors: RST_STREAM ----------------------------------------------------------------

_80K = grpc_msg(b"m" * 60_000) + grpc_msg(b"n" * 20_000)  # past one stream window (65,541)
STREAM_ERRORS = {
    "window-update-of-0": (frame(WINDOW_UPDATE, 0, 1, U32.pack(0)), PROTOCOL_ERROR),
    "window-update-overflow": (
        frame(WINDOW_UPDATE, 0, 1, U32.pack(MAX_WINDOW)),
        FLOW_CONTROL_ERROR,
    ),
    "data-beyond-the-stream-window": (
        b"".join(frame(DATA, 0, 1, _80K[i : i + 16384]) for i in range(0, len(_80K), 16384)),
        FLOW_CONTROL_ERROR,
    ),
    "headers-again-without-end": (frame(HEADERS, END_HEADERS, 1, SINK), PROTOCOL_ERROR),
}


@pytest.mark.parametrize("wire, code", STREAM_ERRORS.values(), ids=STREAM_ERRORS)
def test_stream_errors_reset_only_that_stream(wire: bytes, code: int) -> None:
    raw = Raw()
    opened(raw)
    raw.send(wire)
    frames = raw.read()
    assert [(f[2], f[3]) for f in frames if f[0] == RST_STREAM] == [(1, U32.pack(code))]
    assert goaway_of(frames) is None and raw.take_events() == [("cancel", 1)]
    assert held(raw.conn) == {"calls": 0, "buffered": 0, "queued": 0}
    opened(raw, 3)  # the connection goes on


# --- token buckets ------------------------------------------------------------------------------


def _rapid_reset(sid: int) -> bytes:
    return frame(HEADERS, END_HEADERS, sid, SINK) + frame(RST_STREAM, 0, sid, U32.pack(8))


# name: (options, set-up, one flooding frame (by index), how many pass, GOAWAY debug)
BUCKETS = {
    "ping": ({}, b"", lambda i: frame(PING, 0, 0, b"12345678"), PING_BURST, b"too many PINGs"),
    # The handshake's SETTINGS took one token.
    "settings": ({}, b"", lambda i: setting(4, 65535), SETTINGS_BURST - 1, b"too many SETTINGS"),
    "priority": (
        {},
        b"",
        lambda i: frame(PRIORITY, 0, 1, b"\0\0\0\0\x10"),
        NOOP_BURST,
        b"too many no-op frames",
    ),
    "unknown-type": (
        {},
        b"",
        lambda i: frame(0x0C, 0, 0, b"?"),
        NOOP_BURST,
        b"too many no-op frames",
    ),
    "empty-data": (
        {},
        frame(HEADERS, END_HEADERS, 1, SINK),
        lambda i: frame(DATA, 0, 1),
        NOOP_BURST,
        b"too many empty frames",
    ),
    "late-headers": (
        {},
        _rapid_reset(1),
        lambda i: frame(HEADERS, END_HEADERS | END_STREAM, 1, SINK),
        NOOP_BURST,
        b"too many frames for closed streams",
    ),
    # The burst is max(max_streams, 100); the set-up's reset took one token.
    "rapid-reset": (
        {"max_streams": 150},
        _rapid_reset(1),
        lambda i: _rapid_reset(3 + 2 * i),
        149,
        b"too many resets",
    ),
    # Refused streams draw on the same bucket.
    "refused-streams": (
        {"max_streams": 1},
        frame(HEADERS, END_HEADERS, 1, SINK),
        lambda i: frame(HEADERS, END_HEADERS, 3 + 2 * i, SINK),
        100,
        b"too many refused streams",
    ),
}


@pytest.mark.parametrize("options, setup, flood, passes, debug", BUCKETS.values(), ids=BUCKETS)
def test_token_buckets_pass_their_burst_then_refuse(
    options: dict[str, int], setup: bytes, flood: object, passes: int, debug: bytes
) -> None:
    assert callable(flood)
    raw = Raw(**options)
    feed(raw, setup)
    feed(raw, b"".join(flood(i) for i in range(passes)))
    assert goaway_of(raw.read()) is None and not raw.conn.closed
    feed(raw, flood(passes))
    assert goaway_of(raw.read()) == (raw.conn.session.last_id, ENHANCE_YOUR_CALM, debug)
    assert raw.counters.calm == 1


def test_a_bucket_refills_at_its_rate() -> None:
    raw = Raw()
    ping = frame(PING, 0, 0, b"12345678")
    raw.send(ping * PING_BURST)
    raw.now += 1.0  # PING_RATE more
    raw.send(ping * int(PING_RATE))
    assert goaway_of(raw.read()) is None
    raw.send(ping)
    assert goaway_of(raw.read()) == (0, ENHANCE_YOUR_CALM, b"too many PINGs")


def test_resets_after_an_answer_are_free() -> None:
    """What Envoy does when clients leave: streams answered, then reset (twin of the
    disconnect storm before test_h2_hostile's rapid-reset flood)."""
    raw = Raw(max_streams=100)
    for i in range(1000):
        sid = 1 + 2 * i
        opened(raw, sid)
        raw.conn.send_message(raw.conn.calls[sid], b"x")
        raw.send(frame(RST_STREAM, 0, sid, U32.pack(8)))
        assert raw.take_events() == [("cancel", sid)]
    assert goaway_of(raw.read()) is None and raw.conn.calls == {}


# --- flow control -------------------------------------------------------------------------------


def test_credit_goes_back_in_batches_as_messages_are_read() -> None:
    """A stream's credit goes back at half a stream window, the connection's at a quarter of
    its window: nothing per message."""
    raw = Raw()
    opened(raw)
    call = raw.conn.calls[1]
    updates = []
    for _ in range(7):
        raw.send(frame(DATA, 0, 1, grpc_msg(b"r" * 10_000)))
        assert call.take() == b"r" * 10_000
        updates.append([(f[2], U32.unpack(f[3])[0]) for f in raw.read()])
    assert updates == [[], [], [], [(1, 40_020)], [], [], [(0, 70_035)]]
    held(raw.conn)


def test_a_closed_peer_window_holds_the_answer_until_it_opens() -> None:
    raw = Raw(handshake=False)
    raw.send(PREFACE + frame(SETTINGS, 0, 0, SETTING.pack(4, 100)))
    raw.read()
    opened(raw)
    call = raw.conn.calls[1]
    raw.conn.send_message(call, b"0123456789" * 100)
    raw.conn.complete(call, OK_TRAILERS)
    frames = raw.read()
    assert [f[0] for f in frames] == [HEADERS, DATA] and len(frames[1][3]) == 100
    assert raw.conn.queued_out == 905 and raw.conn.calls  # the trailers wait behind the data
    raw.send(frame(WINDOW_UPDATE, 0, 1, U32.pack(10_000)))
    frames = raw.read()
    assert [f[0] for f in frames] == [DATA, HEADERS, RST_STREAM]  # RST: the client still sends
    assert len(frames[0][3]) == 905 and frames[1][1] == END_HEADERS | END_STREAM
    assert raw.conn.calls == {} and raw.conn.queued_out == 0


def test_answers_waiting_for_the_window_are_bounded_by_the_send_queue() -> None:
    raw = Raw(handshake=False)
    raw.send(PREFACE + frame(SETTINGS, 0, 0, SETTING.pack(4, 0)))
    opened(raw)
    call = raw.conn.calls[1]
    while not raw.conn.closed:
        raw.conn.send_message(call, b"q" * 1000)
    assert raw.conn.queued_out <= raw.limits.send_queue + 1005
    assert goaway_of(raw.read()) == (1, ENHANCE_YOUR_CALM, b"send queue full")
    assert raw.take_events() == [("cancel", 1), ("close", GOAWAY_LINGER_S)]


def test_a_window_filled_with_incomplete_messages_is_unstuck() -> None:
    """Twin of test_h2_hostile's interleaved messages: eight halves fill the connection
    window; the newest call ends with RESOURCE_EXHAUSTED, then the others complete."""
    msgs = {sid: grpc_msg(bytes([sid]) * 60_000) for sid in range(1, 17, 2)}
    raw = Raw()
    wire = b"".join(frame(HEADERS, END_HEADERS, sid, SINK) for sid in msgs)
    for half in (0, 16384):
        wire += b"".join(frame(DATA, 0, sid, m[half : half + 16384]) for sid, m in msgs.items())
    raw.send(wire)
    frames = raw.read()
    ends = [f for f in frames if f[2] == 15]
    assert [f[:3] for f in ends] == [(HEADERS, END_HEADERS | END_STREAM, 15), (RST_STREAM, 0, 15)]
    assert dict(hpack.Decoder().decode(ends[0][3]))["grpc-status"] == "8"  # RESOURCE_EXHAUSTED
    assert ("cancel", 15) in raw.take_events() and raw.counters.stalls_broken == 1
    for sid, m in msgs.items():
        if sid != 15:
            raw.send(frame(DATA, END_STREAM, sid, m[32768:]))
            assert raw.conn.calls[sid].take() == m[5:]
            held(raw.conn)


# --- bad messages -------------------------------------------------------------------------------

BAD_MESSAGES = {
    "compressed": (b"\x01" + U32.pack(1) + b"z", StatusCode.UNIMPLEMENTED),
    "too-large": (b"\x00" + U32.pack(MAX_MESSAGE + 1), StatusCode.RESOURCE_EXHAUSTED),
    "does-not-parse": (grpc_msg(b"bad"), StatusCode.INTERNAL),
}


def _strict(data: bytes) -> bytes:
    if data == b"bad":
        raise ValueError("cannot parse")
    return data


@pytest.mark.parametrize("message, status", BAD_MESSAGES.values(), ids=BAD_MESSAGES)
def test_a_bad_message_fails_its_call_one_turn_later(message: bytes, status: StatusCode) -> None:
    raw = Raw()
    raw.conn.methods = {
        **METHODS,
        b"/t.T/Strict": Method(METHODS[b"/t.T/Sink"].handler, _strict, bytes),
    }
    opened(raw, 1, request_block("/t.T/Strict"))
    raw.send(frame(DATA, 0, 1, message))
    assert raw.take_events() == [("fail_soon", 1)] and raw.read() == []
    call = raw.conn.calls[1]
    with pytest.raises(CallAbort) as err:
        call.take()  # a read meanwhile raises it
    assert err.value.code == status
    raw.conn.fail_due(call)
    frames = raw.read()
    assert [f[0] for f in frames] == [HEADERS, RST_STREAM]
    trailers = dict(hpack.Decoder().decode(frames[0][3]))
    assert trailers["grpc-status"] == str(status.value[0])
    assert frames[1][3] == U32.pack(NO_ERROR) and raw.take_events() == [("cancel", 1)]
    assert held(raw.conn) == {"calls": 0, "buffered": 0, "queued": 0}


def test_good_messages_before_a_bad_one_are_read_first() -> None:
    raw = Raw()
    opened(raw)
    raw.send(frame(DATA, 0, 1, grpc_msg(b"good") + b"\x01" + U32.pack(1) + b"z"))
    assert raw.take_events() == []  # no deferred failure: the read meets it after the good one
    call = raw.conn.calls[1]
    raw.send(frame(DATA, END_STREAM, 1, grpc_msg(b"after")))  # dropped, its window back
    assert call.take() == b"good"
    with pytest.raises(CallAbort):
        call.take()
    assert held(raw.conn)["buffered"] == 0


# --- header blocks ------------------------------------------------------------------------------


def test_a_request_that_is_not_grpc_gets_415_and_an_unknown_method_a_fixed_message() -> None:
    raw = Raw()
    enc = hpack.Encoder()
    plain = enc.encode(
        [(":method", "POST"), (":path", "/t.T/Echo"), ("content-type", "text/plain")]
    )
    raw.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, plain))
    raw.send(frame(HEADERS, END_HEADERS | END_STREAM, 3, request_block("/" + "p" * 3000)))
    (not_grpc, unknown) = raw.read()
    assert not_grpc == (HEADERS, END_HEADERS | END_STREAM, 1, NOT_GRPC)
    fields = dict(hpack.Decoder().decode(unknown[3]))
    assert fields == {
        ":status": "200",
        "content-type": "application/grpc",
        "grpc-status": "12",
        "grpc-message": "unknown method",
    }
    assert raw.take_events() == [] and raw.conn.calls == {}


def test_the_header_cache_is_bounded_in_bytes() -> None:
    """Twin of test_h2_hostile's: 2,500 distinct cacheable blocks of 200 fields each (2 MB)
    leave at most HEADER_CACHE_BYTES cached, counted as the bound counts them."""
    raw = Raw(max_streams=5000)
    blocks = [b"\x00\x01x\x00" * 199 + b"\x00\x01y\x08" + b"%08d" % i for i in range(2500)]
    for i, block in enumerate(blocks):
        feed(raw, frame(HEADERS, END_HEADERS | END_STREAM, 1 + 2 * i, block))
        assert raw.conn.header_cache_bytes <= HEADER_CACHE_BYTES
    cache = raw.conn._headers.cache
    cost = sum(len(k) + sum(len(n) + len(v) + 128 for n, v in f) for k, f in cache.items())
    assert cost == raw.conn.header_cache_bytes <= HEADER_CACHE_BYTES
    assert len(raw.read()) == 2500 and raw.take_events() == []  # each answered: not gRPC


def test_window_churn_then_every_blocked_answer_arrives_intact() -> None:
    """Twin of test_h2_hostile's window churn: 3,000 answers blocked on a closed window,
    1,280 changes of the initial window, then it opens: every answer, after its data."""
    raw = Raw(handshake=False, max_streams=4096)
    raw.send(PREFACE + frame(SETTINGS, 0, 0, SETTING.pack(4, 0)))
    sids = range(1, 6000, 2)
    feed(raw, b"".join(frame(HEADERS, END_HEADERS, sid, ECHO) for sid in sids))
    for sid in sids:
        raw.conn.send_message(raw.conn.calls[sid], b"r%d" % sid)
        raw.conn.complete(raw.conn.calls[sid], OK_TRAILERS)
    churn = frame(SETTINGS, 0, 0, b"".join(SETTING.pack(4, v) for v in (1, 0) * 16)) * 40
    feed(raw, churn)
    raw.read()
    feed(raw, setting(4, 65535))
    data: dict[int, bytes] = {}
    ended = set()
    for ftype, flags, sid, payload in raw.read():
        if ftype == DATA:
            data[sid] = data.get(sid, b"") + payload
        elif ftype == HEADERS and flags & END_STREAM:
            ended.add(sid)
            assert data[sid] == grpc_msg(b"r%d" % sid)
    assert ended == set(sids) and raw.conn.calls == {} and raw.conn.queued_out == 0


def test_blocks_that_leave_the_table_alone_are_decoded_once() -> None:
    raw = Raw()
    opened(raw, 1)
    cached = raw.conn.header_cache_bytes
    assert cached > len(SINK)
    opened(raw, 3)
    assert raw.conn.header_cache_bytes == cached  # the same block: from the cache


# --- time ---------------------------------------------------------------------------------------


def test_the_handshake_must_complete_in_time() -> None:
    raw = Raw(handshake=False)
    raw.send(PREFACE)
    raw.conn.handshake_expired()
    assert goaway_of(raw.read()) == (0, PROTOCOL_ERROR, b"handshake timeout")
    assert raw.take_events() == [("close", GOAWAY_LINGER_S)] and raw.counters.timeouts == 1
    done = Raw()
    done.conn.handshake_expired()
    assert done.read() == [] and not done.conn.closed


def test_an_idle_connection_is_told_twice_then_closed() -> None:
    raw = Raw(idle_timeout=10.0)
    raw.conn.tick(9.9)
    assert raw.read() == []
    raw.conn.tick(10.0)
    assert goaway_of(raw.read()) == (MAX_WINDOW, NO_ERROR, b"idle")  # streams on their way: served
    raw.conn.tick(10.0 + IDLE_DRAIN_S - 0.1)
    assert raw.read() == [] and raw.take_events() == []
    raw.conn.tick(10.0 + IDLE_DRAIN_S)
    assert goaway_of(raw.read()) == (0, NO_ERROR, b"idle")
    assert raw.take_events() == [("close", 0.0)] and raw.counters.timeouts == 1


def test_a_connection_with_a_call_is_not_idle() -> None:
    raw = Raw(idle_timeout=10.0)
    opened(raw)
    for now in (5.0, 10.0, 20.0):
        raw.conn.tick(now)
    assert not any(f[0] == 7 for f in raw.read())


def test_the_use_mark_is_none_with_a_call_open_and_grows_with_streams() -> None:
    """What ``idle.IdleOrder`` reads to choose the connection a newcomer displaces."""
    raw = Raw()
    assert raw.conn.use_mark() == 0
    opened(raw, 1)
    assert raw.conn.use_mark() == 1  # no message yet: it keeps nothing (test_h2_silent_calls)
    raw.send(frame(DATA, 0, 1, grpc_msg(b"first")))
    assert raw.conn.use_mark() is None
    raw.send(frame(RST_STREAM, 0, 1, U32.pack(0)))
    assert raw.conn.use_mark() == 1
    raw.send(frame(HEADERS, END_HEADERS | END_STREAM, 3, request_block("/t.T/Nothing")))
    assert raw.conn.use_mark() == 3  # a stream refused is use too


def test_a_displaced_connection_gets_the_final_goaway_and_is_closed() -> None:
    raw = Raw()
    opened(raw, 1)
    raw.send(frame(RST_STREAM, 0, 1, U32.pack(0)))
    raw.read()
    raw.take_events()
    raw.conn.displace()
    assert goaway_of(raw.read()) == (1, NO_ERROR, b"too many connections")
    assert raw.take_events() == [("close", 0.0)] and raw.counters.displaced == 1
    raw.conn.displace()  # closed already: nothing more
    assert raw.read() == [] and raw.take_events() == [] and raw.counters.displaced == 1
    assert not raw.send(frame(HEADERS, END_HEADERS, 3, SINK)) and raw.take_events() == []


@pytest.mark.parametrize("acked", [False, True])
def test_a_silent_peer_with_calls_is_pinged_then_dropped(acked: bool) -> None:
    raw = Raw(ping_interval=30.0, ping_timeout=20.0)
    opened(raw)
    raw.conn.tick(1.0)  # heard at 1.0 (the last read)
    raw.conn.tick(30.9)
    assert raw.read() == []
    raw.conn.tick(31.0)
    assert raw.read() == [(PING, 0, 0, KEEPALIVE_PING)]
    if acked:
        raw.now = 40.0
        raw.send(frame(PING, ACK, 0, KEEPALIVE_PING))
    raw.conn.tick(51.0)
    if acked:
        assert raw.take_events() == [] and not raw.conn.closed
    else:
        assert raw.take_events() == [("cancel", 1), ("abort",)] and raw.counters.timeouts == 1


# --- work per read, stop, loss -------------------------------------------------------------------


def test_a_read_does_a_slice_of_work_and_leaves_the_rest_for_the_next_turn() -> None:
    raw = Raw()
    updates = frame(WINDOW_UPDATE, 0, 0, U32.pack(1)) * 600
    assert raw.send(updates)  # bytes left
    assert raw.conn.outbound.window == DEFAULT_WINDOW + SLICE_WORK
    assert raw.send(frame(WINDOW_UPDATE, 0, 0, U32.pack(1)))  # kept behind the backlog, in order
    assert not raw.conn.resume(raw.now)
    assert raw.conn.outbound.window == DEFAULT_WINDOW + 601


def test_stop_refuses_new_streams_and_lets_open_ones_finish() -> None:
    raw = Raw()
    opened(raw)
    raw.conn.shutdown()
    assert goaway_of(raw.read()) == (1, NO_ERROR, b"")
    raw.send(frame(HEADERS, END_HEADERS, 3, SINK))
    assert raw.read() == [(RST_STREAM, 0, 3, U32.pack(REFUSED_STREAM))]
    call = raw.conn.calls[1]
    raw.send(frame(DATA, END_STREAM, 1, grpc_msg(b"last")))
    assert (call.take(), call.take()) == (b"last", EOF)
    raw.conn.send_message(call, b"answer")
    raw.conn.complete(call, OK_TRAILERS)
    assert [f[0] for f in raw.read()] == [HEADERS, DATA, HEADERS] and raw.conn.calls == {}


def test_a_lost_connection_cancels_every_call_and_holds_nothing() -> None:
    raw = Raw(handshake=False)
    raw.send(PREFACE + frame(SETTINGS, 0, 0, SETTING.pack(4, 0)))
    for sid in (1, 3, 5):
        opened(raw, sid)
        raw.send(frame(DATA, 0, sid, grpc_msg(b"x" * 100)[:50]))
        raw.conn.send_message(raw.conn.calls[sid], b"y" * 100)
    assert raw.conn.buffered == 150 and raw.conn.queued_out == 315
    raw.conn.lost()
    assert raw.take_events() == [("cancel", 1), ("cancel", 3), ("cancel", 5)]
    assert (raw.conn.calls, raw.conn.buffered, raw.conn.queued_out) == ({}, 0, 0)
    assert raw.conn.header_cache_bytes == 0
