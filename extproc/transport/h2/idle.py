"""Which connection gives way when a new one arrives at ``max_connections``.

A connection that completed its handshake and says nothing costs its peer one socket; refusing
newcomers at the limit let 256 such sockets keep Envoy out for as long as ``idle_timeout``.
So at the limit the newcomer is taken, and a connection that no call keeps in place is closed
in its place (GOAWAY NO_ERROR, ``Connection.displace``); only when a call keeps every
connection in place is the newcomer refused. ``IdleOrder`` picks that connection. Its rules:

1. A connection with a call that keeps it in place is never chosen: the calls of Envoy's
   connection, however many, are never cut to make room. A call keeps its connection once
   its first message has arrived, unless its method says it does not
   (``Method.keeps_connection``: grpc.health.v1 ``Watch``). Envoy sends a ``Process``
   call's first message with its HEADERS and never watches health; a call opened with no
   message, or a watch, is how a peer that is not Envoy would hold a place (issue 31), so
   neither counts.
2. Among the others, connections that never opened a stream go first (the silent strangers;
   Envoy opens a stream as soon as it connects), then the rest: each group least recently
   used first. Use is a stream opened, read from the connection's mark (``use_mark``: the
   highest stream id it opened, None while a call keeps it in place).
3. The order is kept at two moments only: when the server's tick looks at a connection (at
   most a second apart) and when a newcomer needs a place. A connection used since it was
   placed goes to the back of its group when either notices; one kept in place leaves the
   order and comes back, at the back, at the first tick that finds it no longer kept. So
   "least recently used" is to the tick, and nothing is done per request.
4. Cost: ``update`` is O(1); ``victim`` is O(1) amortized: each entry it passes over is
   either dropped (a connection kept in place, put back by a later tick: one per
   connection per tick at most) or moved back once (a connection that opened a stream since
   it was placed: one per stream at most), and the entry it returns is dropped.

Nothing here knows what a connection is: the keys are the server's protocol objects, and the
mark is read through the function given.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["IdleOrder"]

K = TypeVar("K", bound=Hashable)


class IdleOrder(Generic[K]):
    """The connections that no call keeps in place, in the order a newcomer displaces them
    (see the module docstring). ``mark(key)``: None while a call keeps the connection in
    place, else a number that grows whenever it opens a stream (0: never)."""

    __slots__ = ("_fresh", "_mark", "_used")

    def __init__(self, mark: Callable[[K], int | None]) -> None:
        self._mark = mark
        # key -> its mark when placed; least recently placed first.
        self._fresh: OrderedDict[K, int] = OrderedDict()  # never opened a stream
        self._used: OrderedDict[K, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._fresh) + len(self._used)

    def __contains__(self, key: K) -> bool:
        return key in self._fresh or key in self._used

    def update(self, key: K) -> None:
        """A new connection, or the tick looking at one: placed at the back of its group if
        it is new or was used since it was placed, taken out while a call keeps it."""
        mark = self._mark(key)
        if mark is None:
            self.discard(key)
        elif not mark:
            if key not in self._fresh:
                self._fresh[key] = 0
        elif self._used.get(key) != mark:
            self._fresh.pop(key, None)
            self._used[key] = mark
            self._used.move_to_end(key)

    def discard(self, key: K) -> None:
        """The connection is gone (lost, or displaced)."""
        self._fresh.pop(key, None)
        self._used.pop(key, None)

    def victim(self) -> K | None:
        """The connection a newcomer displaces, taken out of the order; None when a call
        keeps every connection in place."""
        for order in (self._fresh, self._used):
            while order:
                key, placed = next(iter(order.items()))
                mark = self._mark(key)
                if mark is None:
                    del order[key]  # kept in place: back at the tick that finds it no longer kept
                elif mark != placed:
                    self.update(key)  # used since it was placed: to the back
                else:
                    del order[key]
                    return key
        return None
