"""Reloads of a shared pool, in process: real sidecars (``extproc.app.Sidecar``: its gate, pool
control and lease managers, its reload path) on a real redis-server, the load driven through
each sidecar's gate.

A reload of any ``pool.shared`` key builds a new lease manager; the old one retires
(``extproc.pool.lease_adapter``): at every turn of the event loop, each replica runs no more
requests than its managers hold leases, and with the pool unchanged (same Redis, same
``key_prefix``) the replicas together never run more than the limit. A refused reload (a
Redis URL that only the lease manager's client refuses, a tokenizer that does not load)
leaves the gate, the manager and the policy exactly as they were, and says so in the log and
in ``llm_extproc_policy_reloads_total{result="error"}``."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc import app
from extproc.app import Sidecar
from extproc.config.policy import load_policy
from extproc.pool.gate import POOL, Gate, Waiter
from extproc.pool.shared import LeaseManager, Mode, decide
from extproc.pool.shared.decide import Phase
from testing.leases import leases_in_redis, with_redis
from testing.redis import RedisServer
from testing.tcp_proxy import TcpProxy
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
# What each reload changes: one key of pool.shared; the pool is the same one unless the
# Redis URL or the prefix changed.
CHANGES = {
    "lease": "1500ms",
    "timeout": "150ms",
    "replicas": "3",
    "key_prefix": "reload-b",
    "redis": "{url}/1",
}
SAME_POOL = {"lease", "timeout", "replicas"}
# The new manager's policy says so: (field, value).
APPLIED: dict[str, tuple[str, object]] = {
    "lease": ("lease_s", 1.5),
    "timeout": ("timeout_s", 0.15),
    "replicas": ("replicas", 3),
    "key_prefix": ("key_prefix", "reload-b"),
    "redis": ("redis", "<url>/1"),
}


def policy_text(url: str, **changed: str) -> str:
    shared = {**SETTINGS, **changed}
    fields = ", ".join(f"{k}: {v.format(url=url)}" for k, v in shared.items())
    return f"""
pool:
  max_concurrency: {LIMIT}
  shared: {{{fields}}}
buckets:
  - {{name: all, queue_timeout: 30s, max_queue: 100}}
"""


@pytest.fixture
def managers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[LeaseManager]]:
    """Every lease manager made while the test runs, in order."""
    made: list[LeaseManager] = []
    init = LeaseManager.__init__

    def recording(self: LeaseManager, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(LeaseManager, "__init__", recording)
    yield made


def gate_of(m: LeaseManager) -> Gate:
    return m._pool._gate  # type: ignore[attr-defined,no-any-return]


def running(gate: Gate) -> int:
    return gate.pool_statistics()[POOL].in_flight


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
            entered = gate.enter("all", 30.0)
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
    """At every turn of the event loop: each gate runs no more than its managers hold
    leases; with ``pool_limit`` (settable), the gates together run no more than it. Keeps
    the worst."""

    def __init__(self, gates: list[Gate], made: list[LeaseManager], pool_limit: int | None):
        self.gates, self.made, self.pool_limit = gates, made, pool_limit
        self.uncovered = 0  # most requests one replica ran above the leases it held
        self.most = 0  # most requests the replicas ran together, while pool_limit is set
        self.most_ever = 0
        self.turns = 0
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            total = 0
            for g in self.gates:
                held = sum(m.held for m in self.made if gate_of(m) is g)
                n = running(g)
                total += n
                self.uncovered = max(self.uncovered, n - held)
            self.most_ever = max(self.most_ever, total)
            if self.pool_limit is not None:
                self.most = max(self.most, total)
            self.turns += 1
            await asyncio.sleep(0)

    async def close(self) -> None:
        self._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._task


async def leases_left(url: str, prefix: str) -> int:
    return len((await leases_in_redis(url, prefix))[1])


@pytest.mark.parametrize("key", list(CHANGES))
def test_a_reload_under_load_keeps_every_running_request_covered(
    key: str, redis_server: RedisServer, managers: list[LeaseManager], tmp_path: Path
) -> None:
    """Two replicas, 3x overload (12 clients each on a pool of 6): each reloads a policy with
    one ``pool.shared`` key changed, one after the other. The same pool: the two stay within
    its limit throughout; another pool: once both run on it alone. It used to detach the gate
    from its leases at the policy's limit: the whole local queue ran at once, without leases
    (the replicas together at 8-12 on the pool of 6)."""
    url = redis_server.url.removesuffix("/0")
    paths = [tmp_path / f"policy-{i}.yaml" for i in range(2)]
    for p in paths:
        p.write_text(policy_text(url))

    async def main() -> None:
        sidecars = [await sidecar(p) for p in paths]
        gates = [s.gate for s in sidecars if s.gate is not None]
        first = list(managers)
        await until_async(lambda: all(m.connected for m in first), "both reached Redis")
        load = Load(gates, clients=12)
        watch = Watch(gates, managers, LIMIT if key in SAME_POOL else None)
        await load.until_answered(60, "the load runs")
        for s, p in zip(sidecars, paths, strict=True):
            p.write_text(policy_text(url, **{key: CHANGES[key]}))
            assert s.reload()
            await load.until_answered(60, "the load runs after a reload")
        current = [s.control._shared for s in sidecars if s.control is not None]
        assert len(current) == 2 and not set(current) & set(first)
        field, value = APPLIED[key]
        value = f"{url}/1" if key == "redis" else value
        assert [getattr(m.policy, field) for m in current if m is not None] == [value] * 2
        await until_async(lambda: all(m._closed for m in first), "the old managers left")
        watch.pool_limit = LIMIT  # the new pool counts every request now
        await load.until_answered(60, "the load runs on the new managers alone")
        await watch.close()
        await load.close()
        print(f"{key}: {watch.turns} turns, most running {watch.most} ({watch.most_ever} ever)")
        assert watch.uncovered <= 0, f"a replica ran {watch.uncovered} above its leases"
        assert watch.most <= LIMIT, f"{watch.most} running on a pool of {LIMIT}"
        if key not in SAME_POOL:
            assert await leases_left(redis_server.url, SETTINGS["key_prefix"]) == 0
        for s in sidecars:
            await s.stop(0)

    asyncio.run(asyncio.wait_for(main(), 60))


def reloads(s: Sidecar, result: str) -> float:
    assert s.metrics is not None
    value = s.metrics.registry.get_sample_value(
        "llm_extproc_policy_reloads_total", {"result": result}
    )
    return value or 0.0


@pytest.mark.parametrize("why", ["redis-url", "tokenizer"])
def test_a_refused_reload_changes_nothing(
    why: str,
    redis_server: RedisServer,
    managers: list[LeaseManager],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The new policy names another pool (``key_prefix``), and one thing it needs cannot be
    made: a Redis URL that passed validation but not redis-py (``redis://h:abc``: as if
    validation had missed it), or a tokenizer file that does not load. It used to be half
    applied: the gate detached at the policy's limit (the queue admitted without leases),
    the manager replaced, while the log said the current policy was kept."""
    url = redis_server.url.removesuffix("/0")
    path = tmp_path / "policy.yaml"
    path.write_text(policy_text(url))
    new = policy_text(url, key_prefix="reload-b")
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
        assert s.gate is not None and s.control is not None
        gate, control, before = s.gate, s.control, s.policy
        manager = control._shared
        assert manager is not None
        await until_async(lambda: manager.held == 0 and manager.connected, "reached Redis")
        entered = [gate.enter("all", 30.0) for _ in range(LIMIT + 4)]
        await until_async(lambda: running(gate) == LIMIT, "the pool full")
        pool = gate.pool_statistics()[POOL]
        path.write_text(new)
        assert not s.reload()
        assert s.policy is before and gate.policy is before and s.service is not None
        assert s.service.policy is before
        assert control._shared is manager and not manager._closed
        after = gate.pool_statistics()[POOL]
        assert (after.limit, after.in_flight, after.queued) == (pool.limit, LIMIT, 4)
        assert manager.held == LIMIT
        assert reloads(s, "error") == 1 and reloads(s, "ok") == 0
        await asyncio.sleep(0.1)  # nothing the refused policy built acts later
        assert (running(gate), gate.pool_statistics()[POOL].queued) == (LIMIT, 4)
        assert [m for m in managers if m is not manager and not m._closed] == []
        assert await leases_left(redis_server.url, "reload-b") == 0
        for e in entered:
            if isinstance(e, Waiter):
                e.cancel()
            else:
                e.release()
        await s.stop(0)

    with caplog.at_level(logging.INFO, logger="extproc"):
        asyncio.run(asyncio.wait_for(main(), 30))
    assert any(
        r.getMessage().startswith("policy reload refused, keeping the current policy")
        for r in caplog.records
    )


