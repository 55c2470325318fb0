"""The Lua scripts and the lease manager against a real redis-server: the limit holds across
replicas, leases renew in one call and expire with a dead replica, the more urgent band goes
first across replicas, a release nobody waits for costs no round trip, and a Redis outage
falls back to local shares and rejoins without overshoot. The tables of the pure decisions
are in tests/unit/test_lease_decisions.py."""

from __future__ import annotations

import asyncio
import logging
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
from testing.stack import free_port
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


async def connected(
    server: RedisServer, limit: int, *names: str
) -> list[tuple[LeaseManager, FakePool]]:
    """Managers (``STEADY_LEASE_S``) started, once each has reached Redis."""
    ms = [manager(server, n, limit, lease=STEADY_LEASE_S) for n in names]
    for m, _ in ms:
        m.start()
    await until(lambda: all(m.ledger.connected for m, _ in ms), "all reached Redis")
    return ms


async def until(cond: Any, what: str) -> None:
    """``testing.wait.until_async``, polling the managers' state often (it is cheap)."""
    await until_async(cond, what, every=0.002)


# --- pure helpers -----------------------------------------------------------------------------


def test_demand_tables_round_trip() -> None:
    assert encode_demand({10: 2, 0: 1, 5: 0}) == "0:1,10:2"
    assert decode_demand("0:1,10:2") == {0: 1, 10: 2}
    assert decode_demand(b"") == {} and decode_demand("0:1,3:0") == {0: 1}


# --- the scripts ------------------------------------------------------------------------------


async def register(r: aioredis.Redis, keys: Keys, me: str, *known: str) -> list[Any]:
    """One ``RENEW`` of ``me`` holding nothing, naming ``known`` as live: a pool's first one
    (or the re-registration after a reset) ends the new epoch's fence."""
    renew = r.register_script(RENEW)
    args = [me, 1000, 4, keys.channel, "", "0", "", 0, 0, 0, len(known), *known]
    return await renew(keys=keys.all, args=args)  # type: ignore[no-any-return]


