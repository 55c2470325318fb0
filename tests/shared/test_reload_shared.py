"""Reloads of a shared pool, in process: real sidecars (``extproc.app.Sidecar``: its gate, pool
control and lease manager, its reload path) on a real redis-server, the load driven through
each sidecar's gate.

A reload that changes ``pool.shared`` (another Redis URL or ``key_prefix``, another ``lease``,
``timeout`` or ``replicas``, or shared mode turned off) is refused: the log says which key and
that a restart applies it, ``llm_extproc_policy_reloads_total{result="error"}`` counts it, and
the pool serves on, on the lease manager and the Redis it had, nothing written where the new
policy pointed. A reload of another setting (the pool's limit) applies, to the same manager. A
reload refused for another reason (a tokenizer that does not load, a Redis URL that only
redis-py refuses) leaves the gate, the manager and the policy exactly as they were."""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path

import pytest

from extproc import app
from extproc.app import Sidecar
from extproc.config.policy import load_policy
from extproc.pool.core.values import Entry
from extproc.pool.gate import POOL, Gate, Waiter
from extproc.pool.shared import LeaseManager
from testing.leases import leases_in_redis, with_redis
from testing.redis import RedisServer
from testing.wait import until_async

pytestmark = [pytest.mark.redis]

LIMIT = 6
SETTINGS = {
    "redis": "{url}/0",
    "key_prefix": "reload",
    "lease": "1s",
    "timeout": "200ms",
    "replicas": "2",
}
RESTART = "; restart the sidecar (a rolling restart) to apply it"
MOVE = "a reload cannot move a running pool to another"
# What each refused reload changes (None: no pool.shared at all), and why it is refused.
REFUSED: dict[str, tuple[dict[str, str] | None, str]] = {
    "redis": ({"redis": "{url}/1"}, f"pool.shared.redis changed: {MOVE} Redis"),
    "key_prefix": (
        {"key_prefix": "reload-b"},
        f"pool.shared.key_prefix changed: {MOVE} pool on its Redis",
    ),
    "lease": ({"lease": "1500ms"}, "pool.shared.lease changed"),
    "timeout": ({"timeout": "150ms"}, "pool.shared.timeout changed"),
    "replicas": ({"replicas": "3"}, "pool.shared.replicas changed"),
    "off": (None, "pool.shared removed: a reload cannot turn shared mode off"),
}


def policy_text(url: str, changed: dict[str, str] | None = None, limit: int = LIMIT) -> str:
    """The pool of ``limit`` shared on ``SETTINGS`` with ``changed`` (None: not shared)."""
    shared = {**SETTINGS, **(changed or {})}
    fields = ", ".join(f"{k}: {v.format(url=url)}" for k, v in shared.items())
    return f"""
pool:
  max_concurrency: {limit}
  {f"shared: {{{fields}}}" if changed is not None else ""}
buckets:
  - {{name: all, queue_timeout: 30s, max_queue: 100}}
"""


def running(gate: Gate) -> int:
    return gate.pool_statistics()[POOL].in_flight


def manager_of(s: Sidecar) -> LeaseManager:
    assert s.control is not None and s.control._shared is not None
    return s.control._shared


async def sidecar(path: Path) -> Sidecar:
    s = Sidecar(
        load_policy(path),
        listen="127.0.0.1:0",
        metrics_listen=None,
        policy_path=path,
        watch_interval_s=0,
    )
    await s.start()
    return s


def reloads(s: Sidecar, result: str) -> float:
    assert s.metrics is not None
    value = s.metrics.registry.get_sample_value(
        "llm_extproc_policy_reloads_total", {"result": result}
    )
    return value or 0.0


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    prefix = "policy reload refused, keeping the current policy: "
    return [
        m.removeprefix(prefix) for r in caplog.records if (m := r.getMessage()).startswith(prefix)
    ]


