"""Tier 3: one HEADERS frame with a non-UTF-8 ``:path`` stops grpc.aio's server for good.

Pinned on grpcio 1.85 (the tests' grpc.aio oracle, ``testing.grpc_aio``): grpc.aio decodes
each call's method name as UTF-8 in its server loop, and ``/\\xff`` (sent as an HPACK literal,
so nothing normalises it) raises UnicodeDecodeError there. The loop dies and the server shuts
down: every open connection is ended, every call fails UNAVAILABLE, new connections are refused,
while the process and its metrics port stay up, so a liveness check on /metrics sees nothing
wrong. Any peer that can open a TCP connection to the gRPC port can do this; that is one reason
the product serves gRPC on its own ``h2`` transport only, and grpc.aio is a test oracle.

If a grpcio release fixes this, the first test fails: then update docs/deploy.md ("Who can reach
the sidecar") and this file.

The second test sends the same frame to the product's ``h2`` transport: the offending call gets
UNIMPLEMENTED, and the connection and every other client carry on.

The sidecar runs as its own process here (``llm-extproc serve``, or for grpc.aio
``python -m testing.grpc_sidecar`` with the same flags), so grpcio's broken state cannot reach
other tests.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import hpack
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from testing.grpc_aio import serve_argv
from testing.stack import Proc, free_port, wait_http, wait_tcp
from testing.wait import until

HEADERS, RST_STREAM, SETTINGS, GOAWAY = 0x1, 0x3, 0x4, 0x7
END_HEADERS = 0x4
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SERVING = health_pb2.HealthCheckResponse.SERVING


@contextlib.contextmanager
def sidecar(tmp: Path, transport: str) -> Iterator[tuple[Proc, int, int]]:
    grpc_port, metrics_port = free_port(), free_port()
    argv = serve_argv(transport)
    argv += ["--listen", f"127.0.0.1:{grpc_port}", "--metrics", f"127.0.0.1:{metrics_port}"]
    proc = Proc("sidecar", argv, tmp)
    try:
        wait_http(f"http://127.0.0.1:{metrics_port}/metrics", proc=proc)
        wait_tcp(grpc_port, proc=proc)
        yield proc, grpc_port, metrics_port
    except BaseException:
        print(f"----- sidecar log -----\n{proc.log_text()[-4000:]}", file=sys.stderr)
        raise
    finally:
        proc.stop()


def check(channel: grpc.Channel) -> object:
    """The health service's answer on this channel: SERVING, or the call's status code."""
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError as e:
        return e.code()


def frame(ftype: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([ftype, flags])
        + struct.pack(">I", stream_id)
        + payload
    )


def send_non_utf8_path(port: int) -> list[tuple[int, int, bytes]]:
    """A client preface, SETTINGS and one HEADERS frame whose ``:path`` is ``/\\xff``, as a
    literal; then the frames the server sends within a second: (type, stream id, payload)."""
    block = hpack.Encoder().encode(
        [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/\xff"),
            (b":authority", b"llm-extproc"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ],
        huffman=False,
    )
    assert b"/\xff" in block  # the raw bytes are on the wire, not a Huffman code
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(PREFACE + frame(SETTINGS, 0, 0, b"") + frame(HEADERS, END_HEADERS, 1, block))
        s.settimeout(0.2)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except ConnectionError:
                break
            if not chunk:
                break
            received += chunk
    frames = []
    while len(received) >= 9:
        length = int.from_bytes(received[:3], "big")
        ftype, stream_id = received[3], int.from_bytes(received[5:9], "big") & 0x7FFFFFFF
        frames.append((ftype, stream_id, received[9 : 9 + length]))
        received = received[9 + length :]
    return frames


def metrics_status(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return int(r.status)


def test_grpc_aio_stops_serving_after_one_non_utf8_path(tmp_path: Path) -> None:
    with sidecar(tmp_path, "grpc") as (proc, port, metrics_port):
        honest = grpc.insecure_channel(f"127.0.0.1:{port}")  # connected before the attack
        try:
            assert check(honest) == SERVING
            send_non_utf8_path(port)
            with contextlib.suppress(AssertionError):  # the assert below says what it got
                until(lambda: check(honest) != SERVING, "the honest client refused", every=0.1)
            # grpcio's server loop died: the honest client's calls fail, for good ...
            assert check(honest) == grpc.StatusCode.UNAVAILABLE, f"grpcio {grpc.__version__}"
            time.sleep(1.0)  # the subject: a second later, still broken
            assert check(honest) == grpc.StatusCode.UNAVAILABLE
            # ... and nothing listens on the port any more ...
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
        finally:
            honest.close()
        # ... while the process and its metrics look healthy.
        assert proc.popen.poll() is None
        assert metrics_status(metrics_port) == 200
        assert "UnicodeDecodeError" in proc.log_text()


def test_h2_transport_refuses_that_call_only(tmp_path: Path) -> None:
    with sidecar(tmp_path, "h2") as (proc, port, metrics_port):
        honest = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            assert check(honest) == SERVING
            frames = send_non_utf8_path(port)
            # That one call is answered UNIMPLEMENTED (a trailers-only HEADERS frame); the
            # connection is not ended.
            decoder = hpack.Decoder()  # one per connection: header blocks share its table
            headers = [
                (stream_id, dict(decoder.decode(payload, raw=True)))
                for ftype, stream_id, payload in frames
                if ftype == HEADERS
            ]
            answers = [h for stream_id, h in headers if stream_id == 1]
            assert any(a.get(b"grpc-status") == b"12" for a in answers), frames
            assert GOAWAY not in {ftype for ftype, _, _ in frames}, frames
            # Every other client carries on, old connections and new.
            assert check(honest) == SERVING
            with grpc.insecure_channel(f"127.0.0.1:{port}") as fresh:
                assert check(fresh) == SERVING
        finally:
            honest.close()
        assert metrics_status(metrics_port) == 200
        assert proc.popen.poll() is None and "Traceback" not in proc.log_text()