def test_acquire_takes_up_to_the_limit_and_no_more(redis_server: RedisServer) -> None:
    async def main() -> None:
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        keys = Keys.for_prefix("t")
        acquire, give = r.register_script(ACQUIRE), r.register_script(RETURN)
        await register(r, keys, "a")

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
        await register(r, keys, "a")
        ids = ["a:1", "a:2", "a:3"]
        await acquire(keys=keys.all, args=["a", 1000, 3, keys.channel, "0:3", *ids])
        before = {i: await r.zscore(keys.leases, i) for i in ids}
        await asyncio.sleep(0.05)  # the subject: Redis's clock moves, so a renewal scores higher
        # a:2 vanished (Redis lost it) and b took the slot: renewing cannot re-add it.
        await r.zrem(keys.leases, "a:2")
        await acquire(keys=keys.all, args=["b", 1000, 3, keys.channel, "0:1", "b:1"])
        # (The first call of a script after Redis started loads it: not measured.)
        await renew(keys=keys.all, args=["c", 1000, 3, keys.channel, "", "0", "", 0, 0, 0, 0])
        stats = await r.info("commandstats")
        calls = stats["cmdstat_evalsha"]["calls"]
        count, limit, leader, lost, claimed, live, *_ = await renew(
            keys=keys.all,
            args=["a", 1000, 3, keys.channel, "", "0", "", 3, 0, 1, 0, *ids, "a:4"],
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
        assert pa.running + pb.running == 5 and a.ledger.held + b.ledger.held == 5
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
        await until(lambda: a.ledger.held + b.ledger.held == 0, "spares returned")
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
        await until(
            lambda: all(len(m.ledger.known().others) == 2 for m, _ in ms), "the others seen"
        )
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
        await until(lambda: a.ledger.connected and b.ledger.connected, "both reached Redis")
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
        await until(
            lambda: "b" in a.ledger.known().others and "a" in h.ledger.known().others, "demand seen"
        )
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
        await until(lambda: a.ledger.connected, "a connected")
        pa.arrive(0)  # (the first call of each script after Redis started loads it)
        await until(lambda: pa.running == 1, "admitted")
        pa.finish()
        a._kick()
        await until(lambda: a.ledger.held == 0, "the spare returned")
        base = await calls()
        pa.arrive(0)
        await until(lambda: pa.running == 1, "admitted again")
        assert await calls() - base == 1
        pa.finish()
        # The subject is a time without calls: two of the manager's polls with the spare held.
        await asyncio.sleep(2 * POLL_S)
        assert await calls() - base == 1 and a.ledger.held == 1  # kept as a spare, no call
        pa.arrive(0)  # the spare serves the next one: no call either
        assert pa.running == 1
        await asyncio.sleep(POLL_S)  # the same: a poll's time without a call
        assert await calls() - base == 1
        pa.finish()
        a._kick()
        await until(lambda: a.ledger.held == 0, "spare returned by the renewal")
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
            await until(lambda: all(m.ledger.connected for m, _ in ms), "all reached Redis")
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
            await until(lambda: all(m.ledger.mode is Mode.DEGRADED for m, _ in ms), "all degraded")
            await until(
                lambda: all(m.debug()["phase"] == "expired" and p.held == 0 for m, p in ms),
                "their leases expired: nobody admitted",
            )
            admitted = [len(p.admitted) for p in pools]
            await until(lambda: all(p.running == 0 for p in pools), "the running ones ended")
            assert [len(p.admitted) for p in pools] == admitted
            assert peak <= limit, peak  # no slack with Redis gone for everyone
            server.start()
            await until(lambda: all(m.ledger.mode is Mode.SHARED for m, _ in ms), "rejoined")
            await until(
                lambda: all(m.ledger.known().grace.until <= loop.time() for m, _ in ms),
                "the rejoin grace over",
            )
            peak = 0
            await served("the load runs in plain shared mode")
            stop = True
            await task
            assert peak <= limit, peak
            assert sum(m.ledger.held for m, _ in ms) <= limit
            assert await held_in_redis(server) <= limit
            assert all(m.ledger.degraded_transitions == 1 for m, _ in ms)
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
            lambda: (
                a.ledger.connected
                and b.ledger.connected
                and a.ledger.leader == b.ledger.leader != ""
            ),
            "one leader",
        )
        leader, follower = (a, b) if a.ledger.is_leader else (b, a)
        assert not follower.ledger.is_leader
        leader.publish_limit(9)
        await until(lambda: follower.ledger.limit == 9, "the follower reads the limit")
        await leader.close(give_back=False)
        r = aioredis.Redis.from_url(redis_server.url)
        ttl_ms = await r.pttl(Keys.for_prefix(KEY_PREFIX).leader)
        await r.aclose()
        # The leadership ends within the lease, on Redis's clock (-2: gone already); how soon
        # the other takes it: bench.bounds, leader_takeover.
        assert ttl_ms != -1 and ttl_ms <= LEASE_S * 1000, ttl_ms
        await until(lambda: follower.ledger.is_leader, "takeover")
        assert follower.ledger.limit == 9  # carries on from the limit in force
        await follower.close()

    run(main())


# --- the pool's epoch: a state lost or reset in Redis -----------------------------------------


