"""The h2 transport against hostile peers: one test per way a peer could exhaust the sidecar.

Each runs the attack against a real ``H2Server`` on 127.0.0.1 (an attacker in a thread, on a
blocking socket, its writes precomputed so that it costs the server's event loop little)
while an honest client on its own connection does echo exchanges in the server's loop, and
checks three things: the honest exchanges answer within HONEST_P99_S (p99), what the server holds
stays within the bound (``H2Server.statistics()``: bytes buffered in calls, bytes queued
for the peer's window, bytes in the transports; or, where the old code must be measured too,
the same quantities read from the connection objects), and nothing is left held afterwards.
The last tests run the real servicer (``extproc.app.Sidecar``) and check that every bucket
is back to 0 in flight and 0 queued. docs/transport.md lists which test pins which bound.
"""

from __future__ import annotations

import asyncio
import logging
import selectors
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import hpack
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.app import Sidecar
from extproc.config.policy import policy_from_yaml
from extproc.contract import PROCESS_METHOD
from extproc.transport import h2
from extproc.transport.h2 import H2Server
from extproc.transport.h2.frames import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    PRIORITY,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
)
from extproc.transport.h2.limits import HEADER_CACHE_BYTES, MAX_HEADER_BLOCK
from testing.wait import TIMEOUT_S, until_async
from tests.service.h2_peer import (
    Honest,
    RawPeer,
    displaced,
    frame,
    grpc_msg,
    honest_exchanges,
    nothing_held,
    p99,
    request_block,
    serve,
    settings,
    settle,
    stranger,
    told_nothing,
)

FLOW_CONTROL_ERROR, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x3, 0x9, 0xB
PROTOCOL_ERROR, NO_ERROR = 0x1, 0x0
# A stalled honest client waits seconds; on two shared cores with a benchmark beside it, one
# exchange in a run took 193 ms (p99 over ~100 exchanges): the bound separates the two.
HONEST_P99_S = 0.5
ECHO = request_block("/t.T/Echo")
SINK = request_block("/t.T/Sink")
BIG = request_block("/t.T/Big")


async def during(server: H2Server, port: int, attack: Callable[[], Any]) -> tuple[Any, list[float]]:
    """Run ``attack`` in a thread while an honest client exchanges on its own connection;
    returns what the attack returned and the honest latencies in seconds."""
    honest = await Honest.connect(port)
    try:
        result = await honest.keep_going(asyncio.to_thread(attack))
    finally:
        honest.close()
    return result, honest.latencies


def assert_honest(latencies: list[float]) -> None:
    """The honest client was answered throughout: many exchanges, p99 under HONEST_P99_S."""
    assert len(latencies) >= 20, latencies
    assert p99(latencies) < HONEST_P99_S, sorted(latencies)[-5:]


async def peak_of(read: Callable[[], int], until: asyncio.Future[Any]) -> int:
    """The largest value ``read`` returned, sampled every few ms until ``until`` is done."""
    peak = 0
    for _ in range(100_000):
        peak = max(peak, read())
        if until.done():
            break
        await asyncio.sleep(0.002)  # the sampling interval of a measure: no event to wait for
    return peak


def buffered_in_calls(server: H2Server) -> int:
    """Request bytes the server holds in its calls: partial messages and messages not read
    (read from the call objects, so the measure means the same for any version)."""
    total = 0
    for conn in list(server.connections):
        for call in list(conn.connection.calls.values()):
            total += call.partial.have + sum(
                len(m) if isinstance(m, bytes) else len(m[0]) for m in call._messages
            )
    return total


def queued_for_window(server: H2Server) -> int:
    """Answer bytes waiting for the peer's window, read from the call objects."""
    total = 0
    for conn in list(server.connections):
        for call in list(conn.connection.calls.values()):
            for entry in list(call.pending):
                if not entry[-1]:  # DATA, not the trailers frame behind it
                    total += len(entry[0]) - (entry[1] if len(entry) == 3 else 0)
    return total


def written_not_read(server: H2Server) -> int:
    total = 0
    for conn in list(server.connections):
        t = conn.transport
        if t is not None and not t.is_closing():
            total += t.get_write_buffer_size()
    return total


# --- 1. inbound flow control -----------------------------------------------------------------


def test_incomplete_messages_are_bounded_by_the_connection_window() -> None:
    """Finding: windows of 2^31-1, topped up, and incomplete messages buffered without limit
    (302 MB accepted in 2.5 s). Now a connection holds at most its window (4 messages of
    64 KiB here) and sending past it ends the connection with FLOW_CONTROL_ERROR."""
    offered = 100 * 40_000  # 100 streams, each an incomplete 60,000-byte message

    async def t(server: H2Server, port: int) -> None:
        def attack() -> tuple[int, bytes] | None:
            peer = RawPeer(port)
            part = grpc_msg(b"a" * 60_000)[:40_000]
            peer.send(
                b"".join(
                    frame(HEADERS, END_HEADERS, sid, SINK)
                    + b"".join(
                        frame(DATA, 0, sid, part[i : i + 16384]) for i in range(0, 40_000, 16384)
                    )
                    for sid in range(1, 201, 2)
                )
            )
            return peer.goaway(3)

        job = asyncio.ensure_future(during(server, port, attack))
        peak = await peak_of(lambda: buffered_in_calls(server), job)
        goaway, honest = await job
        assert goaway is not None and goaway[0] == FLOW_CONTROL_ERROR, goaway
        window = 4 * 64 * 1024
        assert server.limits.connection_window == window
        assert peak <= window < offered
        assert_honest(honest)
        assert await settle(server, lambda s: nothing_held(s) and s.statistics().connections == 0)

    serve(t)


