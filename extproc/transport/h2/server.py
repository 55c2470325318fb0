"""The asyncio shell around the sans-IO connection: sockets, timers and the methods' tasks.

``H2Server`` listens (TCP or Unix, TLS optional), holds at most ``max_connections`` (at the
limit a newcomer displaces the connection ``idle.IdleOrder`` picks: one that no call keeps in
place, least recently used; a call keeps its connection once its first message arrived, unless
its method is a watch; the newcomer is refused only when every connection is kept), ticks every
connection at most a second apart, and stops in two steps (GOAWAY, then after a grace
every call cancelled). ``ServerProtocol`` is one accepted connection: an ``asyncio.Protocol``
that only does I/O. It feeds what it reads to its ``connection.Connection`` with the loop's
time, writes what the connection wants sent (one ``write`` per batch of frames read, one per
answer), keeps the connection's timers (handshake, the GOAWAY linger, the close grace, the
turn a backlog or a failing call waits), and runs each call's method as a task; it is the
connection's ``Host``.

Backpressure: while the transport's buffer is above ``WRITE_HIGH`` we stop reading the peer
(``pause_writing``), so a peer that does not read cannot make us produce more (acks,
refusals, answers); what it leaves in the transport is bounded by ``send_queue`` (the
connection is aborted above it). Reading also pauses for a backlog (``SLICE_WORK``), until
the next turn of the loop. Accepted TCP sockets get keepalive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Unpack

from extproc.transport.h2.call import Call, CallAbort, Method, StatusCode
from extproc.transport.h2.connection import Connection
from extproc.transport.h2.headers import OK_TRAILERS, status_block
from extproc.transport.h2.idle import IdleOrder
from extproc.transport.h2.limits import (
    BACKLOG,
    CLOSE_GRACE_S,
    TCP_KEEPCNT,
    TCP_KEEPIDLE_S,
    TCP_KEEPINTVL_S,
    TCP_USER_TIMEOUT_MS,
    WRITE_HIGH,
    WRITE_LOW,
    Counters,
    H2Limits,
    LimitOptions,
)

__all__ = ["H2Server", "H2Stats", "ServerProtocol"]

log = logging.getLogger("extproc.h2")

_PAUSED_FOR_WRITE, _PAUSED_FOR_SLICE = 1, 2


@dataclass(frozen=True, slots=True, kw_only=True)
class H2Stats:
    """A snapshot of what the server holds and what it refused, for tests and debugging."""

    connections: int
    calls: int
    buffered_bytes: int  # request bytes held: incomplete messages and messages not yet read
    queued_out_bytes: int  # answer bytes waiting for the peer's flow-control window
    write_buffer_bytes: int  # bytes the transports hold because the peer has not read them
    header_cache_bytes: int
    refused_connections: int  # a call kept every connection in place
    displaced_connections: int  # closed (GOAWAY) to make room for a new one
    refused_streams: int
    calm: int  # connections ended with ENHANCE_YOUR_CALM
    protocol_errors: int  # connections ended with another error
    timeouts: int  # connections ended by the handshake, idle or PING timeout
    stalls_broken: int  # calls ended because the connection window filled with partial messages


class ServerProtocol(asyncio.Protocol):
    """One accepted connection: the I/O around its ``connection`` (see the module docstring)."""

    def __init__(self, server: H2Server) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.connection = Connection(
            self, server.methods, server.limits, server.counters, self.loop.time()
        )
        self._paused = 0  # why reading is paused (_PAUSED_FOR_*)
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._lost = False
        # Host.call_ended: the server's own, called directly (once per call).
        self.call_ended: Callable[[], None] = server.call_ended

    # --- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        server = self.server
        limits = server.limits
        if len(server.connections) >= limits.max_connections:
            victim = server.idle.victim()
            if victim is None:  # a call keeps every connection in place
                server.counters.refused_connections += 1
                self.connection.shut()
                transport.close()
                return
            victim.displace()
        server.connections.add(self)
        server.idle.update(self)
        _keepalive(transport)
        with contextlib.suppress(AttributeError, ValueError):
            transport.set_write_buffer_limits(high=WRITE_HIGH, low=WRITE_LOW)  # type: ignore[attr-defined]
        self.connection.initiate()
        self._handshake_timer = self.loop.call_later(
            limits.handshake_timeout, self._handshake_expired
        )

    def data_received(self, data: bytes) -> None:
        conn = self.connection
        if conn.receive_data(data, self.loop.time()) and not self._paused & _PAUSED_FOR_SLICE:
            # Enough for one turn: the rest waits, so other connections get theirs.
            self._pause(_PAUSED_FOR_SLICE)
            self.loop.call_soon(self._resume_backlog)
        if self._handshake_timer is not None and conn.handshake_done:
            self._handshake_timer.cancel()
            self._handshake_timer = None

    def _resume_backlog(self) -> None:
        more = self.connection.resume(self.loop.time())
        if more:
            self.loop.call_soon(self._resume_backlog)
        else:
            self._unpause(_PAUSED_FOR_SLICE)

    def pause_writing(self) -> None:
        # The peer reads slower than we write: stop reading it, so that it cannot make us
        # write more (acks, refusals, answers to new streams) until it catches up.
        self._pause(_PAUSED_FOR_WRITE)

    def resume_writing(self) -> None:
        self._unpause(_PAUSED_FOR_WRITE)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        self.server.connections.discard(self)
        self.server.idle.discard(self)
        self.connection.lost()
        self.server.call_ended()

    # --- the connection's Host -----------------------------------------------------------------

    def start(self, call: Call, method: Method) -> None:
        call.task = self.loop.create_task(self._run(call, method))

    def fail_soon(self, call: Call) -> None:
        self.loop.call_soon(self.connection.fail_due, call)

    def cancel(self, call: Call) -> None:
        task = call.task
        if task is not None and not task.done():
            task.cancel()

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)
            if self._paused & _PAUSED_FOR_WRITE:
                self._check_write_buffer()

    def close(self, delay: float) -> None:
        if delay:
            self.loop.call_later(delay, self._close)
        else:
            self._close()

    def abort(self) -> None:
        self.connection.shut()
        if self.transport is not None and not self._lost:
            self.transport.abort()

    # --- the rest ------------------------------------------------------------------------------

    async def _run(self, call: Call, method: Method) -> None:
        conn = self.connection
        try:
            await method.handler(call)
        except asyncio.CancelledError:
            conn.cancelled(call)
        except CallAbort as e:
            conn.complete(call, status_block(e.code, e.message))
        except Exception as e:
            if not (call.reset or call.closed or conn.closed):
                log.exception("gRPC method failed")
            conn.complete(call, status_block(StatusCode.UNKNOWN, f"{type(e).__name__}"))
        else:
            conn.complete(call, OK_TRAILERS)

    def _handshake_expired(self) -> None:
        self._handshake_timer = None
        self.connection.handshake_expired()

    def displace(self) -> None:
        """A newcomer takes our place: GOAWAY and close; a peer that has not read what we
        sent before is dropped at once, so its socket does not outlive its place."""
        self.server.connections.discard(self)
        self.connection.displace()
        transport = self.transport
        if transport is not None and not self._lost and transport.get_write_buffer_size():
            self.abort()

    def stop_calls(self) -> None:
        """The server's grace is over: cancel every call, close next turn."""
        self.connection.cancel_calls()
        self.loop.call_soon(self._close)

    def _check_write_buffer(self) -> None:
        """While the peer does not read, what it leaves in our transport is bounded too."""
        assert self.transport is not None
        if (
            self.transport.get_write_buffer_size() > self.server.limits.send_queue
            and not self.connection.closed
        ):
            self.server.counters.calm += 1
            log.warning("closing an HTTP/2 connection (write buffer full): the peer does not read")
            self.abort()

    def _pause(self, why: int) -> None:
        transport = self.transport
        if not self._paused and transport is not None and not transport.is_closing():
            transport.pause_reading()
        self._paused |= why

    def _unpause(self, why: int) -> None:
        was = self._paused
        self._paused &= ~why
        transport = self.transport
        if was and not self._paused and transport is not None and not transport.is_closing():
            transport.resume_reading()

    def _close(self) -> None:
        self.connection.shut()
        if self.transport is not None:
            self.transport.close()
            # A peer that does not read keeps a closing transport open: abort it then.
            self.loop.call_later(CLOSE_GRACE_S, self.abort)


