"""What the shared pool's Redis calls cost, against a throwaway local redis-server
(``testing.redis.RedisServer``): ``python -m bench.micro.redis_rtt [--n 2000]``.

Prints the latency (median, p99: ``bench.common.stats.percentile``) of one ``ACQUIRE`` and one
``RETURN`` (the script calls a replica makes, sequentially), of one ``RENEW`` of 64 leases, the
acquire + return cycles per second one client sustains, and the hand-over: from a release on
replica B, whose lease goes to a waiter on replica A, to that waiter being admitted on A
(``RETURN`` + pub/sub + ``ACQUIRE``). Figures: docs/scaling.md, "Measured here".
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis

from bench.common.stats import percentile_scaled
from extproc.config.policy import SharedPolicy
from extproc.pool.shared import LeaseManager
from extproc.pool.shared.scripts import ACQUIRE, RENEW, RETURN, Keys
from testing.redis import RedisServer


class _Pool:
    """The least local pool: at most ``held`` running, FIFO waiters."""

    def __init__(self) -> None:
        self.running = self.held = self.waiting = 0
        self.manager: LeaseManager | None = None
        self.admitted = asyncio.Event()

    def shared_view(self) -> tuple[int, dict[int, int]]:
        return self.running, ({0: self.waiting} if self.waiting else {})

    def set_leases(self, held: int, pool_limit: int) -> None:
        self.held = held
        while self.waiting and self.running < self.held:
            self.waiting -= 1
            self.running += 1
            self.admitted.set()


async def _knows(holder: LeaseManager, replica: str) -> None:
    """Until ``holder`` has heard that ``replica`` waits."""
    for _ in range(5000):
        if replica in holder.ledger._others:
            return
        await asyncio.sleep(0.001)
    raise TimeoutError


def _ms(values: list[float]) -> str:
    p50, p99 = percentile_scaled(values, 50, 1e3), percentile_scaled(values, 99, 1e3)
    return f"median {p50:.3f} ms, p99 {p99:.3f} ms"


async def _scripts(url: str, n: int) -> None:
    r = aioredis.Redis.from_url(url)
    keys = Keys.for_prefix("rtt")
    acquire, give, renew = (r.register_script(s) for s in (ACQUIRE, RETURN, RENEW))
    head: list[str | int] = ["me", 10000, 1000, keys.channel]
    await acquire(keys=keys.all, args=[*head, "0:1", "me:w"])  # load the scripts
    await give(keys=keys.all, args=[*head, "-", "", 0, "me:w"])
    await renew(keys=keys.all, args=[*head, "", "0", "", 0, 0, 0, 0])
    acq: list[float] = []
    ret: list[float] = []
    t0 = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        await acquire(keys=keys.all, args=[*head, "0:1", f"me:{i}"])
        acq.append(time.perf_counter() - t)
        t = time.perf_counter()
        await give(keys=keys.all, args=[*head, "-", "", 0, f"me:{i}"])
        ret.append(time.perf_counter() - t)
    rate = n / (time.perf_counter() - t0)
    ids = [f"me:r{i}" for i in range(64)]
    await acquire(keys=keys.all, args=[*head, "0:64", *ids])
    ren: list[float] = []
    for _ in range(max(1, n // 10)):
        t = time.perf_counter()
        await renew(keys=keys.all, args=[*head, "", "0", "", 64, 0, 0, 0, *ids])
        ren.append(time.perf_counter() - t)
    await r.aclose()
    print(f"ACQUIRE 1 lease:   {_ms(acq)}")
    print(f"RETURN 1 lease:    {_ms(ret)}")
    print(f"RENEW 64 leases:   {_ms(ren)}")
    print(f"acquire + return:  {rate:.0f} cycles/s (one client, sequential)")


async def _handover(url: str, n: int) -> None:
    policy = SharedPolicy(redis=url, key_prefix="rtt-hand", lease_s=10.0, timeout_s=0.5)
    pools = [_Pool(), _Pool()]
    managers = [
        LeaseManager(p, policy, limit=1, replica=name) for p, name in zip(pools, "ab", strict=True)
    ]
    for p, m in zip(pools, managers, strict=True):
        # Replicas of a pool that has run a while (the hand-over is measured, not the first
        # lease a pool starting on an empty Redis waits out: docs/scaling.md, the fence).
        m.ledger.roster = []
        p.manager = m
        m.start()
    a, b = pools
    b.waiting = 1
    managers[1].on_change()
    await asyncio.wait_for(b.admitted.wait(), 5)
    took: list[float] = []
    for i in range(n):
        waiter, holder = (a, b) if i % 2 == 0 else (b, a)
        waiter.admitted.clear()
        waiter.waiting = 1
        assert waiter.manager is not None and holder.manager is not None
        waiter.manager.on_change()
        await _knows(holder.manager, waiter.manager.ledger.replica)
        t = time.perf_counter()
        holder.manager.on_release()
        holder.running -= 1
        holder.manager.on_change()
        await asyncio.wait_for(waiter.admitted.wait(), 5)
        took.append(time.perf_counter() - t)
    for m in managers:
        await m.close()
    print(f"hand-over B -> A:  {_ms(took)} (release to admission on the other replica)")


async def run(n: int) -> None:
    """Every figure, against a redis-server started for the run."""
    with RedisServer(Path(tempfile.mkdtemp(prefix="shared-rtt-"))) as server:
        await _scripts(server.url, n)
        await _handover(server.url, max(10, n // 20))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.micro.redis_rtt", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--n", type=int, default=2000, help="script calls of each kind")
    asyncio.run(run(parser.parse_args(argv).n))


if __name__ == "__main__":
    main()