def test_bytes_beyond_a_stream_window_reset_that_stream() -> None:
    """A stream may send one message beyond what its method read: a method that reads
    nothing (Sink) gets a stream that stops at its window, and bytes past it reset the stream
    with FLOW_CONTROL_ERROR while the connection goes on."""

    async def t(server: H2Server, port: int) -> None:
        def attack() -> list[tuple[int, int, int, bytes]]:
            peer = RawPeer(port)
            wire = grpc_msg(b"m" * 60_000) + grpc_msg(b"n" * 20_000)  # 80,010 > 65,541
            peer.send(
                frame(HEADERS, END_HEADERS, 1, SINK)
                + b"".join(
                    frame(DATA, 0, 1, wire[i : i + 16384]) for i in range(0, len(wire), 16384)
                )
            )
            peer.read_until(lambda f: f[0] == RST_STREAM, 3)
            return peer.frames

        frames, honest = await during(server, port, attack)
        resets = [(sid, p) for ft, _fl, sid, p in frames if ft == RST_STREAM]
        assert resets == [(1, struct.pack(">L", FLOW_CONTROL_ERROR))]
        assert server.limits.stream_window == 64 * 1024 + 5
        assert_honest(honest)
        assert await settle(server, nothing_held)

    serve(t)


def test_interleaved_incomplete_messages_cannot_wedge_the_connection() -> None:
    """Eight 60,000-byte messages interleaved so that the connection window (256 KiB) fills
    with eight halves: none could ever complete. The newest call is ended with
    RESOURCE_EXHAUSTED (just enough to let the oldest complete), and every other message then
    completes and is echoed."""
    msgs = {sid: grpc_msg(bytes([sid]) * 60_000) for sid in range(1, 17, 2)}

    async def t(server: H2Server, port: int) -> None:
        def attack() -> dict[int, Any]:
            peer = RawPeer(port, settings(initial_window=1 << 30))
            peer.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", 1 << 30)))
            wire = b"".join(frame(HEADERS, END_HEADERS, sid, ECHO) for sid in msgs)
            for half in (0, 16384):  # 2 x 16 KiB per stream, round robin: exactly the window
                wire += b"".join(
                    frame(DATA, 0, sid, m[half : half + 16384]) for sid, m in msgs.items()
                )
            peer.send(wire)
            ends = lambda f: f[0] == HEADERS and bool(f[1] & END_STREAM)  # noqa: E731
            peer.read_until(lambda f: ends(f) and f[2] == 15, 3)
            for sid, m in msgs.items():  # the rest of each message, one at a time (windows)
                if sid != 15:
                    peer.send(frame(DATA, END_STREAM, sid, m[32768:]))
                    peer.read_until(lambda f, sid=sid: ends(f) and f[2] == sid, 3)
            out: dict[int, Any] = {}
            dec = hpack.Decoder()
            for ftype, flags, sid, payload in peer.frames:
                if ftype == DATA:
                    out[sid] = out.get(sid, b"") + payload
                elif ftype == HEADERS and flags & END_STREAM:
                    out[(sid, "trailers")] = dict(dec.decode(payload))
                elif ftype == HEADERS:
                    dec.decode(payload)
            return out

        got, honest = await during(server, port, attack)
        assert got[(15, "trailers")]["grpc-status"] == "8"  # RESOURCE_EXHAUSTED
        for sid, m in msgs.items():
            if sid != 15:
                assert got[sid] == m and got[(sid, "trailers")]["grpc-status"] == "0"
        assert server.counters.stalls_broken == 1
        assert_honest(honest)
        assert await settle(server, nothing_held)

    serve(t)


# --- 2. header blocks --------------------------------------------------------------------------


def _huffman_blocks(count: int) -> list[bytes]:
    """Header blocks that pass every check and cost the most to decode: a ~8 KB
    Huffman-coded value of characters with long codes, distinct per block (no cache hit)."""
    blocks = []
    for i in range(count):
        enc = hpack.Encoder()
        value = f"{i:06d}" + "~" * 4980
        blocks.append(bytes(enc.encode([(":path", "/x/y"), ("x-pad", value)], huffman=True)))
    return blocks


@pytest.mark.parametrize("kind", ["table-size-updates", "many-fields", "huffman"])
def test_header_floods_cost_little(kind: str) -> None:
    """Findings: the 256 KiB bound did not apply to a single HEADERS frame (900 KB of table
    size updates in one 1 MiB frame blocked the loop 0.58 s) and a block decoded however many
    fields it had. Now a HEADERS frame or block over 8 KiB is refused from the frame header
    (ENHANCE_YOUR_CALM), a block is scanned before decoding (more fields than fit the header
    list: COMPRESSION_ERROR), and blocks that pass are decoded a few at a time between turns
    of the loop, so the honest client is answered throughout."""
    if kind == "table-size-updates":
        payloads = [b"\x20" * (1 << 20)]  # "table size 0", repeated: one 1 MiB HEADERS frame
        want = ENHANCE_YOUR_CALM
    elif kind == "many-fields":
        payloads = [b"\x00\x00\x00" * 2700 for _ in range(20)]  # 2,700 empty literals each
        want = COMPRESSION_ERROR
    else:
        payloads = _huffman_blocks(250)
        assert all(len(p) <= MAX_HEADER_BLOCK for p in payloads)
        want = None

    async def t(server: H2Server, port: int) -> None:
        def attack() -> tuple[int, bytes] | None:
            peer = RawPeer(port)
            peer.send(
                b"".join(
                    frame(HEADERS, END_HEADERS | END_STREAM, 1 + 2 * i, p)
                    for i, p in enumerate(payloads)
                )
            )
            if want is None:  # answered, one by one
                peer.read_until(lambda f: f[0] == HEADERS and f[2] == 2 * len(payloads) - 1, 10)
                return None
            return peer.goaway(5)

        goaway, honest = await during(server, port, attack)
        if want is not None:
            assert goaway is not None and goaway[0] == want, goaway
        assert_honest(honest)
        assert await settle(server, nothing_held)

    serve(t)