def _use_mark(p: ServerProtocol) -> int | None:
    return p.connection.use_mark()


def _keepalive(transport: asyncio.BaseTransport) -> None:
    """TCP keepalive on an accepted TCP socket (not a Unix one): a peer that vanished without
    a FIN (a node lost, a cable pulled) is noticed, and its calls end."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (
        ("TCP_KEEPIDLE", TCP_KEEPIDLE_S),
        ("TCP_KEEPINTVL", TCP_KEEPINTVL_S),
        ("TCP_KEEPCNT", TCP_KEEPCNT),
        ("TCP_USER_TIMEOUT", TCP_USER_TIMEOUT_MS),
    ):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, option, value in options:
        with contextlib.suppress(OSError):
            sock.setsockopt(level, option, value)


class H2Server:
    """Serves ``methods`` (gRPC path -> Method) on TCP or Unix addresses.

    ``max_message``: the largest gRPC message accepted (RESOURCE_EXHAUSTED above); a stream may
    send one message beyond what its method read. ``max_streams``: open calls per connection
    (announced, REFUSED_STREAM above). ``max_connections``: a newcomer beyond it displaces
    a connection that no call keeps in place (GOAWAY; see ``idle``), or is closed at once if
    there is none.
    ``connection_window``: request bytes a connection may have buffered (default 4 messages).
    ``send_queue``: answer bytes a connection may hold for a peer that does not take them
    (window closed, or not reading; default 4 messages). ``handshake_timeout``: for the
    preface and first SETTINGS. ``idle_timeout``: a connection without calls this long is
    closed. ``ping_interval`` / ``ping_timeout``: with calls open and the peer silent this
    long we PING it, and close without the ACK in time. The defaults are in ``limits``
    (``LimitOptions``).
    """

    def __init__(
        self, methods: dict[str, Method], *, max_message: int, **options: Unpack[LimitOptions]
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.methods = {path.encode(): m for path, m in methods.items()}
        self.limits = limits = H2Limits.resolve(max_message=max_message, **options)
        self.counters = Counters()
        self.connections: set[ServerProtocol] = set()
        # Those no call keeps in place, in the order a newcomer at the limit displaces them.
        self.idle: IdleOrder[ServerProtocol] = IdleOrder(_use_mark)
        self._servers: list[asyncio.Server] = []
        self._stopped = asyncio.Event()
        self._stopping = False
        self._idle = asyncio.Event()  # set, once stopping, when no call is left
        # The tick that runs idle and keepalive checks: often enough for the shortest timeout.
        self._tick_s = min(
            1.0, limits.idle_timeout / 4, limits.ping_interval / 4, limits.ping_timeout / 4
        )
        self._ticker: asyncio.TimerHandle | None = None

    @property
    def max_message(self) -> int:
        return self.limits.max_message

    def call_ended(self) -> None:
        if self._stopping and not any(c.connection.calls for c in self.connections):
            self._idle.set()

    def statistics(self) -> H2Stats:
        conns = [p.connection for p in self.connections]
        c = self.counters
        write_buffer = 0
        for p in self.connections:
            t = p.transport
            if t is not None and not t.is_closing():
                write_buffer += t.get_write_buffer_size()
        return H2Stats(
            connections=len(conns),
            calls=sum(len(conn.calls) for conn in conns),
            buffered_bytes=sum(conn.buffered for conn in conns),
            queued_out_bytes=sum(conn.queued_out for conn in conns),
            write_buffer_bytes=write_buffer,
            header_cache_bytes=sum(conn.header_cache_bytes for conn in conns),
            refused_connections=c.refused_connections,
            displaced_connections=c.displaced,
            refused_streams=c.refused_streams,
            calm=c.calm,
            protocol_errors=c.protocol_errors,
            timeouts=c.timeouts,
            stalls_broken=c.stalls_broken,
        )

    def _tick(self) -> None:
        """Every connection's timers. A connection whose tick raises is closed (a bug there
        must not stop the handshake, idle and keepalive timers of every other connection)."""
        now = self.loop.time()
        idle = self.idle
        try:
            for p in list(self.connections):
                try:
                    p.connection.tick(now)
                    idle.update(p)
                except Exception:
                    log.exception("h2 connection tick failed; closing that connection")
                    p.abort()
        finally:
            self._ticker = self.loop.call_later(self._tick_s, self._tick)

    def _start_ticking(self) -> None:
        if self._ticker is None:
            self._ticker = self.loop.call_later(self._tick_s, self._tick)

    async def listen(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen on host:port (port 0: any); returns the port."""
        server = await self.loop.create_server(
            lambda: ServerProtocol(self),
            host,
            port,
            ssl=ssl_context,
            reuse_address=True,
            backlog=BACKLOG,
            ssl_handshake_timeout=self.limits.handshake_timeout if ssl_context else None,
        )
        self._servers.append(server)
        self._start_ticking()
        return int(server.sockets[0].getsockname()[1])

    async def listen_unix(self, path: str, ssl_context: ssl.SSLContext | None = None) -> None:
        server = await self.loop.create_unix_server(
            lambda: ServerProtocol(self),
            path,
            ssl=ssl_context,
            backlog=BACKLOG,
            ssl_handshake_timeout=self.limits.handshake_timeout if ssl_context else None,
        )
        self._servers.append(server)
        self._start_ticking()

    async def stop(self, grace: float) -> None:
        """Stop accepting, tell clients (GOAWAY), give open calls ``grace`` seconds, then
        cancel what is left and close every connection."""
        for server in self._servers:
            server.close()
        for p in list(self.connections):
            p.connection.shutdown()
        self._stopping = True
        if any(c.connection.calls for c in self.connections):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace)
        for p in list(self.connections):
            p.stop_calls()
        await asyncio.sleep(0)  # let the cancelled calls unwind
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._stopped.set()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()
