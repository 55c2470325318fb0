"""PoolControl on a shared adaptive pool, with real gates and a real redis-server: one
replica leads and runs the adaptive poller, the others do not and read its limit; when the
leader leaves, another takes over and starts its own poller from the limit in force. A
degraded replica (Redis unreachable, or a URL that cannot be used) computes the limit itself,
and stops when it is shared again and another leads. A reload keeps the lease manager (and
its leadership), or is refused when it changes ``pool.shared``."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

from extproc.config.policy import Policy, PolicyError, policy_from_yaml
from extproc.ops.metrics import Metrics
from extproc.pool.control.wiring import PoolControl
from extproc.pool.core.values import Entry
from extproc.pool.gate import POOL, Gate, Waiter
from extproc.pool.shared import LeaseManager
from testing.leases import with_redis
from testing.redis import RedisServer
from testing.stack import free_port
from testing.wait import until_async


def policy(redis_url: str) -> Policy:
    # The metrics URL answers nothing: the leader's limit falls back to max_concurrency (3)
    # after 0.5 s, which is how the followers can tell they read the leader's limit.
    return policy_from_yaml(
        f"""
pool:
  max_concurrency: 3
  adaptive: {{min: 1, max: 16, initial: 5, interval: 100ms, window: 1s, stale_after: 200ms,
             fallback_after: 500ms}}
  shared: {{redis: "{redis_url}", key_prefix: ctl, lease: 1s, timeout: 200ms, replicas: 1}}
backend: {{metrics: ["http://127.0.0.1:{free_port()}/metrics"]}}
buckets:
  - {{name: all, queue_timeout: 2s, max_queue: 10}}
"""
    )


def started(p: Policy) -> PoolControl:
    """A replica's controller (on a gate of its own) on policy ``p``, started."""
    gate = Gate(p)
    control = PoolControl(gate, Metrics(gate.statistics))
    control.apply(p)
    control.start()
    return control


def test_one_leader_runs_the_poller_and_the_others_read_its_limit(
    redis_server: RedisServer,
) -> None:
    async def main() -> None:
        controls = [started(policy(redis_server.url)) for _ in range(3)]

        def leaders() -> list[PoolControl]:
            return [c for c in controls if c._shared is not None and c._shared.ledger.is_leader]

        await until_async(lambda: len(leaders()) == 1, "one leader")
        leader = leaders()[0]
        await until_async(lambda: leader._poller is not None, "the leader polls")
        assert [c._poller is None for c in controls if c is not leader] == [True, True]
        await until_async(
            lambda: all(c.debug()["shared"]["pool_limit"] == 3 for c in controls),  # type: ignore[index]
            "everyone on the leader's (fallback) limit",
        )
        await leader.stop()
        await leader.close()
        rest = [c for c in controls if c is not leader]
        await until_async(
            lambda: len([c for c in rest if c._shared and c._shared.ledger.is_leader]) == 1,
            "takeover",
        )
        new = next(c for c in rest if c._shared is not None and c._shared.ledger.is_leader)
        await until_async(lambda: new._poller is not None, "the new leader polls")
        assert new.gauges()["shared_leader"] == 1
        for c in rest:
            await c.stop()
            await c.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def errors(metrics: Metrics, call: str) -> float:
    value = metrics.registry.get_sample_value(
        "llm_extproc_shared_redis_errors_total", {"call": call}
    )
    return value or 0.0