def test_table_size_updates_only_at_the_start_and_at_most_two() -> None:
    """RFC 7541 4.2, checked before decoding: two updates at the start are fine; a third, or
    one after a field, is a COMPRESSION_ERROR with a fixed debug string."""
    field = b"\x82"  # :method GET, indexed
    cases = {
        b"\x3f\xe1\x1f" + b"\x20" + ECHO: None,  # 4096, then 0: allowed
        b"\x20\x20\x20" + ECHO: COMPRESSION_ERROR,
        field + b"\x20" + ECHO: COMPRESSION_ERROR,
    }

    async def t(server: H2Server, port: int) -> None:
        for block, want in cases.items():
            peer = RawPeer(port)
            peer.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, block))
            if want is None:
                assert await asyncio.to_thread(
                    peer.read_until, lambda f: f[0] == HEADERS and f[2] == 1, 3
                )
                assert h2_goaway(peer.frames) is None
            else:
                goaway = await asyncio.to_thread(peer.goaway, 3)
                assert goaway == (want, b"compression error"), goaway
            peer.close()
        assert await settle(server, lambda s: nothing_held(s) and s.statistics().connections == 0)

    serve(t)


def test_goaway_debug_data_is_a_fixed_string() -> None:
    """Finding: a GOAWAY's debug data showed a heap address (hpack's error text named a
    memoryview). An HPACK integer cut short now gets the fixed string; the detail goes to the
    log only."""

    async def t(server: H2Server, port: int) -> None:
        peer = RawPeer(port)
        peer.send(frame(HEADERS, END_HEADERS, 1, b"\xff"))  # an indexed field, integer cut short
        goaway = await asyncio.to_thread(peer.goaway, 3)
        assert goaway is not None
        assert goaway == (COMPRESSION_ERROR, b"compression error"), goaway
        assert b"0x" not in goaway[1]

    serve(t)


def _cache_cost(server: H2Server) -> int:
    """What the decoded-header caches hold, counted the way the h2 transport bounds it: key
    bytes, and per field its name and value plus 128 bytes of Python objects (a tuple, two
    bytes)."""
    total = 0
    for conn in list(server.connections):
        for key, fields in list(conn.connection._headers.cache.items()):
            total += len(key) + sum(len(k) + len(v) + 128 for k, v in fields)
    return total


def test_header_cache_is_bounded_in_bytes() -> None:
    """Finding: the per-connection cache of decoded blocks was bounded in entries, not bytes
    (3.5 MB sent: +245 MB RSS, many small fields per block). 2 MB of distinct cacheable blocks
    of 200 fields each (the old cache kept 1.7 MB of them) now leave at most 64 KiB cached."""
    # 200 fields each, literal without indexing (none touches the table: all cacheable), the
    # last one distinct per block.
    blocks = [b"\x00\x01x\x00" * 199 + b"\x00\x01y\x08" + b"%08d" % i for i in range(2500)]
    assert sum(len(b) for b in blocks) > 2_000_000
    assert not any(h2.modifies_table(b) for b in blocks[:3])

    wire = b"".join(
        frame(HEADERS, END_HEADERS | END_STREAM, 1 + 2 * i, b) for i, b in enumerate(blocks)
    )
    # The answer to the last stream: HEADERS, END_HEADERS | END_STREAM, its id.
    last = bytes((HEADERS, END_HEADERS | END_STREAM)) + struct.pack(">L", 2 * len(blocks) - 1)

    async def t(server: H2Server, port: int) -> None:
        def attack() -> bool:
            peer = RawPeer(port)
            peer.send(wire)
            return peer.wait_for_bytes(last, 15)

        job = asyncio.ensure_future(during(server, port, attack))
        peak = await peak_of(lambda: _cache_cost(server), job)
        answered, honest = await job
        assert answered
        assert peak <= 64 * 1024, peak
        assert HEADER_CACHE_BYTES == 64 * 1024
        assert server.statistics().header_cache_bytes <= HEADER_CACHE_BYTES
        assert_honest(honest)

    serve(t)


# --- 3. SETTINGS and WINDOW_UPDATE ------------------------------------------------------------