class Load:
    """``clients`` clients per gate, each holding its slot 10-40 ms, then entering again."""

    def __init__(self, gates: list[Gate], clients: int, seed: int = 21) -> None:
        self.stop = asyncio.Event()
        self.answered = 0
        self._rng = random.Random(seed)
        self._tasks = [
            asyncio.ensure_future(self._client(g)) for g in gates for _ in range(clients)
        ]

    async def _client(self, gate: Gate) -> None:
        while not self.stop.is_set():
            entered = gate.enter(Entry(bucket="all", timeout_s=30.0))
            slot = await entered.admitted() if isinstance(entered, Waiter) else entered
            try:
                await asyncio.sleep(self._rng.uniform(0.01, 0.04))
            finally:
                slot.release()
            self.answered += 1

    async def until_answered(self, n: int, what: str) -> None:
        base = self.answered
        await until_async(lambda: self.answered >= base + n, what)

    async def close(self) -> None:
        self.stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), 30)


class Watch:
    """At every turn of the event loop: each sidecar runs no more than its manager holds
    leases, and the sidecars together no more than ``pool_limit``. Keeps the worst."""

    def __init__(self, sidecars: list[Sidecar], pool_limit: int) -> None:
        self.sidecars, self.pool_limit = sidecars, pool_limit
        self.uncovered = 0  # most requests one replica ran above the leases it held
        self.most = 0  # most requests the replicas ran together
        self.turns = 0
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            total = 0
            for s in self.sidecars:
                assert s.gate is not None
                n = running(s.gate)
                total += n
                self.uncovered = max(self.uncovered, n - manager_of(s).ledger.held)
            self.most = max(self.most, total)
            self.turns += 1
            await asyncio.sleep(0)

    async def close(self) -> None:
        self._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._task
        assert self.uncovered <= 0, f"a replica ran {self.uncovered} above its leases"
        assert self.most <= self.pool_limit, f"{self.most} running on a pool of {self.pool_limit}"


async def leases_left(url: str, prefix: str) -> int:
    return len((await leases_in_redis(url, prefix))[1])


