"""The fault suite's own tools: the in-flight history's readers (``testing.inflight``), pure,
and the TCP proxy (``testing.tcp_proxy``) on loopback sockets against a small echo server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from testing.inflight import (
    Event,
    History,
    first_at,
    max_in_flight,
    mean_in_flight,
    time_to_usage,
)
from testing.stack import free_port
from testing.tcp_proxy import TcpProxy
from testing.wait import until


def history(*spans: tuple[float, float]) -> History:
    """Requests running over ``[start, end)`` each."""
    return History.of(e for a, b in spans for e in (Event(t=a, delta=1), Event(t=b, delta=-1)))


def test_the_count_at_every_instant_and_its_maximum() -> None:
    h = history((0, 4), (1, 2), (2, 3), (3, 5))
    assert [h.at(t) for t in (-1, 0, 1, 1.5, 2, 2.5, 3, 4, 5)] == [0, 1, 2, 2, 2, 2, 2, 1, 0]
    assert max_in_flight(h) == 2  # one ends at 2 as another starts: never 3
    assert max_in_flight(h, 4.5, 10) == 1 and max_in_flight(h, 10, 20) == 0


def test_a_short_peak_between_two_samples_is_seen() -> None:
    h = history((0, 10), (0, 10), (5.0, 5.001))
    assert max_in_flight(h) == 3
    assert max_in_flight(h, 0, 5) == 2 and max_in_flight(h, 5, 5.0005) == 3


def test_mean_and_time_to_usage() -> None:
    h = history((0, 10), (2, 10), (4, 10))
    assert mean_in_flight(h, 0, 4) == pytest.approx(1.5)
    assert mean_in_flight(h, 4, 6) == 3
    assert time_to_usage(h, 0, level=3, window_s=1, within_s=5) == 4
    assert time_to_usage(h, 0, level=2, window_s=2, within_s=5) == 2
    assert time_to_usage(h, 0, level=3, window_s=1, within_s=3) is None


@pytest.fixture
def echo_port() -> Iterator[int]:
    """A server that echoes each connection's bytes."""
    port = free_port()
    srv = socket.create_server(("127.0.0.1", port))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield port
    stop.set()
    t.join(2)
    srv.close()


def ask(sock: socket.socket, data: bytes, timeout: float = 2.0) -> bytes:
    sock.settimeout(timeout)
    sock.sendall(data)
    return sock.recv(65536)


def test_the_proxy_relays_cuts_and_restores(echo_port: int) -> None:
    with TcpProxy(echo_port) as proxy:
        a = socket.create_connection(("127.0.0.1", proxy.port))
        assert ask(a, b"one") == b"one"
        proxy.cut()
        with pytest.raises(TimeoutError):
            ask(a, b"lost", timeout=0.3)  # dropped, and no close either
        b = socket.create_connection(("127.0.0.1", proxy.port))  # accepted, silent
        with pytest.raises(TimeoutError):
            ask(b, b"lost", timeout=0.3)
        proxy.restore()
        assert a.recv(10) == b""  # the cut connections are closed
        c = socket.create_connection(("127.0.0.1", proxy.port))
        assert ask(c, b"two") == b"two"
        for s in (a, b, c):
            s.close()


def test_the_proxy_delays_and_retargets(echo_port: int) -> None:
    with TcpProxy(echo_port) as proxy:
        a = socket.create_connection(("127.0.0.1", proxy.port))
        proxy.delay(0.2)
        t0 = time.monotonic()
        assert ask(a, b"slow") == b"slow"
        assert time.monotonic() - t0 >= 0.4  # each way
        proxy.delay(0)
        proxy.retarget(free_port())  # nothing listens there
        assert ask(a, b"kept") == b"kept"  # an open connection stays where it was
        b = socket.create_connection(("127.0.0.1", proxy.port))
        b.settimeout(2)
        assert b.recv(10) == b""  # a new one finds nobody: closed
        a.close()
        b.close()


def test_the_proxy_holds_only_the_next_chunk_to_the_server(echo_port: int) -> None:
    """``delay_next``: one command slow; the other connection is not held behind it, and
    the next chunk after it goes at once."""
    with TcpProxy(echo_port) as proxy:
        a = socket.create_connection(("127.0.0.1", proxy.port))
        b = socket.create_connection(("127.0.0.1", proxy.port))
        assert ask(b, b"warm") == b"warm"
        proxy.delay_next(1.0)
        t0 = time.monotonic()
        a.sendall(b"held")  # this one waits ...
        until(lambda: not proxy.delay_pending, "the proxy holds a's chunk", every=0.005)
        assert ask(b, b"free") == b"free"  # ... this one does not
        a.setblocking(False)
        with pytest.raises(BlockingIOError):
            a.recv(10)  # still held
        a.setblocking(True)
        a.settimeout(3)
        assert a.recv(10) == b"held"
        assert time.monotonic() - t0 >= 0.9
        t1 = time.monotonic()
        assert ask(a, b"next") == b"next"
        assert time.monotonic() - t1 < 0.9
        a.close()
        b.close()


def test_first_at() -> None:
    h = history((0, 4), (1, 2), (3, 5))
    assert first_at(h, 2) == 1 and first_at(h, 1) == 0 and first_at(h, 3) is None