def test_window_churn_costs_nothing_per_call() -> None:
    """Finding: every SETTINGS frame did O(calls) work (3,000 blocked replies + 18 KB of
    SETTINGS blocked the loop 3.65 s). Now each call's send window is kept relative to the
    peer's initial window, and blocked calls are flushed once per batch read: 3,000 blocked
    replies and 1,280 INITIAL_WINDOW_SIZE changes, then the window opens and all 3,000 replies
    arrive intact."""
    n = 3000

    streams = b"".join(
        frame(HEADERS, END_HEADERS, sid, ECHO)
        + frame(DATA, END_STREAM, sid, grpc_msg(b"r%d" % sid))
        for sid in range(1, 2 * n, 2)
    )
    churn = b"".join(
        frame(SETTINGS, 0, 0, b"".join(settings(initial_window=v) for v in (1, 0) * 16))
        for _ in range(40)
    )

    async def t(server: H2Server, port: int) -> None:
        peer = RawPeer(port, settings(initial_window=0))
        # First the 3,000 calls, answered and blocked on the closed window (opening 3,000
        # calls at once costs the loop what it costs; that is not the finding), then the
        # honest client measures the churn itself.
        await asyncio.to_thread(peer.send, streams)

        def blocked() -> int:
            stats = server.statistics()
            return int(stats.queued_out_bytes > 0 and stats.calls == n)

        assert await settle_count(blocked, 1, "every call answered, blocked on the window")
        _, honest = await during(server, port, lambda: peer.send(churn))
        assert_honest(honest)
        # Then the window opens: every reply arrives, intact, after its data.
        peer.send(frame(SETTINGS, 0, 0, settings(initial_window=65535)))
        ends = lambda f: f[0] == HEADERS and bool(f[1] & END_STREAM)  # noqa: E731
        assert await asyncio.to_thread(peer.read_count, ends, n, 10)
        good = 0
        data: dict[int, bytes] = {}
        for ftype, flags, sid, payload in peer.frames:
            if ftype == DATA:
                data[sid] = data.get(sid, b"") + payload
            elif ftype == HEADERS and flags & END_STREAM:
                good += data.get(sid) == grpc_msg(b"r%d" % sid)
        assert good == n
        assert await settle(server, nothing_held)

    serve(t, timeout=30)


@pytest.mark.parametrize(
    "increment, code",
    [(0, PROTOCOL_ERROR), (2**31 - 1, FLOW_CONTROL_ERROR)],
    ids=["zero", "overflow"],
)
def test_bad_stream_window_updates_reset_the_stream(increment: int, code: int) -> None:
    """A stream WINDOW_UPDATE of 0 is a PROTOCOL_ERROR, one past 2^31-1 a FLOW_CONTROL_ERROR:
    RST_STREAM, the call cancelled, the connection goes on."""

    async def t(server: H2Server, port: int) -> None:
        peer = RawPeer(port)
        peer.send(
            frame(HEADERS, END_HEADERS, 1, SINK)
            + frame(WINDOW_UPDATE, 0, 1, struct.pack(">L", increment))
        )
        assert await asyncio.to_thread(peer.read_until, lambda f: f[0] == RST_STREAM, 3)
        resets = [(sid, p) for ft, _fl, sid, p in peer.frames if ft == RST_STREAM]
        assert resets == [(1, struct.pack(">L", code))]
        assert await settle(server, nothing_held)
        honest = await Honest.connect(port)
        await honest.exchange()
        assert server.statistics().connections == 2  # the peer's connection still serves

    serve(t)


# --- 4. what we send -------------------------------------------------------------------------


def test_answers_echo_nothing_and_fit_the_peers_frame_size() -> None:
    """Findings: the unknown-method reply echoed the path (98 KB in, 48 MB out, in a HEADERS
    frame larger than the peer's SETTINGS_MAX_FRAME_SIZE). Now: a fixed message; a method's
    long error message is cut to ~1 KiB; a large answer is split at the peer's frame size."""
    long_path = "/" + "p" * 6_000

    async def t(server: H2Server, port: int) -> None:
        peer = RawPeer(port, settings(initial_window=1 << 20))
        peer.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", 1 << 20)))
        peer.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, request_block(long_path)))
        abort = request_block("/t.T/Abort")
        peer.send(
            frame(HEADERS, END_HEADERS, 3, abort) + frame(DATA, END_STREAM, 3, grpc_msg(b"a"))
        )
        peer.send(
            frame(HEADERS, END_HEADERS, 5, BIG) + frame(DATA, END_STREAM, 5, grpc_msg(b"b" * 1000))
        )
        ends = lambda f: f[0] == HEADERS and bool(f[1] & END_STREAM)  # noqa: E731
        assert await asyncio.to_thread(peer.read_count, ends, 3, 5)
        assert all(len(p) <= 16384 for _ft, _fl, _sid, p in peer.frames)
        dec = hpack.Decoder()
        trailers: dict[int, dict[str, str]] = {}
        for ftype, flags, sid, payload in peer.frames:
            if ftype == HEADERS:
                block = dict(dec.decode(payload))
                if flags & END_STREAM:
                    trailers[sid] = block
        assert trailers[1]["grpc-message"] == "unknown method"
        assert trailers[1]["grpc-status"] == "12"
        assert "ppp" not in str(trailers[1])
        assert trailers[3]["grpc-status"] == "13" and len(trailers[3]["grpc-message"]) <= 1024
        big = b"".join(p for ft, _fl, sid, p in peer.frames if ft == DATA and sid == 5)
        assert big == grpc_msg(b"b" * 64_000) and trailers[5]["grpc-status"] == "0"
        # A path that makes the block larger than 8 KiB: refused from the frame header.
        peer.send(frame(HEADERS, END_HEADERS | END_STREAM, 7, request_block("/" + "q" * 98_000)))
        goaway = await asyncio.to_thread(peer.goaway, 3)
        assert goaway == (ENHANCE_YOUR_CALM, b"header block too large")

    serve(t)


# --- 5. a peer that does not read ----------------------------------------------------------


