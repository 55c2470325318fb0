"""PoolControl on a shared adaptive pool, with real gates and a real redis-server: one
replica leads and runs the adaptive poller, the others do not and read its limit; when the
leader leaves, another takes over and starts its own poller from the limit in force."""

from __future__ import annotations

import asyncio

from extproc.config.policy import Policy, policy_from_yaml
from extproc.ops.metrics import Metrics
from extproc.pool.control import PoolControl
from extproc.pool.gate import Gate
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
  shared: {{redis: "{redis_url}", key_prefix: ctl, lease: 1s, timeout: 200ms}}
backend: {{metrics: ["http://127.0.0.1:{free_port()}/metrics"]}}
buckets:
  - {{name: all, queue_timeout: 2s, max_queue: 10}}
"""
    )


def test_one_leader_runs_the_poller_and_the_others_read_its_limit(
    redis_server: RedisServer,
) -> None:
    async def main() -> None:
        p = policy(redis_server.url)
        controls = []
        for _ in range(3):
            gate = Gate(p)
            control = PoolControl(gate, Metrics(gate.statistics))
            control.apply(p)
            control.start()
            controls.append(control)

        def leaders() -> list[PoolControl]:
            return [c for c in controls if c._shared is not None and c._shared.is_leader]

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
            lambda: len([c for c in rest if c._shared and c._shared.is_leader]) == 1, "takeover"
        )
        new = next(c for c in rest if c._shared is not None and c._shared.is_leader)
        await until_async(lambda: new._poller is not None, "the new leader polls")
        assert new.gauges()["shared_leader"] == 1
        for c in rest:
            await c.stop()
            await c.close()

    asyncio.run(asyncio.wait_for(main(), 30))
