"""A virtual clock for asyncio tests: an event loop whose time jumps to the next timer when it
has nothing else to do.

``run_virtual(coro)`` runs ``coro`` on a :class:`VirtualClockLoop`. Its ``time()`` starts at 0
and moves only when the loop would otherwise sleep until a timer: then it jumps to that timer at
once. So ``await asyncio.sleep(3600)`` returns immediately with ``loop.time() == 3600``;
``call_at`` deadlines, ``asyncio.timeout`` and ``wait_for`` fire in the order and at the loop
times they would on a real clock; a test of a 1.5 s queue timeout takes microseconds and can
assert the time at which something happened exactly instead of within a margin.

**Where it applies**: code whose every wait is on this loop and whose clock is ``loop.time()``
(the product's shells use it throughout: the gate, the service, the controllers), driven by
coroutines of the same loop. Ready I/O is still served (each turn polls the selector without
blocking before it jumps), and a loop with no timer at all waits for real I/O, such as a
thread's ``call_soon_threadsafe``, up to ``IDLE_LIMIT_S`` and then fails instead of hanging.
**Where it does not**: anything that works in real time beside the loop (a thread, a process,
gRPC's C core, a socket to another process): the clock would jump past a timer while they are
still working, and the code under test would see a timeout that a real clock would not give.
Code that reads ``time.monotonic()`` itself sees real time, not this clock.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

__all__ = ["IDLE_LIMIT_S", "VirtualClockLoop", "run_virtual"]

T = TypeVar("T")

IDLE_LIMIT_S = 10.0  # real seconds a loop with no timer waits for I/O before it fails


class _JumpingSelector(selectors.BaseSelector):
    """The platform's selector, except that a wait for a timer is a jump of the clock."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        self._inner = selectors.DefaultSelector()
        self._loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.modify(fileobj, events, data)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._inner.get_map()

    def close(self) -> None:
        self._inner.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._inner.select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer: only I/O (another thread) can wake the loop
            ready = self._inner.select(IDLE_LIMIT_S)
            if not ready:
                raise RuntimeError(
                    f"virtual clock: nothing scheduled and no I/O for {IDLE_LIMIT_S:g} s "
                    "(a future nobody completes?)"
                )
            return ready
        self._loop.advance(timeout)
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on a virtual clock (see the module docstring)."""

    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock forward (the selector does, when the loop waits for a timer)."""
        self._now += seconds


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)`` on a :class:`VirtualClockLoop`."""
    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        return runner.run(coro)