@pytest.mark.parametrize("key", list(REFUSED))
def test_a_reload_that_changes_pool_shared_is_refused_and_the_pool_serves_on(
    key: str, redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A sidecar at 2x overload (12 clients on the pool of 6) reloads a policy whose
    ``pool.shared`` changed: refused, with why and that a restart applies it. The same lease
    manager serves on, on the leases it holds in the Redis and ``key_prefix`` it had (within
    the limit and its leases at every turn of the event loop); nothing is leased where the new
    policy pointed. (A reload used to switch lease managers while requests ran.)"""
    url = redis_server.url.removesuffix("/0")
    path = tmp_path / "policy.yaml"
    path.write_text(policy_text(url, {}))
    changed, why = REFUSED[key]

    async def main() -> None:
        s = await sidecar(path)
        assert s.gate is not None
        before, manager = s.policy, manager_of(s)
        await until_async(lambda: manager.ledger.connected, "reached Redis")
        load = Load([s.gate], clients=12)
        watch = Watch([s], LIMIT)
        await load.until_answered(60, "the load runs")
        path.write_text(policy_text(url, changed))
        assert not s.reload()
        assert (reloads(s, "error"), reloads(s, "ok")) == (1, 0)
        assert s.policy is before and s.gate.policy is before
        assert manager_of(s) is manager and not manager._closed
        await load.until_answered(60, "the pool serves on")
        assert before.pool is not None and manager.ledger.policy == before.pool.shared
        assert await leases_left(redis_server.url, SETTINGS["key_prefix"]) > 0
        assert await leases_left(f"{url}/1", SETTINGS["key_prefix"]) == 0
        assert await leases_left(redis_server.url, "reload-b") == 0
        await watch.close()
        await load.close()
        print(f"{key}: {watch.turns} turns, most running {watch.most}")
        await s.stop(0)

    with caplog.at_level(logging.INFO, logger="extproc"):
        asyncio.run(asyncio.wait_for(main(), 60))
    [refused] = refusals(caplog)
    assert refused.startswith(why) and refused.endswith(RESTART), refused


def test_a_reload_of_the_pools_limit_applies_to_the_same_managers(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Two replicas at 3x overload (12 clients each on the pool of 6) reload the pool's limit,
    4, ``pool.shared`` as it was: applied, on the same lease managers, which give the leases
    above it back; then the two run within 4 and within their leases at every turn."""
    url = redis_server.url.removesuffix("/0")
    paths = [tmp_path / f"policy-{i}.yaml" for i in range(2)]
    for p in paths:
        p.write_text(policy_text(url, {}))

    async def main() -> None:
        sidecars = [await sidecar(p) for p in paths]
        gates = [s.gate for s in sidecars if s.gate is not None]
        managers = [manager_of(s) for s in sidecars]
        await until_async(lambda: all(m.ledger.connected for m in managers), "reached Redis")
        load = Load(gates, clients=12)
        await load.until_answered(60, "the load runs")
        for s, p in zip(sidecars, paths, strict=True):
            p.write_text(policy_text(url, {}, limit=4))
            assert s.reload() and reloads(s, "ok") == 1
            assert manager_of(s) is managers[sidecars.index(s)]
        assert [m.ledger.limit for m in managers] == [4, 4]
        await until_async(
            lambda: sum(m.ledger.held for m in managers) <= 4 and sum(map(running, gates)) <= 4,
            "the leases above the new limit given back",
        )
        watch = Watch(sidecars, 4)
        await load.until_answered(60, "the load runs on the new limit")
        await watch.close()
        await load.close()
        assert not any(m._closed for m in managers)
        for s in sidecars:
            await s.stop(0)

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("why", ["redis-url", "tokenizer"])
def test_a_refused_reload_changes_nothing(
    why: str,
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The pool full (6 running on their leases, 4 waiting), a reload is refused: a Redis URL
    that passed validation but not redis-py (``redis://h:abc``: as if validation had missed
    it), or a tokenizer file that does not load, in a policy with the limit doubled. The gate,
    the manager, its leases and the policy stay exactly as they were."""
    url = redis_server.url.removesuffix("/0")
    path = tmp_path / "policy.yaml"
    path.write_text(policy_text(url, {}))
    new = policy_text(url, {}, limit=2 * LIMIT)
    if why == "tokenizer":
        (tmp_path / "tokenizer.json").write_text("not a tokenizer")
        new = f"tokens: {{tokenizer: {tmp_path / 'tokenizer.json'}}}\n{new}"
    else:
        loaded = app.load_policy
        monkeypatch.setattr(
            app, "load_policy", lambda p: with_redis(loaded(p), "redis://127.0.0.1:abc/0")
        )

    async def main() -> None:
        s = await sidecar(path)
        assert s.gate is not None and s.service is not None
        gate, before, manager = s.gate, s.policy, manager_of(s)
        await until_async(lambda: manager.ledger.connected, "reached Redis")
        entered = [gate.enter(Entry(bucket="all", timeout_s=30.0)) for _ in range(LIMIT + 4)]
        await until_async(lambda: running(gate) == LIMIT, "the pool full")
        pool = gate.pool_statistics()[POOL]
        path.write_text(new)
        assert not s.reload()
        assert s.policy is before and gate.policy is before and s.service.policy is before
        assert manager_of(s) is manager and not manager._closed
        after = gate.pool_statistics()[POOL]
        assert (after.limit, after.in_flight, after.queued) == (pool.limit, LIMIT, 4)
        assert manager.ledger.held == LIMIT and manager.ledger.limit == LIMIT
        assert reloads(s, "error") == 1 and reloads(s, "ok") == 0
        await asyncio.sleep(0.1)  # nothing the refused policy built acts later
        assert (running(gate), gate.pool_statistics()[POOL].queued) == (LIMIT, 4)
        for e in entered:
            if isinstance(e, Waiter):
                e.cancel()
            else:
                e.release()
        await s.stop(0)

    with caplog.at_level(logging.INFO, logger="extproc"):
        asyncio.run(asyncio.wait_for(main(), 30))
    [refused] = refusals(caplog)
    if why == "redis-url":
        assert refused == f"pool.shared.redis changed: {MOVE} Redis{RESTART}"