def test_a_pool_found_reset_grants_nothing_until_the_replicas_re_registered(
    redis_server: RedisServer,
) -> None:
    """a holds 3 of 4, b 1; Redis loses everything (FLUSHALL). Counting the empty set, an
    ACQUIRE would grant the whole limit while a's requests still run: the new epoch's fence
    grants nothing until every replica named live has renewed (re-registered what it runs),
    then the pool goes on from what they hold."""

    async def main() -> None:
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        keys = Keys.for_prefix("t")
        acquire, renew = r.register_script(ACQUIRE), r.register_script(RENEW)

        async def ask(me: str, ids: list[str]) -> list[Any]:
            args = [me, 1000, 4, keys.channel, f"0:{len(ids)}", *ids]
            return await acquire(keys=keys.all, args=args)  # type: ignore[no-any-return]

        async def renew_all(
            me: str, ids: list[str], known: list[str], wants: str = ""
        ) -> list[Any]:
            args = [me, 1000, 4, keys.channel, wants, "0", "", len(ids), 0, 0, len(known)]
            return await renew(keys=keys.all, args=[*args, *ids, *known])  # type: ignore[no-any-return]

        first = (await register(r, keys, "a"))[7]
        assert (await ask("a", ["a:1", "a:2", "a:3"]))[:2] == [3, 3]
        assert (await ask("b", ["b:1"]))[:2] == [1, 4]
        await r.flushall()
        granted, count, _, _, epoch, fenced = await ask("b", ["b:2", "b:3", "b:4", "b:5"])
        assert (granted, count, fenced) == (0, 0, 1) and epoch != first
        assert 0 < await r.pttl(keys.fence) <= 1000  # one lease at most
        reply = await renew_all("b", ["b:1"], ["a", "b"], "0:4")  # b re-registers, a expected
        assert reply[0] == 1 and reply[7:9] == [epoch, 1]
        assert (await ask("b", ["b:6"]))[0] == 0  # a has not re-registered yet
        async with r.pubsub() as sub:
            await sub.subscribe(keys.channel)
            reply = await renew_all("a", ["a:1", "a:2", "a:3"], ["a", "b"])
            assert (reply[0], reply[3], reply[7:9]) == (4, [], [epoch, 0])  # the fence ends
            message = None
            for _ in range(50):  # (the subscription's confirmation first)
                message = message or await sub.get_message(True, timeout=0.1)
            assert message is not None and message["data"].startswith("freed a")  # b waits
        assert (await ask("b", ["b:7"]))[:2] == [0, 4]  # full with what runs
        await r.aclose()

    run(main())


def test_a_fence_lapses_after_one_lease_and_other_losses_start_an_epoch(
    redis_server: RedisServer,
) -> None:
    """A replica named live that never renews holds the fence for one lease only. The leases
    set lost alone (evicted) while leases live starts a new epoch too, and so does a lease
    with no script at all (every replica cut off; a restore from an old snapshot)."""

    async def main() -> None:
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        keys = Keys.for_prefix("t")
        acquire = r.register_script(ACQUIRE)

        async def ask(me: str, lease_ms: int = 1000) -> list[Any]:
            args = [me, lease_ms, 4, keys.channel, "0:1", f"{me}:{random.random()}"]
            return await acquire(keys=keys.all, args=args)  # type: ignore[no-any-return]

        await register(r, keys, "a")
        assert (await ask("a"))[0] == 1
        await r.delete(keys.leases)  # evicted, while a's lease lives
        reply = await ask("b")
        assert reply[0] == 0 and reply[5] == 1
        epoch = reply[4]
        await register(r, keys, "b", "a", "b")  # a never renews
        for _ in range(500):  # bounded: the fence lasts one lease (1 s)
            if (reply := await ask("b"))[0]:
                break
            await asyncio.sleep(0.01)  # (the subject: the fence's lease passing)
        sec, usec = await r.time()
        assert sec * 1000 + usec // 1000 >= epoch + 1000  # only once the lease had passed
        assert reply[4] == epoch and reply[5] == 0
        # No script for a lease (50 ms here): the count no longer covers what runs.
        await ask("b", 50)
        await asyncio.sleep(0.1)  # the subject: a lease with no call
        reply = await ask("b", 50)
        assert reply[0] == 0 and reply[4] > epoch and reply[5] == 1
        await r.aclose()

    run(main())


