"""What Redis holds is untrusted input (anyone who can write the pool's keys or publish on its
channel): against a real redis-server, a hostile message, demand entry or published limit is
refused or clamped, counted, and neither the lease manager's listener nor its ticker stops; a
round of either that raises is followed by the next one. The decoding itself, case by case:
tests/unit/test_lease_replies.py."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Mapping
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from extproc.pool.shared import LeaseManager
from extproc.pool.shared.scripts import Keys
from testing.leases import KEY_PREFIX, asked_since, leases_in_redis, replica
from testing.redis import RedisServer
from testing.wait import until_async

LEASE_S = 10.0  # the subject is shared mode: a loaded machine must not take Redis for gone
KEYS = Keys.for_prefix(KEY_PREFIX)
HUGE = "9" * 5000  # more digits than int() reads (4,300)


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


async def subscribers(url: str, at_least: int = 1) -> None:
    """Until the events channel has ``at_least`` subscribers (``at_least=0``: none)."""

    def count() -> int:
        r = redis.Redis.from_url(url)
        try:
            return int(r.pubsub_numsub(KEYS.channel)[0][1])
        finally:
            r.close()

    what = f"{at_least} subscriber(s) on the events channel"
    if at_least:
        await until_async(lambda: count() >= at_least, what, blocking=True)
    else:
        await until_async(lambda: count() == 0, what, blocking=True)


Handled = list[tuple[str | bytes, Mapping[str, Mapping[int, int]]]]


def heard(m: LeaseManager, fail_first: bool = False) -> Handled:
    """The messages ``m``'s listener handled, each with the others' demand right after it (a
    renewal's answer replaces it with Redis's, where these tests' demand is not written);
    ``fail_first``: handling the first one raises instead."""
    handle, calls = m._on_message, []
    handled: Handled = []

    def recording(data: str | bytes) -> None:
        calls.append(data)
        if fail_first and len(calls) == 1:
            raise RuntimeError("handler broke")
        handle(data)
        handled.append((data, m.ledger.known().others))

    m._on_message = recording  # type: ignore[method-assign]
    return handled


def test_hostile_messages_are_refused_counted_and_the_listener_goes_on(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A count of 5,000 digits ended the listener (``int()`` raised in it), and with it every
    ``freed`` and ``demand`` message after."""
    errors: list[str] = []

    async def main() -> None:
        a, _ = replica(redis_server.url, "a", lease_s=LEASE_S, on_error=errors.append)
        handled = heard(a)
        a.start()
        await until_async(lambda: a.ledger.connected, "a reached Redis")
        await subscribers(redis_server.url)
        r = aioredis.Redis.from_url(redis_server.url)
        for hostile in (f"demand x 0:{HUGE}", b"demand x 0:\xff", "demand x " + "0:1," * 3000):
            await r.publish(KEYS.channel, hostile)
        await r.publish(KEYS.channel, "demand b 0:3")
        await until_async(lambda: len(handled) == 4, "b's message handled after them")
        assert handled[-1] == (b"demand b 0:3", {"b": {0: 3}})
        assert errors == ["events"] * 3
        await r.aclose()
        await a.close()

    with caplog.at_level(logging.ERROR, logger="extproc.shared"):
        run(main())
    logged = [r.getMessage() for r in caplog.records]
    assert logged[0] == (
        "shared pool: refused from Redis: a demand message from 'x' refused: a table of 5002 "
        "bytes (at most 4096)"
    )
    assert len(logged) == 3


def test_a_hostile_demand_entry_counts_as_none_and_the_replica_stays_shared(
    redis_server: RedisServer,
) -> None:
    """A demand table of 5,000 digits in Redis made every reply that carries the others'
    demand raise: the replica never connected, and no error was counted."""
    errors: list[str] = []

    async def main() -> None:
        r = aioredis.Redis.from_url(redis_server.url)
        await r.hset(KEYS.demand, mapping={"evil": f"0:{HUGE}", "odd": b"0:\xff", "b": "0:1"})
        a, pa = replica(redis_server.url, "a", lease_s=LEASE_S, on_error=errors.append)
        a.start()
        await until_async(lambda: a.ledger.connected, "a reached Redis")
        assert a.ledger.known().others == {"b": {0: 1}}
        pa.arrive(0, 2)
        await until_async(lambda: pa.running == 2, "a admits on leases")
        assert str(a.ledger.mode) == "shared" and a.ledger.degraded_transitions == 0
        assert set(errors) == {"demand"} and len(errors) >= 4  # two per reply
        await r.aclose()
        await a.close()

    run(main())


@pytest.mark.parametrize(
    "published", ["5000 digits", "1e400", "99999999999999999999", "-5", "nan", "abc"]
)
def test_a_static_pool_ignores_a_limit_published_in_redis(
    redis_server: RedisServer, published: str
) -> None:
    """A static pool's limit is its own: the scripts read a published limit (meant for an
    adaptive pool) with no bounds, so ``1e400`` granted every ask and ``-5`` none, ``abc``
    failed every call (degraded)."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        r = aioredis.Redis.from_url(redis_server.url)
        await r.set(KEYS.limit, HUGE if published == "5000 digits" else published)
        a, pa = replica(redis_server.url, "a", 4, lease_s=LEASE_S)
        a.start()
        pa.arrive(0, 10)
        await until_async(lambda: pa.running == 4, "a runs its limit")
        asked = loop.time()
        await until_async(lambda: asked_since(a, asked), "a asked again for the rest")
        assert pa.running == 4 and a.ledger.limit == 4 and str(a.ledger.mode) == "shared"
        _, leases = await leases_in_redis(redis_server.url)
        assert len(leases) == 4
        await r.aclose()
        await a.close()

    run(main())


@pytest.mark.parametrize(
    ("published", "limit"), [("1e400", 6), ("100", 6), ("0", 2), ("-5", 2), ("nan", 4)]
)
def test_an_adaptive_pool_clamps_the_published_limit_to_its_bounds(
    redis_server: RedisServer, published: str, limit: int
) -> None:
    """Between the policy's ``min`` and ``max`` (2 and 6 here); one that is not a number is
    ignored (the replica's own limit, 4, applies)."""

    async def main() -> None:
        r = aioredis.Redis.from_url(redis_server.url)
        await r.set(KEYS.limit, published)
        a, pa = replica(redis_server.url, "a", 4, adaptive=True, bounds=(2, 6), lease_s=LEASE_S)
        a.start()
        pa.arrive(0, 10)
        await until_async(
            lambda: pa.running == limit and a.ledger.limit == limit, f"a runs {limit}"
        )
        _, leases = await leases_in_redis(redis_server.url)
        assert len(leases) == limit
        await r.aclose()
        await a.close()

    run(main())


def test_the_ticker_goes_on_after_a_round_that_raised(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception in a round of the lease manager's ticker ended it: no renewal after, so
    the leases ran out while the replica thought it held them."""

    async def main() -> None:
        a, _ = replica(redis_server.url, "a", lease_s=LEASE_S)
        pump, calls = a._pump, []

        def failing(force: bool = False) -> None:
            calls.append(force)
            if len(calls) == 1:
                raise RuntimeError("step broke")
            pump(force)

        a._pump = failing  # type: ignore[method-assign]
        a.start()  # the ticker steps every TICK_S while nothing is asked (no waiters)
        await until_async(lambda: len(calls) >= 3, "the ticker's rounds after the failure")
        assert a._runner is not None and not a._runner.done()
        await a.close()

    with caplog.at_level(logging.ERROR, logger="extproc.shared"):
        run(main())
    (record,) = caplog.records
    assert record.getMessage().startswith("shared-pool: a round failed (1 in a row)")
    assert record.exc_info is not None and "step broke" in str(record.exc_info[1])


def test_the_listener_subscribes_again_after_a_message_it_could_not_handle(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception while handling a message ended the listener for good."""

    async def main() -> None:
        a, _ = replica(redis_server.url, "a", lease_s=LEASE_S)
        handled = heard(a, fail_first=True)
        a.start()
        await until_async(lambda: a.ledger.connected, "a reached Redis")
        await subscribers(redis_server.url)
        r = aioredis.Redis.from_url(redis_server.url)
        await r.publish(KEYS.channel, "demand b 0:1")
        await subscribers(redis_server.url, 0)  # the subscription that failed is closed
        await subscribers(redis_server.url)  # and a new one made
        await r.publish(KEYS.channel, "demand b 0:2")
        await until_async(lambda: len(handled) == 1, "handled on the new one")
        assert handled == [(b"demand b 0:2", {"b": {0: 2}})]
        await r.aclose()
        await a.close()

    with caplog.at_level(logging.ERROR, logger="extproc.shared"):
        run(main())
    (record,) = caplog.records
    assert record.getMessage().startswith("shared-pool-events: a round failed (1 in a row)")