def test_send_queue_for_a_closed_window_is_bounded() -> None:
    """A peer that keeps its windows shut and asks for large answers: what waits for its
    window is bounded by send_queue (4 messages), then ENHANCE_YOUR_CALM."""

    async def t(server: H2Server, port: int) -> None:
        def attack() -> tuple[int, bytes] | None:
            peer = RawPeer(port, settings(initial_window=0))
            peer.send(
                b"".join(
                    frame(HEADERS, END_HEADERS, sid, BIG)
                    + frame(DATA, END_STREAM, sid, grpc_msg(b"q" * 1000))
                    for sid in range(1, 400, 2)
                )
            )
            return peer.goaway(3)

        job = asyncio.ensure_future(during(server, port, attack))
        peak = await peak_of(lambda: queued_for_window(server), job)
        goaway, honest = await job
        assert goaway is not None and goaway[0] == ENHANCE_YOUR_CALM, goaway
        assert peak <= 4 * 64 * 1024 + 64_005  # send_queue + one answer
        assert_honest(honest)
        assert await settle(server, lambda s: nothing_held(s) and s.statistics().connections == 0)

    serve(t)


def test_a_peer_that_does_not_read_is_not_fed() -> None:
    """Finding: replies piled up for a non-reading peer (no pause_writing). Now, once the
    transport holds more than its high-water mark, the server stops reading that peer; what
    the peer left unread is bounded by send_queue (then the connection is aborted)."""

    # 2,000 answers of 64 KB asked for: 128 MB if all were produced.
    wire = b"".join(
        frame(HEADERS, END_HEADERS, sid, BIG) + frame(DATA, END_STREAM, sid, grpc_msg(b"w" * 1000))
        for sid in range(1, 4000, 2)
    )

    async def t(server: H2Server, port: int) -> None:
        def attack() -> None:
            peer = RawPeer(port, settings(initial_window=2**31 - 1))
            peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            peer.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", 2**31 - 1 - 65535)))
            peer.sock.settimeout(1.0)
            try:
                peer.sock.sendall(wire)  # the server stops reading: this blocks, then times out
            except OSError:
                pass
            peer.closed_within(1.0)
            peer.close()

        job = asyncio.ensure_future(during(server, port, attack))
        peak = await peak_of(lambda: written_not_read(server), job)
        _, honest = await job
        assert peak <= 4 * 64 * 1024 + 64 * 1024 + 1024, peak  # send_queue + one answer
        assert_honest(honest)
        assert await settle(server, lambda s: nothing_held(s) and s.statistics().connections == 0)

    serve(t)


@pytest.mark.parametrize(
    "kind", ["rapid-reset", "ping", "settings", "empty-data", "empty-continuation", "priority"]
)
def test_floods_are_rate_limited(kind: str) -> None:
    """Findings: RST_STREAM, PING, SETTINGS and frames that carry nothing were free and
    unlimited. Each now draws on a token bucket of the connection; when it runs dry the
    connection gets GOAWAY ENHANCE_YOUR_CALM. Before the reset flood, 3,000 streams reset
    after their answer (what Envoy does when clients disconnect) go through: they cost
    nothing from the budget."""
    n = 3000
    if kind == "rapid-reset":  # resets before any answer: the burst is max_streams
        first = 1 + 2 * n
        wire = b"".join(
            frame(HEADERS, END_HEADERS, s, ECHO) + frame(RST_STREAM, 0, s, struct.pack(">L", 0x8))
            for s in range(first, first + 2 * 10_000, 2)
        )
    elif kind == "ping":
        wire = frame(PING, 0, 0, b"12345678") * 5000
    elif kind == "settings":
        wire = frame(SETTINGS, 0, 0, settings(initial_window=65535)) * 5000
    elif kind == "empty-data":
        wire = frame(HEADERS, END_HEADERS, 1, SINK) + frame(DATA, 0, 1) * 5000
    elif kind == "empty-continuation":
        wire = frame(HEADERS, 0, 1, SINK) + frame(CONTINUATION, 0, 1) * 5000
    else:
        wire = frame(PRIORITY, 0, 1, b"\0\0\0\0\x10") * 5000

    def disconnect_storm(peer: RawPeer) -> bool:
        """What Envoy does when clients leave: 3,000 streams answered, then reset, 50 at a
        time. Returns whether the server let them all through."""
        for batch in range(0, n, 50):
            sids = range(1 + 2 * batch, 1 + 2 * (batch + 50), 2)
            peer.send(
                b"".join(
                    frame(HEADERS, END_HEADERS, s, ECHO) + frame(DATA, 0, s, grpc_msg(b"x"))
                    for s in sids
                )
            )
            last = sids[-1]
            if not peer.read_until(lambda f, last=last: f[0] == DATA and f[2] == last, 3):
                return False
            peer.send(b"".join(frame(RST_STREAM, 0, s, struct.pack(">L", 0x8)) for s in sids))
        return not peer.read_until(lambda f: f[0] == GOAWAY, 0.2)

    async def t(server: H2Server, port: int) -> None:
        peer = RawPeer(port)
        if kind == "rapid-reset":
            assert await asyncio.to_thread(disconnect_storm, peer)
            assert await settle(
                server, lambda s: not any(c.connection.calls for c in s.connections)
            )

        def attack() -> tuple[int, bytes] | None:
            peer.send(wire)
            return peer.goaway(3)

        goaway, honest = await during(server, port, attack)
        assert goaway is not None and goaway[0] == ENHANCE_YOUR_CALM, goaway
        assert_honest(honest)
        assert await settle(server, lambda s: nothing_held(s) and s.statistics().connections == 0)

    serve(t)


