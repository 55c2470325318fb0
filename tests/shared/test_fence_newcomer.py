"""Issue 31: the fence after a state lost in Redis holds for a replica that has just started.

A replica that has never seen the pool outside a fence (a rollout's new pod, a restart, a
scale-up) knows nobody who ran before the loss: when its first ``RENEW`` is the first script
after a FLUSHALL, it must not end the fence, or the next ``ACQUIRE`` grants the whole limit
while the old replicas' requests still run (measured before the fix: 8 in flight on 4). The
fence then ends when a replica that knew the pool has re-registered with everyone it names,
or after one lease."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

from extproc.pool.shared.scripts import ACQUIRE, RENEW, Keys
from testing.leases import KEY_PREFIX, asked_since, replica, run, until
from testing.redis import RedisServer

STEADY_LEASE_S = 10.0  # no renewal of the old replicas falls due unless it is kicked
LEASE_S = 1.0  # where the fence must lapse


def test_a_newcomers_first_renewal_after_a_flush_does_not_end_the_fence(
    redis_server: RedisServer,
) -> None:
    """a and b run 2 each on a pool of 4; FLUSHALL; c, just started, renews first (the first
    script after the loss) and then asks for 4: it gets nothing while a's and b's requests
    run. Once they re-registered, the pool is full with what runs; a slot a frees goes to c."""

    async def main() -> None:
        url = redis_server.url
        (a, pa), (b, pb) = (replica(url, n, 4, lease_s=STEADY_LEASE_S) for n in "ab")
        c, pc = replica(url, "c", 4, lease_s=STEADY_LEASE_S, fresh=True)
        for m in (a, b):
            m.start()
        await until(lambda: a.ledger.connected and b.ledger.connected, "a and b reached Redis")
        a._kick()  # each renews once more: each has seen the other live
        b._kick()
        await until(
            lambda: a.ledger.roster == ["a", "b"] == b.ledger.roster, "a and b saw each other"
        )
        pa.arrive(0, 2)
        pb.arrive(0, 2)
        await until(lambda: pa.running == 2 and pb.running == 2, "a and b run 2 each")
        r = aioredis.Redis.from_url(url)
        await r.flushall()
        c.start()  # its first call: RENEW
        await until(lambda: c.ledger.connected, "c renewed")
        t = asyncio.get_running_loop().time()
        pc.arrive(0, 4)
        await until(lambda: asked_since(c, t), "c asked")
        in_flight = pa.running + pb.running + pc.running
        assert (pc.running, in_flight, c.ledger.fenced) == (0, 4, True)  # (unfixed: 4, 8, False)
        assert a.ledger.epoch != c.ledger.epoch  # (the old replicas have not called since the loss)
        a._kick()  # their renewals, due within lease / 3 anyway
        b._kick()
        await until(lambda: not (a.ledger.fenced or b.ledger.fenced), "a and b re-registered")
        t = asyncio.get_running_loop().time()
        await until(lambda: asked_since(c, t) and not c.ledger.fenced, "c asked again")
        assert (pc.running, c.ledger.count) == (0, 4)  # full with what runs
        pa.finish()
        await until(lambda: pc.running == 1, "the slot a frees goes to c")
        assert pa.running + pb.running + pc.running == 4
        await r.aclose()
        for m in (a, b, c):
            await m.close()

    run(main())


def test_a_fence_only_fresh_replicas_joined_lapses_after_one_lease(
    redis_server: RedisServer,
) -> None:
    """A replica alone and fresh on an empty Redis (a whole new pool looks the same as a
    newcomer after a loss) gets its first lease once the fence's lease has passed."""

    async def main() -> None:
        c, pc = replica(redis_server.url, "c", 4, lease_s=LEASE_S, fresh=True)
        c.start()
        await until(lambda: c.ledger.connected, "c renewed")
        assert c.ledger.fenced and c.ledger.epoch is not None
        pc.arrive(0, 2)
        await until(lambda: pc.running == 2, "the fence lapsed")
        r = aioredis.Redis.from_url(redis_server.url)
        sec, usec = await r.time()
        assert sec * 1000 + usec // 1000 >= c.ledger.epoch + LEASE_S * 1000  # not before
        await until(lambda: not c.ledger.fresh, "c renewed outside a fence")  # within lease / 3
        await r.aclose()
        await c.close()

    run(main())


def test_only_a_renewal_that_is_not_fresh_says_who_runs(redis_server: RedisServer) -> None:
    """The scripts alone: after a FLUSHALL, a fresh RENEW re-registers its caller but leaves
    the fence standing (``#``); a RENEW of a replica that knew the pool names who ran, and the
    fence ends when they have all renewed, the fresh one's renewal counting like any."""

    async def main() -> None:
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        keys = Keys.for_prefix(KEY_PREFIX)
        renew, acquire = r.register_script(RENEW), r.register_script(ACQUIRE)

        async def register(me: str, known: list[str], fresh: bool = False) -> Any:
            named = f"{len(known)}:fresh" if fresh else str(len(known))
            args = [me, 1000, 4, keys.channel, "", "0", "", 0, 0, 0, named, *known]
            return (await renew(keys=keys.all, args=args))[8]  # fenced

        async def ask(me: str) -> Any:
            args = [me, 1000, 4, keys.channel, "0:1", f"{me}:1"]
            return (await acquire(keys=keys.all, args=args))[0]  # granted

        assert await register("a", []) == 0  # a pool's first renewal, not fresh: no fence
        await r.flushall()
        assert await register("n", [], fresh=True) == 1
        assert await register("n", ["n"], fresh=True) == 1  # (its second: still fresh)
        assert await ask("n") == 0
        assert await r.hgetall(keys.fence) == {"#": "0", "n": "1"}
        assert await register("a", ["a", "b"]) == 1  # b expected
        assert await register("n", ["a", "n"], fresh=True) == 1
        assert await register("b", ["a", "b"]) == 0  # everyone named has re-registered
        assert await ask("n") == 1
        await r.aclose()

    run(main())