@pytest.mark.parametrize("url", ["redis://127.0.0.1:abc/0", "redis://127.0.0.1:99999/0"])
def test_a_redis_url_that_cannot_be_used_degrades_and_the_limit_keeps_adapting(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """redis-py refuses the URL when the client is made: the lease manager could not be
    built, and the policy could not be applied at all (at a reload: refused, half applied,
    the adaptive limit frozen). Now the replica runs degraded on its local share, says why,
    counts every failed call, and its own poller moves the limit: 5 (initial) falls back to
    the pool's ``max_concurrency`` (3) once the backend's metrics have been gone for 0.5 s."""

    async def main() -> None:
        control = started(with_redis(policy("redis://127.0.0.1:6379/0"), url))
        gate, metrics = control._gate, control._metrics

        def shared() -> dict[str, object]:
            view = control.debug()
            assert view is not None
            return view["shared"]  # type: ignore[no-any-return]

        await until_async(lambda: shared()["state"] == "degraded", "degraded")
        await until_async(lambda: shared()["pool_limit"] == 3, "the limit adapts (fallback)")
        pool = gate.pool_statistics()[POOL]
        assert pool.limit == 3  # the local share: 3 // 1 replica
        assert "ValueError" in str(shared()["last_error"])
        await until_async(lambda: errors(metrics, "renew") >= 2, "every probe counted")
        await control.stop()
        await control.close()

    with caplog.at_level(logging.ERROR, logger="extproc.shared"):
        asyncio.run(asyncio.wait_for(main(), 30))
    assert any(
        r.getMessage().startswith(f"shared pool: pool.shared.redis {url} cannot be used")
        for r in caplog.records
    )


def test_an_unreachable_redis_degrades_and_the_limit_keeps_adapting() -> None:
    """A replica that never reached Redis never led, so no poller ran: its limit stayed the
    adaptive limit's ``initial`` (5) for as long as Redis was gone."""

    async def main() -> None:
        control = started(policy(f"redis://127.0.0.1:{free_port()}/0"))  # nobody listens
        gate, metrics = control._gate, control._metrics
        shared = control._shared
        assert shared is not None
        await until_async(lambda: str(shared.ledger.mode) == "degraded", "degraded")
        await until_async(lambda: shared.ledger.limit == 3, "the limit adapts (fallback)")
        assert gate.pool_statistics()[POOL].limit == 3
        assert errors(metrics, "renew") >= 1
        await control.stop()
        await control.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_shared_again_only_the_leader_runs_the_poller(redis_server: RedisServer) -> None:
    """Redis goes away: both replicas run a poller (degraded). It comes back: they rejoin, one
    leads, and the other stops its own."""

    async def main() -> None:
        controls = [started(policy(redis_server.url)) for _ in range(2)]

        def managers() -> list[LeaseManager]:
            return [c._shared for c in controls if c._shared is not None]

        await until_async(lambda: all(m.ledger.connected for m in managers()), "both reached Redis")
        redis_server.stop()
        await until_async(
            lambda: all(str(m.ledger.mode) == "degraded" for m in managers()), "degraded"
        )
        await until_async(lambda: all(c._poller is not None for c in controls), "both poll")
        redis_server.start()
        await until_async(
            lambda: all(str(m.ledger.mode) == "shared" for m in managers()), "rejoined"
        )
        await until_async(
            lambda: (
                [c._poller is not None for c in controls]
                == [m.ledger.is_leader for m in managers()]
                and sum(m.ledger.is_leader for m in managers()) == 1
            ),
            "only the leader polls",
        )
        for c in controls:
            await c.stop()
            await c.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_reload_on_the_leader_keeps_its_manager_and_the_leadership(
    redis_server: RedisServer,
) -> None:
    """The leader reloads while a request runs on it. A new ``pool.shared.lease`` is refused
    (a restart applies it). A new adaptive ``max`` applies in place: the same lease manager,
    on the new bounds, still leading and polling, with the request's lease held."""

    async def main() -> None:
        controls = [started(policy(redis_server.url)) for _ in range(2)]

        def leaders() -> list[PoolControl]:
            return [c for c in controls if c._shared is not None and c._shared.ledger.is_leader]

        await until_async(lambda: len(leaders()) == 1, "one leader")
        leader = leaders()[0]
        entered = leader._gate.enter(Entry(bucket="all", timeout_s=2.0))
        slot = await entered.admitted() if isinstance(entered, Waiter) else entered
        manager = leader._shared
        assert manager is not None and manager.ledger.held == 1
        p = policy(redis_server.url)
        assert p.pool is not None and p.pool.shared is not None and p.pool.adaptive is not None
        shared = dataclasses.replace(p.pool.shared, lease_s=1.5)
        with pytest.raises(PolicyError, match=r"^pool\.shared\.lease changed: .* restart"):
            leader.prepare(dataclasses.replace(p, pool=dataclasses.replace(p.pool, shared=shared)))
        adaptive = dataclasses.replace(p.pool.adaptive, max_limit=12)
        wider = dataclasses.replace(p, pool=dataclasses.replace(p.pool, adaptive=adaptive))
        leader._gate.reconfigure(wider)
        leader.apply(leader.prepare(wider))
        assert leader._shared is manager and manager.ledger.bounds == (1, 12)
        assert manager.ledger.is_leader and leader._poller is not None
        await asyncio.sleep(0.5)  # renewals and the poller's rounds on the new policy
        assert leaders() == [leader] and manager.ledger.held == 1 and not manager._closed
        slot.release()
        for c in controls:
            await c.stop()
            await c.close()

    asyncio.run(asyncio.wait_for(main(), 30))
