"""A TCP proxy on 127.0.0.1 that a test controls: the network between a client and a server.

``TcpProxy(target_port)`` listens on a free port and relays every connection to
``127.0.0.1:target_port``, from its own thread and event loop, so a test drives it from any
thread (each control call returns once it is in force):

- ``cut()``: a partition. Nothing is relayed any more, either way, on the connections open or
  on new ones (accepted, then silent): bytes sent are dropped, as packets are, and no side sees
  a close, so a client learns of the partition only from its own timeouts;
- ``restore()``: the partition heals. The connections that lost bytes are closed (TCP would have
  reset them after its retransmissions); new ones are relayed again;
- ``delay(seconds)``: every chunk waits ``seconds`` before it is handed on, one after another
  in each direction (a slow network or a slow server as a client sees it: a request and its
  reply take ``2 x seconds`` longer); ``delay(0)`` ends it;
- ``delay_next(seconds)``: only the next chunk towards the server, on whichever connection it
  comes, waits ``seconds`` (one slow call; the other connections are not held behind it);
- ``retarget(port)``: new connections go to another server, the open ones stay where they are
  (a Kubernetes Service moved to a promoted replica).

A connection whose either side closes is closed on the other. ``stop()`` closes everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any

from testing.stack import free_port

__all__ = ["TcpProxy"]

_CHUNK = 65536


class _Link:
    """One client connection and its upstream, relayed both ways by two tasks."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.cut = False
        self.tasks: list[asyncio.Task[None]] = []

    def close(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                writer.close()
        for task in self.tasks:
            task.cancel()


class TcpProxy:
    def __init__(self, target_port: int, *, port: int | None = None) -> None:
        self.target_port = target_port
        self.port = port or free_port()
        self._cut = False
        self._delay_s = 0.0
        self._delay_next_s = 0.0
        self._links: set[_Link] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    # --- control, from any thread --------------------------------------------------------------

    def start(self) -> TcpProxy:
        self._thread.start()
        self._call(self._listen())
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._close_all())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def cut(self) -> None:
        self._call(self._set_cut(True))

    def restore(self) -> None:
        self._call(self._set_cut(False))

    def delay(self, seconds: float) -> None:
        self._call(self._set_delay(seconds))

    def delay_next(self, seconds: float) -> None:
        self._call(self._set_delay_next(seconds))

    @property
    def delay_pending(self) -> bool:
        """Whether the chunk ``delay_next`` holds has not come yet."""
        return self._delay_next_s > 0

    def retarget(self, port: int) -> None:
        self._call(self._set_target(port))

    @property
    def connections(self) -> int:
        return len(self._links)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    # --- on the proxy's loop -------------------------------------------------------------------

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _set_delay(self, seconds: float) -> None:
        self._delay_s = seconds

    async def _set_delay_next(self, seconds: float) -> None:
        self._delay_next_s = seconds

    async def _set_target(self, port: int) -> None:
        self.target_port = port

    async def _set_cut(self, cut: bool) -> None:
        self._cut = cut
        for link in list(self._links):
            if cut:
                link.cut = True
            elif link.cut:
                self._drop(link)

    async def _close_all(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            self._drop(link)

    def _drop(self, link: _Link) -> None:
        link.close()
        self._links.discard(link)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = _Link(writer)
        self._links.add(link)
        if self._cut:
            link.cut = True
            link.tasks.append(asyncio.ensure_future(self._pump(link, reader, None)))
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            self._drop(link)
            return
        link.upstream = up_writer
        link.tasks += [
            asyncio.ensure_future(self._pump(link, reader, up_writer)),
            asyncio.ensure_future(self._pump(link, up_reader, writer)),
        ]

    async def _pump(
        self, link: _Link, src: asyncio.StreamReader, dst: asyncio.StreamWriter | None
    ) -> None:
        """Relay ``src`` to ``dst`` (dropping what arrives while the link is cut), each chunk
        ``delay`` after it arrived; a close either way closes the link."""
        try:
            while data := await src.read(_CHUNK):
                if link.cut or dst is None:
                    continue
                delay, once = self._delay_s, dst is link.upstream and self._delay_next_s > 0
                if once:
                    delay, self._delay_next_s = delay + self._delay_next_s, 0.0
                if delay > 0:
                    await asyncio.sleep(delay)
                    if link.cut:
                        continue
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(RuntimeError):
                self._drop(link)
