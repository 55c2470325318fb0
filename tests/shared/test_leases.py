"""The Lua scripts and the lease manager against a real redis-server: the limit holds across
replicas, leases renew in one call and expire with a dead replica, the more urgent band goes
first across replicas, a release nobody waits for costs no round trip, and a Redis outage
falls back to local shares and rejoins without overshoot. The tables of the pure decisions
are in tests/unit/test_lease_decisions.py."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable
from typing import Any

import pytest
import redis.asyncio as aioredis

from extproc.pool.shared import LeaseManager, Mode
from extproc.pool.shared.decide import POLL_S
from extproc.pool.shared.scripts import ACQUIRE, RENEW, RETURN, Keys, decode_demand, encode_demand
from testing.leases import KEY_PREFIX, FakePool, asked_since, leases_in_redis, replica
from testing.redis import RedisServer
from testing.wait import until_async

LEASE_S = 1.0  # where leases must run out: a dead replica's, the leader's, Redis gone
# Elsewhere: a call may take a quarter of this (2.5 s) on a loaded machine before the replica
# counts Redis as gone, so the tests whose subject is shared mode stay in it.
STEADY_LEASE_S = 10.0


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))  # type: ignore[arg-type]


def manager(
    server: RedisServer,
    name: str,
    limit: int = 4,
    *,
    adaptive: bool = False,
    lease: float = LEASE_S,
    seed: int | None = None,
) -> tuple[LeaseManager, FakePool]:
    rand = random.random if seed is None else random.Random(seed).random
    return replica(server.url, name, limit, adaptive=adaptive, lease_s=lease, rand=rand)


async def held_in_redis(server: RedisServer) -> int:
    _, leases = await leases_in_redis(server.url)
    return len(leases)


async def until(cond: Any, what: str) -> None:
    """``testing.wait.until_async``, polling the managers' state often (it is cheap)."""
    await until_async(cond, what, every=0.002)


# --- pure helpers -----------------------------------------------------------------------------


def test_demand_tables_round_trip() -> None:
    assert encode_demand({10: 2, 0: 1, 5: 0}) == "0:1,10:2"
    assert decode_demand("0:1,10:2") == {0: 1, 10: 2}
    assert decode_demand(b"") == {} and decode_demand("0:1,3:0") == {0: 1}


# --- the scripts ------------------------------------------------------------------------------


def test_acquire_takes_up_to_the_limit_and_no_more(redis_server: RedisServer) -> None:
    async def main() -> None:
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        keys = Keys.for_prefix("t")
        acquire, give = r.register_script(ACQUIRE), r.register_script(RETURN)

        seq = iter(range(1000))

        async def ask(me: str, n: int, limit: int = 4) -> list[Any]:
            ids = [f"{me}:{next(seq)}" for _ in range(n)]
            return await acquire(  # type: ignore[no-any-return]
                keys=keys.all, args=[me, 1000, limit, keys.channel, f"0:{n}", *ids]
            )

        assert (await ask("a", 3))[:3] == [3, 3, 4]
        assert (await ask("b", 3))[:3] == [1, 4, 4]  # one left
        assert (await ask("b", 2))[:2] == [0, 4]
        assert await r.hget(keys.demand, "b") == "0:2"  # what it still waits for
        back = ["a", 1000, 4, keys.channel, "-"]
        assert (await give(keys=keys.all, args=[*back, "", 0, "a:0"]))[:2] == [1, 3]
        assert (await ask("b", 2))[:2] == [1, 4]
        # Given back for c: reserved for it (b cannot take it), c's next ask gets it.
        assert (await ask("c", 1))[:2] == [0, 4]
        assert (await give(keys=keys.all, args=[*back, "c", 500, "a:1"]))[:2] == [1, 4]
        assert (await ask("b", 1))[:2] == [0, 4]
        assert (await ask("c", 1))[:2] == [1, 4]
        await r.aclose()

    run(main())