def test_managers_re_register_after_a_flush_and_the_limit_holds(
    redis_server: RedisServer,
) -> None:
    """a runs 3 of 4, b 1 with 3 waiting, polling. FLUSHALL: b's next ACQUIRE gets nothing
    (a's requests still run), b hears the new epoch and re-registers at once; when a renews,
    the pool holds their 4 again. The two never run more than 4 together."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        (a, pa), (b, pb) = await connected(redis_server, 4, "a", "b")
        pa.arrive(0, 3)
        await until(lambda: pa.running == 3, "a runs 3")
        pb.arrive(0, 4)
        await until(lambda: pb.running == 1, "b runs 1")
        r = aioredis.Redis.from_url(redis_server.url)
        await r.flushall()
        flushed = loop.time()
        await until(lambda: asked_since(b, flushed), "b asked")
        assert pa.running + pb.running == 4  # (counting the empty set: 7)
        await until(lambda: not b._renewing and b.ledger.known().valid_until > flushed, "b renewed")
        assert pa.running + pb.running == 4 and b.ledger.fenced
        a._kick()  # a's renewal, due within lease / 3 anyway
        await until(
            lambda: a.ledger.epoch == b.ledger.epoch and not a.ledger.fenced, "a re-registered"
        )
        assert await held_in_redis(redis_server) == 4
        assert pa.running + pb.running == 4
        pa.finish()
        await until(lambda: pb.running == 2, "the slot a frees goes to b")
        assert pa.running + pb.running == 4
        await r.aclose()
        await a.close()
        await b.close()

    run(main())


def test_a_degraded_replicas_doubtful_ids_stay_bounded() -> None:
    """Redis never answers (nothing listens on the port); 20 requests run without leases, so
    every probe (lease / 3) claims 20 new ids and fails. The ids a failed call carried are
    kept for one lease at most: some 4 probes' worth, however long the outage (it grew by 20
    a probe: 60 -> 200 ids in 2 s)."""

    async def main() -> None:
        failed: list[str] = []
        m, pool = replica(
            f"redis://127.0.0.1:{free_port()}", "a", 40, lease_s=0.3, on_error=failed.append
        )
        pool.running = 20  # admitted before: claims for them go with each probe
        m.start()
        await until(lambda: failed.count("renew") >= 20, "20 probes failed")
        assert 0 < len(m.ledger._doubtful) <= 20 * 5, len(m.ledger._doubtful)
        await m.close()

    run(main())


# --- leadership with a term -------------------------------------------------------------------


def test_a_limit_is_published_only_in_the_term_it_was_computed_in(
    redis_server: RedisServer,
) -> None:
    async def main() -> None:
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        keys = Keys.for_prefix("t")
        renew = r.register_script(RENEW)

        async def call(me: str, volunteer: str, publish: str = "") -> list[Any]:
            args = [me, 1000, "4:1:100", keys.channel, "", volunteer, publish, 0, 0, 0, 0]
            return await renew(keys=keys.all, args=args)  # type: ignore[no-any-return]

        reply = await call("a", "1")
        leader, term = reply[2], reply[9]
        assert leader == "a" and term > 0
        assert (await call("a", "1", f"50@{term}"))[1] == 50
        assert (await call("a", "1", f"60@{term - 1}"))[1] == 50  # another term: refused
        assert (await call("a", "1", "70"))[1] == 50  # no term: refused
        await call("a", "0")  # a steps down, b wins a new term
        reply = await call("b", "1")
        assert reply[2] == "b" and reply[9] > term
        assert (await call("a", "1", f"80@{term}"))[1] == 50  # not the leader
        await r.aclose()

    run(main())


def test_a_replica_that_wins_the_leadership_back_does_not_republish_its_old_limit(
    redis_server: RedisServer,
) -> None:
    """a leads and publishes 200; b takes over and publishes 40; a wins back: its new term
    starts from the limit in force, 40 (it published its old 200 again)."""

    async def main() -> None:
        r = aioredis.Redis.from_url(redis_server.url)
        leader_key = Keys.for_prefix(KEY_PREFIX).leader
        # Renewals every 10 s: only those the test asks for (``_kick``) in between.
        a, _ = manager(redis_server, "a", 4, adaptive=True, lease=30.0)
        b, _ = manager(redis_server, "b", 4, adaptive=True, lease=30.0)
        for m in (a, b):
            m.ledger.set_adaptive(True, (1, 500))
        a.start()
        await until(lambda: a.ledger.is_leader, "a leads")
        b.start()
        await until(lambda: b.ledger.connected, "b reached Redis")
        a.publish_limit(200)
        await until(lambda: not a._renewing and a.ledger.known().limit == 200, "200 published")
        b._kick()
        await until(lambda: b.ledger.limit == 200, "b heard it")
        await r.delete(leader_key)  # a's leadership lapses (it was slow, say)
        b._kick()
        await until(lambda: b.ledger.is_leader, "b leads")
        b.publish_limit(40)
        await until(lambda: not b._renewing and b.ledger.known().limit == 40, "40 published")
        a._kick()
        await until(lambda: a.ledger.limit == 40 and a.ledger.leader == "b", "a heard it")
        await r.delete(leader_key)  # b's lapses, a wins it back with its next renewal
        a._kick()
        await until(lambda: a.ledger.is_leader, "a leads again")
        assert a.ledger.limit == 40
        b._kick()
        await until(
            lambda: b.ledger.leader == "a" and b.ledger.term == a.ledger.term,
            "b heard the new term",
        )
        assert b.ledger.limit == 40
        await r.aclose()
        for m in (a, b):
            await m.close()

    run(main())


# --- two policies on one key_prefix -----------------------------------------------------------


def test_two_policies_with_other_limits_on_one_key_prefix_are_warned_of(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Two deployments (limits 4 and 8) left on the default key_prefix make one pool, the
    limit of whichever called last: each replica says so (logged once, counted every
    renewal as ``on_error("policy")``, ``other_policies`` in /debug/queues)."""

    async def main() -> None:
        counted: list[str] = []
        a, _ = replica(redis_server.url, "a", 4, lease_s=STEADY_LEASE_S, on_error=counted.append)
        b, _ = replica(redis_server.url, "b", 8, lease_s=STEADY_LEASE_S)
        c, _ = replica(redis_server.url, "c", 4, lease_s=STEADY_LEASE_S)  # a's own policy
        for m in (a, b, c):
            m.start()
        await until(lambda: all(m.ledger.connected for m in (a, b, c)), "all reached Redis")
        a._kick()  # (b may have renewed after a's first renewal)
        await until(lambda: a.ledger.other_policies == 1, "a heard of b's policy")
        assert a.debug()["other_policies"] == 1 and "policy" in counted
        for m in (a, b, c):
            await m.close()

    with caplog.at_level(logging.WARNING, logger="extproc.shared"):
        run(main())
    warned = [r.getMessage() for r in caplog.records if "other policy" in r.getMessage()]
    assert warned and "key_prefix 't'" in warned[0], warned


def test_over_admission_drains_before_a_lease_is_handed_on(redis_server: RedisServer) -> None:
    """a holds the pool (4) and runs 2 more that hold no lease (admitted while degraded, the
    pool had no room for them at the rejoin); b waits. A request that ends on a while it runs
    more than it holds frees no lease: b gets one only once a runs within its leases, so the
    two never run more than they did (it handed leases on: 6 in flight stayed 6)."""

    async def main() -> None:
        (a, pa), (b, pb) = await connected(redis_server, 4, "a", "b")
        pa.arrive(0, 4)
        await until(lambda: pa.running == 4 and a.ledger.held == 4, "a holds the pool")
        pa.running += 2  # uncovered: running > held
        pb.arrive(0, 3)
        await until(lambda: "b" in a.ledger.known().others, "a heard that b waits")
        for running in (5, 4):
            pa.finish()
            await asyncio.sleep(0)  # (a loop turn: a hand-over would be on its way)
            assert (pa.running, a.ledger.held, pb.running) == (running, 4, 0)
        pa.finish()  # within its leases now: the lease goes to b
        await until(lambda: pb.running == 1, "b admitted")
        assert pa.running + pb.running == 4
        for m in (a, b):
            await m.close()

    run(main())
