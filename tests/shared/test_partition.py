"""One replica cut off from Redis while the others still reach it (a TCP proxy the test
controls, ``testing.tcp_proxy``, between that replica and a real redis-server): it never runs
more than the leases it held at the cut, admits nobody once they have expired, and the pool
stays within the bound ``docs/scaling.md`` states (the limit plus what the cut-off replica
held, only while the requests it admitted before its expiry run); then it rejoins within the
limit. Each stage is watched for a number of the load's admissions or for a fact, not a time."""

from __future__ import annotations

import asyncio
import random

import pytest

from extproc.pool.shared import LeaseManager, Mode
from testing.leases import FakePool, leases_in_redis, replica, run, until, until_redis
from testing.redis import RedisServer
from testing.tcp_proxy import TcpProxy

LIMIT = 6
LEASE_S = 1.0
ADMISSIONS = 40


class Load:
    """Every replica's pool kept busy: each running request ends with probability 0.3 per
    round and a new one arrives for it; ``hold`` names replicas whose requests do not end
    (long streams). ``peak``: the most running in all at once since the last ``reset``."""

    def __init__(self, pools: dict[str, FakePool]) -> None:
        self.pools = pools
        self.hold: set[str] = set()
        self.peak = 0
        self.peaks: dict[str, int] = dict.fromkeys(pools, 0)
        self._rng = random.Random(21)
        self._stop = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        for p in self.pools.values():
            p.arrive(0, 50)
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self._stop = True
        assert self._task is not None
        await self._task

    def reset(self) -> None:
        self.peak = self.total()
        self.peaks = {n: p.running for n, p in self.pools.items()}

    def total(self) -> int:
        return sum(p.running for p in self.pools.values())

    def admitted(self, *names: str) -> int:
        return sum(len(self.pools[n].admitted) for n in names)

    async def served(self, what: str, *names: str) -> None:
        """Until ``names`` (every replica by default) had ``ADMISSIONS`` more admissions."""
        names = names or tuple(self.pools)
        base = self.admitted(*names)
        await until(lambda: self.admitted(*names) >= base + ADMISSIONS, what)

    async def _run(self) -> None:
        while not self._stop:
            for name, p in self.pools.items():
                if name not in self.hold and p.running and self._rng.random() < 0.3:
                    p.finish()
                    p.arrive(0)
            self.peak = max(self.peak, self.total())
            for name, p in self.pools.items():
                self.peaks[name] = max(self.peaks[name], p.running)
            await asyncio.sleep(0.01)  # the load's pace (no assertion rests on it)


async def mine_in_redis(server: RedisServer, name: str) -> int:
    _, leases = await leases_in_redis(server.url)
    return sum(1 for lease in leases if lease.startswith(f"{name}:"))


@pytest.mark.parametrize("long_streams", [False, True], ids=["short", "long-streams"])
def test_a_cut_off_replica_never_grows_and_stops_once_its_leases_expire(
    redis_server: RedisServer, long_streams: bool
) -> None:
    """``long_streams``: the cut-off replica's requests never end during the cut, the worst
    case: the pool runs the limit plus what it held until they end."""

    async def main() -> None:
        with TcpProxy(redis_server.port) as proxy:
            ms: dict[str, tuple[LeaseManager, FakePool]] = {
                "a": replica(f"redis://127.0.0.1:{proxy.port}/0", "a", LIMIT, lease_s=LEASE_S),
                "b": replica(redis_server.url, "b", LIMIT, lease_s=LEASE_S),
                "c": replica(redis_server.url, "c", LIMIT, lease_s=LEASE_S),
            }
            a, pa = ms["a"]
            for m, _ in ms.values():
                m.start()
            await until(
                lambda: all(m.ledger.connected for m, _ in ms.values()), "all reached Redis"
            )
            load = Load({n: p for n, (_, p) in ms.items()})
            load.start()
            await load.served("the load runs")
            assert load.peak <= LIMIT

            if long_streams:  # the worst case: a holds a third of the pool or more
                await until(lambda: a.ledger.held >= LIMIT // 3, "a holds its share")
                load.hold.add("a")
            proxy.cut()
            await until(lambda: a.ledger.mode is Mode.DEGRADED, "a degraded")
            held = (
                a.ledger.held
            )  # degraded, it holds no more (an answer relayed before the cut is in)
            load.reset()
            await until(lambda: a.debug()["phase"] == "expired", "a's leases expired for a")
            stopped = load.admitted("a")
            assert a.debug()["local_limit"] == 0

            # Redis expires a's leases later than a does (with any that a call cut off on its
            # way back granted it: a counts those as doubtful, not held); then b and c may
            # take them.
            async def gone() -> bool:
                return await mine_in_redis(redis_server, "a") == 0

            await until_redis(gone, "a's leases expired in Redis")
            await load.served("b and c run the whole pool", "b", "c")
            assert load.admitted("a") == stopped, "a admitted after its leases expired"
            assert load.peaks["a"] <= held, (load.peaks["a"], held)
            assert load.peak <= LIMIT + held, (load.peak, held)
            print(f"cut: a held {held}, most in flight {load.peak} (limit {LIMIT})")
            if long_streams:
                load.hold.clear()  # a's streams end: the excess drains
                await until(lambda: pa.running == 0, "a's streams ended")
                load.reset()
                await load.served("b and c alone", "b", "c")
                assert load.peak <= LIMIT, load.peak

            proxy.restore()
            await until(lambda: a.ledger.mode is Mode.SHARED, "a rejoined")
            await until(
                lambda: a.ledger.known().grace.until <= asyncio.get_running_loop().time(),
                "the rejoin grace over",
            )
            load.reset()
            await load.served("the load runs in plain shared mode")
            assert load.peak <= LIMIT, load.peak
            await load.stop()
            assert sum(m.ledger.held for m, _ in ms.values()) <= LIMIT
            for m, _ in ms.values():
                await m.close()

    run(main())