def test_renew_is_one_call_for_every_lease_and_reports_what_it_lost(
    redis_server: RedisServer,
) -> None:
    async def main() -> None:
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        keys = Keys.for_prefix("t")
        acquire, renew = r.register_script(ACQUIRE), r.register_script(RENEW)
        ids = ["a:1", "a:2", "a:3"]
        await acquire(keys=keys.all, args=["a", 1000, 3, keys.channel, "0:3", *ids])
        before = {i: await r.zscore(keys.leases, i) for i in ids}
        await asyncio.sleep(0.05)  # the subject: Redis's clock moves, so a renewal scores higher
        # a:2 vanished (Redis lost it) and b took the slot: renewing cannot re-add it.
        await r.zrem(keys.leases, "a:2")
        await acquire(keys=keys.all, args=["b", 1000, 3, keys.channel, "0:1", "b:1"])
        # (The first call of a script after Redis started loads it: not measured.)
        await renew(keys=keys.all, args=["c", 1000, 3, keys.channel, "", "0", "", 0, 0, 0])
        stats = await r.info("commandstats")
        calls = stats["cmdstat_evalsha"]["calls"]
        count, limit, leader, lost, claimed, live, _ = await renew(
            keys=keys.all,
            args=["a", 1000, 3, keys.channel, "", "0", "", 3, 0, 1, *ids, "a:4"],
        )
        stats = await r.info("commandstats")
        assert stats["cmdstat_evalsha"]["calls"] - calls == 1  # one round trip for all
        assert (count, limit, leader, lost, claimed) == (3, 3, "", ["a:2"], 0)
        assert sorted(live) == ["a", "b", "c"]
        for i in ("a:1", "a:3"):
            score = await r.zscore(keys.leases, i)
            assert score is not None and score > before[i]  # renewed
        assert await r.zscore(keys.leases, "a:4") is None  # no room to claim
        await r.aclose()

    run(main())


# --- the manager ------------------------------------------------------------------------------


def test_managers_hold_the_limit_together(redis_server: RedisServer) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        (a, pa), (b, pb) = (
            manager(redis_server, "a", 5, lease=STEADY_LEASE_S),
            manager(redis_server, "b", 5, lease=STEADY_LEASE_S),
        )
        a.start()
        b.start()
        pa.arrive(0, 4)
        pb.arrive(0, 4)
        await until(lambda: pa.running + pb.running == 5, "the pool is full")
        full = loop.time()
        # Those with waiters left ask again (every POLL_S) and get nothing more.
        waiting = [m for m, p in ((a, pa), (b, pb)) if any(p.waiting.values())]
        await until(lambda: all(asked_since(m, full) for m in waiting), "they asked again")
        assert pa.running + pb.running == 5 and a.held + b.held == 5
        assert await held_in_redis(redis_server) == 5
        for i in range(3):  # as they end, the waiters behind get the slots
            p = pa if (i % 2 == 0 and pa.running) or not pb.running else pb
            p.finish()
            await until(lambda: pa.running + pb.running == 5, f"slot {i + 1} passed on")
        await until(
            lambda: sum(pa.waiting.values()) + sum(pb.waiting.values()) == 0, "nobody waits"
        )
        assert pa.running + pb.running == 5
        while pa.running:
            pa.finish()
        while pb.running:
            pb.finish()
        a._kick()
        b._kick()  # the next renewals return the spares
        await until(lambda: a.held + b.held == 0, "spares returned")
        await a.close()
        await b.close()
        assert await held_in_redis(redis_server) == 0

    run(main())


def test_one_band_is_shared_in_proportion_to_the_waiters(redis_server: RedisServer) -> None:
    """Three replicas with long queues in one band: each gets about a third of the
    admissions, whoever subscribed or asked first. In rounds, once each has heard that the
    others wait: each replica running a request ends one with probability 0.3, then every
    lease given back is taken and in use again before the next round. So the split is the
    decisions' (rules 3 and 4 of ``decide``), not how many requests a replica ended while a
    hand-over or a demand message was still on its way (what a loaded machine changed when
    requests ended every 5 ms of real time)."""
    limit, rounds = 6, 300

    async def main() -> None:
        ms = [
            manager(redis_server, n, limit, lease=STEADY_LEASE_S, seed=i)
            for i, n in enumerate("abc")
        ]
        pools = [p for _, p in ms]
        for m, p in ms:
            m.start()
            p.arrive(0, 1000)

        def full() -> bool:
            return sum(p.running for p in pools) == limit

        await until(full, "the pool is full")
        await until(lambda: all(len(m.known().others) == 2 for m, _ in ms), "the others seen")
        rng = random.Random(3)
        for i in range(rounds):
            for p in pools:
                if p.running and rng.random() < 0.3:
                    p.finish()
            await asyncio.sleep(0)  # one loop turn: the managers look at what changed
            await until(full, f"round {i}: every lease in use again")
        counts = [len(p.admitted) for p in pools]
        assert min(counts) >= 0.2 * sum(counts), counts
        for m, _ in ms:
            await m.close()

    run(main())


