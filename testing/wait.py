"""Waiting for an event, bounded: what tests do instead of sleeping.

A test that needs something to have happened (a request admitted, a queue two deep, the backend
holding a request, a reload applied) waits for that fact, not for a time that is usually long
enough: ``until(check, what)`` calls ``check`` until it returns something truthy and returns it;
``until_async`` is the same inside a coroutine. ``check`` is polled every ``every`` seconds;
after ``limit_s`` the wait fails by itself with an ``AssertionError`` naming ``what`` and the
last value seen, so a test never hangs and its failure says what did not happen.

``limit_s`` is a bound that stops a broken test, not a claim about speed: keep it generous (the
default 10 s is far beyond what any wait here takes on a loaded machine). How fast something
happens is measured by ``python -m bench.bounds`` (PASS/MISS against a target), not asserted.

``until_async(..., blocking=True)`` runs a ``check`` that blocks (an HTTP scrape of the
sidecar's metrics, an Envoy stat) in a thread, so the event loop keeps serving the test's own
clients meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["TIMEOUT_S", "until", "until_async"]

T = TypeVar("T")

TIMEOUT_S = 10.0


def _failure(what: str, limit_s: float, last: object) -> AssertionError:
    return AssertionError(f"{what}: not after {limit_s:g} s (last seen: {last!r})")


def until(
    check: Callable[[], T], what: str, *, limit_s: float = TIMEOUT_S, every: float = 0.02
) -> T:
    """``check()``'s first truthy result; AssertionError naming ``what`` after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise _failure(what, limit_s, last)
        time.sleep(every)


async def until_async(
    check: Callable[[], T],
    what: str,
    *,
    limit_s: float = TIMEOUT_S,
    every: float = 0.01,
    blocking: bool = False,
) -> T:
    """:func:`until` in a coroutine; ``blocking=True`` calls ``check`` in a thread."""
    deadline = time.monotonic() + limit_s
    while True:
        last = await asyncio.to_thread(check) if blocking else check()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise _failure(what, limit_s, last)
        await asyncio.sleep(every)