# --- 6. time and connections -----------------------------------------------------------------


@pytest.mark.parametrize("sent", [b"", PREFACE], ids=["nothing", "preface-only"])
def test_handshake_must_complete_in_time(sent: bytes) -> None:
    """Finding: no handshake timeout (2,000 idle connections held forever). A connection
    without the preface and the first SETTINGS within handshake_timeout is closed."""

    async def t(server: H2Server, port: int) -> None:
        peer = RawPeer(port, preface=False)
        peer.send(sent)
        start = time.monotonic()
        assert await asyncio.to_thread(peer.closed_within, 2.0)
        assert time.monotonic() - start < 1.0
        assert server.statistics().timeouts == 1
        assert await settle(server, lambda s: s.statistics().connections == 0)

    serve(t, handshake_timeout=0.3)


def test_idle_connection_gets_goaway_and_is_closed() -> None:
    """A connection with no open call for idle_timeout gets GOAWAY (NO_ERROR, last stream
    2^31-1: streams on their way are still served), then is closed; one with a call open is
    left alone."""

    async def t(server: H2Server, port: int) -> None:
        idle = RawPeer(port)
        busy = RawPeer(port)
        busy.send(frame(HEADERS, END_HEADERS, 1, SINK))
        assert await asyncio.to_thread(idle.closed_within, 3.0)
        goaway = h2_goaway(idle.frames)
        assert goaway is not None and goaway[:2] == (2**31 - 1, NO_ERROR)
        assert not await asyncio.to_thread(busy.closed_within, 0.3)
        assert server.statistics().connections == 1 and server.statistics().calls == 1

    serve(t, idle_timeout=0.3)


def h2_goaway(frames: list[tuple[int, int, int, bytes]]) -> tuple[int, int] | None:
    for ftype, _fl, _sid, payload in frames:
        if ftype == GOAWAY:
            last, code = struct.unpack(">LL", payload[:8])
            return last, code
    return None


def test_silent_peer_with_calls_is_pinged_then_closed() -> None:
    """Finding: a peer that vanishes without a FIN kept its calls forever. While calls are
    open and the peer is silent, the server PINGs it; without the ACK in time the connection
    is closed and its calls cancelled."""

    async def t(server: H2Server, port: int) -> None:
        peer = RawPeer(port)
        peer.send(frame(HEADERS, END_HEADERS, 1, SINK))
        assert await asyncio.to_thread(peer.read_until, lambda f: f[0] == PING and not f[1] & 1, 2)
        start = time.monotonic()
        assert await asyncio.to_thread(peer.closed_within, 2.0)
        assert time.monotonic() - start < 1.0
        assert await settle(server, lambda s: s.statistics().connections == 0)

    serve(t, ping_interval=0.2, ping_timeout=0.3)


def test_accepted_sockets_have_tcp_keepalive() -> None:
    """A peer that vanishes without a FIN is found by TCP keepalive within about a minute:
    30 s idle, then a probe every 5 s, 4 of them."""

    async def t(server: H2Server, port: int) -> None:
        peer = RawPeer(port)
        assert await settle(server, lambda s: bool(s.connections))
        sock = next(iter(server.connections)).transport.get_extra_info("socket")  # type: ignore[union-attr]
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 5
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 4
        peer.close()

    serve(t)


def test_reconnect_storm_is_accepted_within_a_second() -> None:
    """Finding: a listen backlog of 100 (1,000 connects took 6.1 s; Envoy's connect timeout is
    1 s). 1,000 connects issued while the event loop is busy all get the server's SETTINGS
    within a second."""
    n = 1000

    async def t(server: H2Server, port: int) -> None:
        socks = []
        start = time.monotonic()
        for _ in range(n):  # the loop cannot accept meanwhile: the backlog holds them
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks.append(s)

        def wait_all() -> int:
            sel = selectors.DefaultSelector()
            for s in socks:
                sel.register(s, selectors.EVENT_READ)
            got = 0
            deadline = time.monotonic() + 3
            while got < n and time.monotonic() < deadline:
                for key, _ in sel.select(0.05):
                    sel.unregister(key.fileobj)
                    got += 1
            sel.close()
            return got

        got = await asyncio.to_thread(wait_all)
        took = time.monotonic() - start
        for s in socks:
            s.close()
        assert got == n  # each got the server's SETTINGS, or (beyond max_connections) was closed
        assert took < 1.0, took

    serve(t)


def test_idle_strangers_give_way_to_an_honest_newcomer() -> None:
    """Finding: 300 connections that complete the handshake and say nothing kept 256 places
    (max_connections), and every new connection was closed at once, for as long as
    idle_timeout (10 min): Envoy was locked out. Now each newcomer at the limit displaces the
    oldest of them (GOAWAY NO_ERROR, then the close), and an honest client's call is answered.
    (How fast, with the 300 held: bench.bounds, group lockout.)"""

    async def t(server: H2Server, port: int) -> None:
        strangers = await asyncio.to_thread(lambda: [stranger(port) for _ in range(300)])
        limit = server.limits.max_connections
        assert limit == 256
        assert server.statistics().connections == limit
        await honest_exchanges(port)
        s = server.statistics()
        assert (s.displaced_connections, s.refused_connections) == (300 - limit + 1, 0)
        gone = 300 - limit + 1
        assert await asyncio.to_thread(lambda: all(displaced(p) for p in strangers[:gone]))
        assert told_nothing(strangers[gone:])
        for p in strangers:
            p.close()
        assert await settle(server, lambda s: s.statistics().connections == 0)

    serve(t)