def test_a_dead_replicas_leases_come_back_within_the_lease(redis_server: RedisServer) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        (a, pa), (b, pb) = manager(redis_server, "a", 3), manager(redis_server, "b", 3)
        a.start()
        b.start()
        await until(lambda: a.connected and b.connected, "both reached Redis")
        pa.arrive(0, 3)
        await until(lambda: pa.running == 3, "a holds the pool")
        asked = loop.time()
        pb.arrive(0, 3)
        await until(lambda: asked_since(b, asked), "b asked")
        assert pb.running == 0
        await a.close(give_back=False)  # dies holding everything
        now_ms, leases = await leases_in_redis(redis_server.url)
        expiries = [ms for lease, ms in leases.items() if lease.startswith("a:")]
        # Within the lease, on Redis's clock: renewed at most a lease ago, gone a lease after.
        assert all(ms <= now_ms + LEASE_S * 1000 for ms in expiries), (now_ms, leases)
        # How soon after a died: bench.bounds, dead_replica_leases_gone, dead_replica_takeover.
        await until(lambda: pb.running == 3, "b takes over")
        now_ms, _ = await leases_in_redis(redis_server.url)
        assert now_ms >= max(expiries, default=0)  # only once they expired
        await b.close()

    run(main())


def test_a_more_urgent_band_elsewhere_goes_first(redis_server: RedisServer) -> None:
    """The pool is full (h holds both slots); a batch request (band 10) starts waiting on b,
    then an interactive one (band 0) on a: the first slot freed goes to a."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ms = [manager(redis_server, n, 2, lease=STEADY_LEASE_S) for n in ("h", "a", "b")]
        (h, ph), (a, pa), (b, pb) = ms
        for m, _ in ms:
            m.start()
        ph.arrive(5, 2)
        await until(lambda: ph.running == 2, "h holds the pool")
        asked = loop.time()
        pb.arrive(10)
        await until(lambda: asked_since(b, asked), "b waits, and Redis has its demand")
        pa.arrive(0)
        await until(lambda: "b" in a.known().others and "a" in h.known().others, "demand seen")
        ph.finish()
        await until(lambda: pa.running == 1, "a admitted")
        admitted = loop.time()
        # Neither b's polls nor the messages can give it to b.
        await until(lambda: asked_since(b, admitted), "b asked again")
        assert pb.running == 0
        ph.finish()
        await until(lambda: pb.running == 1, "b admitted")
        for m, _ in ms:
            await m.close()

    run(main())


def test_a_release_nobody_waits_for_costs_no_round_trip(redis_server: RedisServer) -> None:
    """Admitting takes one round trip; a release with nobody waiting anywhere takes none;
    the lease goes back with the next renewal."""

    async def main() -> None:
        r = aioredis.Redis.from_url(redis_server.url)

        async def calls() -> int:
            stats = await r.info("commandstats")
            return sum(int(v.get("calls", 0)) for k, v in stats.items() if "eval" in k)

        a, pa = manager(redis_server, "a", 4, lease=30.0)  # renewals every 10 s
        a.start()
        await until(lambda: a.connected, "a connected")
        pa.arrive(0)  # (the first call of each script after Redis started loads it)
        await until(lambda: pa.running == 1, "admitted")
        pa.finish()
        a._kick()
        await until(lambda: a.held == 0, "the spare returned")
        base = await calls()
        pa.arrive(0)
        await until(lambda: pa.running == 1, "admitted again")
        assert await calls() - base == 1
        pa.finish()
        # The subject is a time without calls: two of the manager's polls with the spare held.
        await asyncio.sleep(2 * POLL_S)
        assert await calls() - base == 1 and a.held == 1  # kept as a spare, no call
        pa.arrive(0)  # the spare serves the next one: no call either
        assert pa.running == 1
        await asyncio.sleep(POLL_S)  # the same: a poll's time without a call
        assert await calls() - base == 1
        pa.finish()
        a._kick()
        await until(lambda: a.held == 0, "spare returned by the renewal")
        assert await calls() - base == 2
        await a.close()
        await r.aclose()

    run(main())


@pytest.mark.redis  # a server of its own, not the fixture's
def test_redis_gone_holds_the_leases_then_admits_nobody_and_rejoins_within_the_limit(
    tmp_path: Any,
) -> None:
    """Three replicas under load on a pool of 6. Redis is killed: each runs on the leases it
    holds until they expire, then admits nobody (its local limit 0) while its running
    requests end; the sum of running requests never passes the limit. Redis comes back empty:
    they rejoin, and the load runs within the limit again. Each stage is watched for a number
    of the load's admissions or for a fact, not for a time."""
    limit, admissions = 6, 40

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with RedisServer(tmp_path) as server:
            ms = [manager(server, n, limit) for n in ("a", "b", "c")]
            pools = [p for _, p in ms]
            for m, _ in ms:
                m.start()
            await until(lambda: all(m.connected for m, _ in ms), "all reached Redis")
            for p in pools:
                p.arrive(0, 50)
            peak = 0
            stop = False
            rng = random.Random(7)

            async def load() -> None:
                nonlocal peak
                while not stop:
                    for p in pools:
                        if p.running and rng.random() < 0.3:
                            p.finish()
                            p.arrive(0)
                    peak = max(peak, sum(p.running for p in pools))
                    await asyncio.sleep(0.01)  # the load's pace (no assertion rests on it)

            async def served(what: str) -> None:
                """Wait until the load has had ``admissions`` more admissions."""
                base = sum(len(p.admitted) for p in pools)
                await until(lambda: sum(len(p.admitted) for p in pools) >= base + admissions, what)

            task = asyncio.create_task(load())
            await served("the load runs")
            assert peak <= limit
            server.kill()
            await until(lambda: all(m.mode is Mode.DEGRADED for m, _ in ms), "all degraded")
            await until(
                lambda: all(m.debug()["phase"] == "expired" and p.held == 0 for m, p in ms),
                "their leases expired: nobody admitted",
            )
            admitted = [len(p.admitted) for p in pools]
            await until(lambda: all(p.running == 0 for p in pools), "the running ones ended")
            assert [len(p.admitted) for p in pools] == admitted
            assert peak <= limit, peak  # no slack with Redis gone for everyone
            server.start()
            await until(lambda: all(m.mode is Mode.SHARED for m, _ in ms), "rejoined")
            await until(
                lambda: all(m.known().grace.until <= loop.time() for m, _ in ms),
                "the rejoin grace over",
            )
            peak = 0
            await served("the load runs in plain shared mode")
            stop = True
            await task
            assert peak <= limit, peak
            assert sum(m.held for m, _ in ms) <= limit
            assert await held_in_redis(server) <= limit
            assert all(m.degraded_transitions == 1 for m, _ in ms)
            for m, _ in ms:
                await m.close()

    run(main())


def test_one_leader_publishes_the_limit_and_another_takes_over(
    redis_server: RedisServer,
) -> None:
    async def main() -> None:
        (a, _), (b, _) = (manager(redis_server, n, 4, adaptive=True) for n in ("a", "b"))
        a.start()
        b.start()
        await until(
            lambda: a.connected and b.connected and a.leader == b.leader != "", "one leader"
        )
        leader, follower = (a, b) if a.is_leader else (b, a)
        assert not follower.is_leader
        leader.publish_limit(9)
        await until(lambda: follower.limit == 9, "the follower reads the limit")
        await leader.close(give_back=False)
        r = aioredis.Redis.from_url(redis_server.url)
        ttl_ms = await r.pttl(Keys.for_prefix(KEY_PREFIX).leader)
        await r.aclose()
        # The leadership ends within the lease, on Redis's clock (-2: gone already); how soon
        # the other takes it: bench.bounds, leader_takeover.
        assert ttl_ms != -1 and ttl_ms <= LEASE_S * 1000, ttl_ms
        await until(lambda: follower.is_leader, "takeover")
        assert follower.limit == 9  # carries on from the limit in force
        await follower.close()

    run(main())