def test_a_reload_while_redis_is_cut_off_admits_nobody_on_a_share(
    redis_server: RedisServer, managers: list[LeaseManager], tmp_path: Path
) -> None:
    """The network to Redis is cut, then the policy changes ``pool.shared.timeout`` (the same
    Redis, the same pool): the new manager's first calls fail and it degrades. It is the
    manager of a replica that had reached Redis, so it runs on the leases it holds, none: as
    the old manager's requests end, nobody new is admitted. It used to count as a replica
    that never reached Redis and run its local share (3 of 6) on top of the requests the old
    manager kept (7 running on a pool of 6 in the test above, when a first call was slow)."""
    with TcpProxy(redis_server.port) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}"
        path = tmp_path / "policy.yaml"
        path.write_text(policy_text(url))

        async def main() -> None:
            s = await sidecar(path)
            assert s.gate is not None and s.control is not None
            gate, old = s.gate, s.control._shared
            assert old is not None
            await until_async(lambda: old.connected, "reached Redis")
            entered = [gate.enter("all", 30.0) for _ in range(LIMIT + 4)]
            admitted = [
                asyncio.ensure_future(e.admitted())
                for e in entered
                if isinstance(e, Waiter)  # admitted as the leases come
            ]
            await until_async(lambda: running(gate) == LIMIT, "the pool full on its leases")
            assert old.held == LIMIT
            proxy.cut()
            path.write_text(policy_text(url, timeout="150ms"))
            assert s.reload()
            new = s.control._shared
            assert new is not None and new is not old and new.reached_before
            await until_async(lambda: new.mode is Mode.DEGRADED, "the new manager degraded")
            now = asyncio.get_running_loop().time()
            assert decide.phase(new.known(), now) is Phase.HOLDING
            assert "never reached" not in new.outage_plan(now)
            slots = [e for e in entered if not isinstance(e, Waiter)]
            slots += [a.result() for a in admitted if a.done()]
            assert len(slots) == LIMIT
            for slot in slots[:2]:  # two of the old manager's requests end
                slot.release()
            pool = gate.pool_statistics()[POOL]
            assert (pool.in_flight, pool.queued) == (LIMIT - 2, 4)  # nobody new on a share
            proxy.restore()
            await until_async(lambda: new.mode is Mode.SHARED, "Redis reached again")
            for slot in slots[2:]:
                slot.release()
            for e, a in zip((e for e in entered if isinstance(e, Waiter)), admitted, strict=True):
                if not a.done():  # still queued: leaves (admitted ones are in ``slots``)
                    a.cancel()
                    e.cancel()
            await s.stop(0)

        asyncio.run(asyncio.wait_for(main(), 30))