def test_a_connection_with_open_calls_is_never_displaced() -> None:
    """Envoy's connection with calls open (each sent its first message with its HEADERS, as
    Envoy's do) is never the one closed to make room, however old; an honest connection that
    was used (its call done) gives way only after every connection that never opened a
    stream, and those go oldest first."""

    async def t(server: H2Server, port: int) -> None:
        envoy = await asyncio.to_thread(stranger, port)
        envoy.send(
            b"".join(
                frame(HEADERS, END_HEADERS, sid, SINK) + frame(DATA, 0, sid, grpc_msg(b"h"))
                for sid in range(1, 21, 2)
            )
        )
        assert await settle(server, lambda s: s.statistics().calls == 10)
        used = await Honest.connect(port)
        await used.exchange()
        strangers = await asyncio.to_thread(lambda: [stranger(port) for _ in range(9)])
        # 5 places: envoy, used and three strangers; the other six displaced, oldest first.
        s = server.statistics()
        assert (s.connections, s.calls, s.displaced_connections) == (5, 10, 6)
        assert await asyncio.to_thread(lambda: all(displaced(p) for p in strangers[:6]))
        assert told_nothing([envoy, *strangers[6:]])
        await used.exchange()
        more = await asyncio.to_thread(lambda: [stranger(port) for _ in range(4)])
        assert await asyncio.to_thread(lambda: all(displaced(p) for p in strangers[6:] + more[:1]))
        assert told_nothing([envoy, *more[1:]])
        await used.exchange()  # still served
        assert server.statistics().calls == 10
        used.close()

    serve(t, max_connections=5)


def test_a_newcomer_is_refused_only_when_every_connection_has_a_call() -> None:
    """Every connection has a call open whose first message arrived (as Envoy's calls do):
    none gives way, and newcomers are closed at once."""

    async def t(server: H2Server, port: int) -> None:
        busy = [RawPeer(port) for _ in range(5)]
        for p in busy:
            p.send(frame(HEADERS, END_HEADERS, 1, SINK) + frame(DATA, 0, 1, grpc_msg(b"h")))
        assert await settle(server, lambda s: s.statistics().calls == 5)
        late = [RawPeer(port) for _ in range(3)]
        assert [await asyncio.to_thread(p.closed_within, 0.5) for p in late] == [True] * 3
        s = server.statistics()
        assert (s.connections, s.refused_connections, s.displaced_connections) == (5, 3, 0)

    serve(t, max_connections=5)


def test_health_watch_registry_is_bounded_by_open_calls() -> None:
    """grpc.health.v1 Watch takes any service name: the registry of watchers keeps an entry
    only while a call watches it (it kept one per name ever asked for)."""
    from grpc_health.v1 import health_pb2

    from extproc.transport.health import H2Health

    health = H2Health()
    n = 500
    block = request_block("/grpc.health.v1.Health/Watch")

    async def main() -> None:
        server = H2Server(health.methods(), max_message=1 << 16)
        port = await server.listen("127.0.0.1", 0)
        try:
            peer = RawPeer(port)
            peer.send(
                b"".join(
                    frame(HEADERS, END_HEADERS, sid, block)
                    + frame(
                        DATA,
                        END_STREAM,
                        sid,
                        grpc_msg(
                            health_pb2.HealthCheckRequest(service=f"svc-{sid}").SerializeToString()
                        ),
                    )
                    for sid in range(1, 2 * n, 2)
                )
            )
            assert await settle_count(lambda: len(health._watchers), n, "the health watchers")
            peer.send(
                b"".join(
                    frame(RST_STREAM, 0, s, struct.pack(">L", 0x8)) for s in range(1, 2 * n, 2)
                )
            )
            assert await settle_count(lambda: len(health._watchers), 0, "the health watchers")
            peer.close()
        finally:
            await server.stop(0)

    asyncio.run(main())


async def settle_count(
    read: Callable[[], int], want: int, what: str, within: float = TIMEOUT_S
) -> bool:
    """Wait until ``read()`` is ``want``: True, or after ``within`` s an AssertionError naming
    ``what`` and the last value read."""
    try:
        return await until_async(lambda: read() == want, f"{what} at {want}", limit_s=within)
    except AssertionError as e:
        raise AssertionError(f"{e}; now {read()}") from None


# --- 7. the real servicer ------------------------------------------------------------------

POLICY = policy_from_yaml(
    """
limits: {max_prompt_tokens: 100, default_max_tokens: 16, max_output_tokens: 32}
buckets:
  - {name: solo, max_concurrency: 1, queue_timeout: 30s, max_queue: 5}
"""
)
CHAT = b'{"messages": [{"role": "user", "content": "hi"}]}'


