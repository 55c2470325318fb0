"""Replicas of a shared pool without a gate: the lease manager's tests against a real
redis-server (``tests/shared/test_leases.py``) and ``bench.bounds``' leases group.

``replica(url, name, limit)`` is a ``LeaseManager`` (made on the running loop, not started) on
a :class:`FakePool`, the local side as the gate does it: at most ``held`` running, the most
urgent band's waiter first, the manager told before a slot is freed and after every change.
The readers say what happened, for waits (``testing.wait``) instead of sleeps: ``asked_since``
(an ``ACQUIRE`` sent since then has been answered: the replica had its chance at a lease),
``leases_in_redis`` (the leases Redis still counts and when each expires, on Redis's clock).
``run`` runs a test's coroutine under a bound; ``until`` waits for a fact about the managers
(cheap: polled often), ``until_redis`` for one read from Redis (a coroutine function).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, cast

import redis.asyncio as aioredis

from extproc.config.policy import Policy, SharedPolicy
from extproc.pool.shared import LeaseManager
from extproc.pool.shared.scripts import Keys
from testing.wait import TIMEOUT_S, until_async

__all__ = [
    "KEY_PREFIX",
    "FakePool",
    "asked_since",
    "leases_in_redis",
    "replica",
    "run",
    "until",
    "until_redis",
    "with_redis",
]

KEY_PREFIX = "t"


class FakePool:
    """The local side, as the gate does it (see the module docstring)."""

    def __init__(self) -> None:
        self.running = 0
        self.held = 0
        self.pool_limit = 0
        self.waiting: dict[int, int] = {}
        self.admitted: list[int] = []  # the band of each admission, in order
        self.manager: LeaseManager | None = None

    def shared_view(self) -> tuple[int, dict[int, int]]:
        return self.running, {b: n for b, n in self.waiting.items() if n}

    def set_leases(self, held: int, pool_limit: int) -> None:
        self.held, self.pool_limit = held, pool_limit
        self._fill()

    def _fill(self) -> None:
        while self.running < self.held and any(self.waiting.values()):
            band = min(b for b, n in self.waiting.items() if n)
            self.waiting[band] -= 1
            self.running += 1
            self.admitted.append(band)

    def arrive(self, band: int = 0, n: int = 1) -> None:
        self.waiting[band] = self.waiting.get(band, 0) + n
        self._fill()
        assert self.manager is not None
        self.manager.on_change()

    def finish(self) -> None:
        assert self.manager is not None and self.running > 0
        self.manager.on_release()
        self.running -= 1
        self._fill()
        self.manager.on_change()


def replica(
    url: str,
    name: str,
    limit: int = 4,
    *,
    adaptive: bool = False,
    lease_s: float = 1.0,
    timeout_s: float | None = None,
    rand: Callable[[], float] = random.random,
    key_prefix: str = KEY_PREFIX,
    fresh: bool = False,
    **options: Any,
) -> tuple[LeaseManager, FakePool]:
    """A manager named ``name`` on a fresh :class:`FakePool`, keys under ``key_prefix``; its
    calls' deadline is ``timeout_s``, by default the longest the policy allows (a quarter of
    the lease), so that a loaded machine is less often taken for Redis gone. ``options``:
    the manager's other arguments (``on_error``, ``bounds``...).

    Unless ``fresh``, the manager is one of a pool that has run a while: it has seen the pool
    outside a fence (with nobody else live), so its first renewal on an empty Redis ends the
    new epoch's fence at once. A ``fresh`` one is a replica that has just started, as every
    manager of a real process is: alone on an empty Redis, it waits out the fence (one lease),
    since it cannot tell a new pool from one whose state was lost (``scripts``)."""
    pool = FakePool()
    timeout_s = lease_s / 4 if timeout_s is None else timeout_s
    policy = SharedPolicy(redis=url, key_prefix=key_prefix, lease_s=lease_s, timeout_s=timeout_s)
    m = LeaseManager(
        pool, policy, limit=limit, adaptive=adaptive, replica=name, rand=rand, **options
    )
    if not fresh:
        m.ledger.roster = []
    pool.manager = m
    return m, pool


def asked_since(m: LeaseManager, t: float) -> bool:
    """Whether an ``ACQUIRE`` that ``m`` sent at loop time ``t`` or later has been answered."""
    known = m.ledger.known()
    return known.last_acquire >= t and not known.acquiring


async def leases_in_redis(url: str, prefix: str = KEY_PREFIX) -> tuple[int, dict[str, int]]:
    """(Redis's clock in ms, {lease id: when it expires, in ms}) for the leases Redis counts."""
    r = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        sec, usec = await r.time()
        now_ms = sec * 1000 + usec // 1000
        live = await r.zrangebyscore(
            Keys.for_prefix(prefix).leases, now_ms + 1, "+inf", withscores=True
        )
        pairs = cast(list[tuple[str, float]], live)  # withscores: (member, score)
        return now_ms, {lease: int(expiry) for lease, expiry in pairs}
    finally:
        await r.aclose()


def run(coro: Coroutine[Any, Any, Any], limit_s: float = 60.0) -> Any:
    """``coro`` on a fresh event loop, failing after ``limit_s``."""
    return asyncio.run(asyncio.wait_for(coro, limit_s))


async def until(cond: Callable[[], Any], what: str) -> None:
    """``testing.wait.until_async``, polling the managers' state often (it is cheap)."""
    await until_async(cond, what, every=0.002)


async def until_redis(check: Callable[[], Awaitable[Any]], what: str) -> None:
    """Until ``check()`` (a read from Redis) is truthy; AssertionError after ``TIMEOUT_S``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT_S
    while not await check():
        if loop.time() >= deadline:
            raise AssertionError(f"{what}: not after {TIMEOUT_S:g} s")
        await asyncio.sleep(0.02)


def with_redis(p: Policy, url: str) -> Policy:
    """``p`` with ``pool.shared.redis`` set to ``url``, which validation does not see (a URL
    only redis-py refuses, as if validation had missed it)."""
    assert p.pool is not None and p.pool.shared is not None
    shared = dataclasses.replace(p.pool.shared, redis=url)
    return dataclasses.replace(p, pool=dataclasses.replace(p.pool, shared=shared))
