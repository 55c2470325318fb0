"""A TCP proxy on 127.0.0.1 that a test controls: the network between a client and a server.

``TcpProxy(target_port).start()`` listens on a free port (``port``) and relays every
connection it accepts to ``127.0.0.1:target_port``, both ways, byte for byte. It runs its own
event loop in a thread of its own, so a test drives it the same way from plain code, from an
asyncio test (its loop is not the proxy's) or around subprocesses (a sidecar given the
proxy's address in its policy). Every method is safe to call from any thread, and returns
once the proxy has done it.

- ``cut()``: a partition as the client sees one, packets dropped: nothing more is relayed on
  any connection, either way (what arrives is kept, not delivered), and a new connection is
  accepted but never reaches the server. The client's calls time out; no connection is reset.
- ``restore()``: the network heals: what was kept is delivered, the connections accepted
  during the cut are opened to the server, and relaying goes on.
- ``retarget(port)``: new connections go to ``port`` from now on; open ones stay where they
  are (a Service or DNS name repointed after a failover: pooled connections keep talking to
  the old node).
- ``reset()``: every open connection is closed at once (the client sees them drop).
- ``delay_s``: each chunk is held this long before it is relayed (a slow network or server).

``connections`` counts the connections accepted so far; ``open`` those still open.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from testing.stack import free_port

__all__ = ["TcpProxy"]

_T = TypeVar("_T")
_CHUNK = 65536


class TcpProxy:
    def __init__(self, target_port: int, port: int | None = None) -> None:
        self.target_port = target_port
        self.port = port or free_port()
        self.delay_s = 0.0
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._flowing: asyncio.Event | None = None  # set while not cut
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def open(self) -> int:
        return len(self._writers) // 2

    # --- control (any thread) ------------------------------------------------------------------

    def start(self) -> TcpProxy:
        self._thread.start()
        self._run(self._start())
        return self

    def cut(self) -> None:
        self._do(lambda: self._event().clear())

    def restore(self) -> None:
        self._do(lambda: self._event().set())

    def retarget(self, port: int) -> None:
        def move() -> None:
            self.target_port = port

        self._do(move)

    def reset(self) -> None:
        def close_all() -> None:
            for w in list(self._writers):
                w.transport.abort()

        self._do(close_all)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        self._run(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the proxy's loop ----------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def _do(self, fn: Callable[[], None]) -> None:
        async def call() -> None:
            fn()

        self._run(call())

    def _event(self) -> asyncio.Event:
        assert self._flowing is not None
        return self._flowing

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", self.port)

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)

    async def _accepted(
        self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> None:
        self.connections += 1
        self._writers.add(client_w)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        try:
            await self._event().wait()  # accepted during a cut: no server yet
            try:
                server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
            except OSError:
                return
            self._writers.add(server_w)
            try:
                await asyncio.gather(
                    self._relay(client_r, server_w), self._relay(server_r, client_w)
                )
            finally:
                self._writers.discard(server_w)
                server_w.transport.abort()
        finally:
            self._writers.discard(client_w)
            client_w.transport.abort()
            self._tasks.discard(task)  # type: ignore[arg-type]

    async def _relay(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                await self._event().wait()
                data = await src.read(_CHUNK)
                if not data:
                    break
                if self.delay_s > 0:
                    await asyncio.sleep(self.delay_s)
                await self._event().wait()  # cut while reading: keep it until restored
                dst.write(data)
                await dst.drain()
        dst.transport.abort()  # one side ended: end the other (no half-open relays)