def _ext_proc(headers: list[tuple[str, str]], body: bytes | None = None) -> bytes:
    msgs = [
        pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(
                headers=base_pb2.HeaderMap(
                    headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]
                ),
                end_of_stream=body is None,
            )
        )
    ]
    if body is not None:
        msgs.append(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    return b"".join(grpc_msg(m.SerializeToString()) for m in msgs)


CHAT_REQUEST = _ext_proc(
    [(":path", "/v1/chat/completions"), (":method", "POST"), ("content-type", "application/json")],
    CHAT,
)
MODELS_REQUEST = _ext_proc([(":path", "/v1/models"), (":method", "GET")])


def _in_use(sidecar: Sidecar) -> tuple[int, int]:
    assert sidecar.gate is not None
    s = sidecar.gate.statistics()["solo"]
    return s.in_flight, s.queued


def with_sidecar(test: Callable[[Sidecar, int], Any]) -> None:
    async def main() -> None:
        sidecar = Sidecar(POLICY, listen="127.0.0.1:0", metrics_listen=None)
        await sidecar.start()
        try:
            assert sidecar.grpc_port is not None
            await asyncio.wait_for(test(sidecar, sidecar.grpc_port), 20)
        finally:
            await sidecar.stop(0)

    asyncio.run(main())


def _take_slot_and_queue(peer: RawPeer) -> None:
    """Stream 1 admitted (holds the only slot), 3 and 5 queued, as Envoy would hold them."""
    block = request_block(PROCESS_METHOD)
    peer.send(
        b"".join(
            frame(HEADERS, END_HEADERS, s, block) + frame(DATA, 0, s, CHAT_REQUEST)
            for s in (1, 3, 5)
        )
    )


def test_flood_against_the_sidecar_leaves_every_bucket_empty() -> None:
    """The real servicer: a peer holds the slot and two queue places, then floods resets. Its
    connection is ended (ENHANCE_YOUR_CALM), its calls are cancelled, and the bucket is back
    to 0 in flight and 0 queued; honest pass-through exchanges answer throughout."""

    async def t(sidecar: Sidecar, port: int) -> None:
        peer = RawPeer(port)
        _take_slot_and_queue(peer)
        assert await settle_in_use(sidecar, (1, 2))
        block = request_block(PROCESS_METHOD)
        wire = b"".join(
            frame(HEADERS, END_HEADERS, s, block) + frame(RST_STREAM, 0, s, struct.pack(">L", 0x8))
            for s in range(101, 101 + 2 * 20_000, 2)
        )

        def attack() -> tuple[int, bytes] | None:
            peer.send(wire)
            return peer.goaway(5)

        honest = await Honest.connect(port, PROCESS_METHOD, MODELS_REQUEST[5:], expect=None)
        try:
            goaway = await honest.keep_going(asyncio.to_thread(attack))
        finally:
            honest.close()
        assert goaway is not None and goaway[0] == ENHANCE_YOUR_CALM, goaway
        assert await settle_in_use(sidecar, (0, 0))
        assert_honest(honest.latencies)

    with_sidecar(t)


async def settle_in_use(sidecar: Sidecar, want: tuple[int, int], within: float = TIMEOUT_S) -> bool:
    """Wait until the bucket's (in flight, queued) is ``want``: True, or after ``within`` s an
    AssertionError with what it is then."""
    what = f"the bucket's (in flight, queued) at {want}"
    try:
        return await until_async(lambda: _in_use(sidecar) == want, what, limit_s=within)
    except AssertionError as e:
        raise AssertionError(f"{e}; now {_in_use(sidecar)}") from None


def test_silent_peer_gives_its_slot_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real servicer: a peer that holds the slot and a queue place and then falls silent
    (it answers no PING, as a vanished host would not) loses them within the PING interval +
    timeout, and the next request is admitted."""

    class QuickPings(h2.H2Server):
        def __init__(self, methods: dict[str, h2.Method], **kw: Any) -> None:
            super().__init__(methods, **{**kw, "ping_interval": 0.2, "ping_timeout": 0.3})

    monkeypatch.setattr(h2, "H2Server", QuickPings)

    async def t(sidecar: Sidecar, port: int) -> None:
        peer = RawPeer(port)
        _take_slot_and_queue(peer)
        assert await settle_in_use(sidecar, (1, 2))
        start = time.monotonic()
        assert await settle_in_use(sidecar, (0, 0), within=2.0)
        assert time.monotonic() - start < 1.2
        # Envoy's next request gets the slot.
        fresh = RawPeer(port)
        fresh.send(
            frame(HEADERS, END_HEADERS, 1, request_block(PROCESS_METHOD))
            + frame(DATA, 0, 1, CHAT_REQUEST)
        )
        assert await settle_in_use(sidecar, (1, 0))
        fresh.close()
        peer.close()

    with_sidecar(t)


def test_a_connection_whose_tick_raises_is_closed_and_the_others_keep_their_timers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server's one ticker runs every connection's timers; a bug in one connection's tick
    used to end the ticker, and with it every idle, handshake and keepalive timeout. Now that
    connection is closed (logged) and the next connection still times out when idle."""

    async def t(server: H2Server, port: int) -> None:
        broken = RawPeer(port)
        assert await settle(server, lambda s: s.statistics().connections == 1)
        (bad,) = server.connections

        def raise_(now: float) -> None:
            raise RuntimeError("a bug in one connection's timers")

        bad.connection.tick = raise_  # type: ignore[method-assign]
        idle = RawPeer(port)
        assert await asyncio.to_thread(broken.closed_within, 3.0)
        assert await asyncio.to_thread(idle.closed_within, 3.0)  # its idle timeout still fires
        goaway = h2_goaway(idle.frames)
        assert goaway is not None and goaway[1] == NO_ERROR

    with caplog.at_level(logging.ERROR, logger="extproc.h2"):
        serve(t, idle_timeout=0.3)
    assert any("tick failed" in r.getMessage() for r in caplog.records)
