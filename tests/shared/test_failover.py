"""A failover as the supported deployment has one (``docs/scaling.md``, "Failover"): two real
redis-server processes, the replica a ``REPLICAOF`` of the primary, and the address the
sidecars use following the primary (a TCP proxy here, ``testing.tcp_proxy``, as a Service or a
DNS name would). The failover promotes the replica (``REPLICAOF NO ONE``), demotes the old
primary to a replica of it and repoints the address; the replicas' pooled connections and
subscriptions still reach the old node, which answers ``READONLY``. They must drop them and
carry on against the new primary: leases renewed there, the subscription there, the limit
held. Each stage waits for a fact, not for a time."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from extproc.pool.shared import Mode
from extproc.pool.shared.client import node_lost
from testing.leases import replica, run, until, until_redis
from testing.redis import RedisServer
from testing.tcp_proxy import TcpProxy

LIMIT = 4
LEASE_S = 2.0


@pytest.mark.redis  # servers of its own, not the fixture's
def test_a_failover_to_a_promoted_replica_is_followed(tmp_path: Path) -> None:
    async def main() -> None:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        with (
            RedisServer(tmp_path / "a") as old,
            RedisServer(tmp_path / "b") as new,
            TcpProxy(old.port) as address,
        ):
            r_old = aioredis.Redis.from_url(old.url, decode_responses=True)
            r_new = aioredis.Redis.from_url(new.url, decode_responses=True)
            await r_new.replicaof("127.0.0.1", old.port)
            url = f"redis://127.0.0.1:{address.port}/0"
            errors: list[str] = []  # a's failed calls
            ms = [
                replica(url, "a", LIMIT, lease_s=LEASE_S, on_error=errors.append),
                replica(url, "b", LIMIT, lease_s=LEASE_S),
            ]
            (a, pa), (b, pb) = ms
            for m, _ in ms:
                m.start()
            await until(lambda: a.ledger.connected and b.ledger.connected, "both reached Redis")
            pa.arrive(0, 2)
            await until(lambda: pa.running == 2, "a runs 2")
            pb.arrive(0, 2)
            await until(lambda: pb.running == 2, "b runs 2: the pool is full")
            pa.arrive(0, 2)  # waiting at a
            keys = a.keys

            async def replicated() -> bool:
                info = await r_new.info("replication")
                return (
                    info.get("master_link_status") == "up"
                    and (await r_new.zcard(keys.leases)) == LIMIT
                )

            await until_redis(replicated, "the replica has the leases")

            # The failover: the replica promoted, the old primary demoted, the address moved.
            await r_new.replicaof("NO", "ONE")
            await r_old.replicaof("127.0.0.1", new.port)
            address.retarget(new.port)
            base = len(errors)

            # Every call of theirs goes to the new primary from here: a renewal there (the
            # leases scored again on the new primary's clock) and the subscription there.
            scores = {
                lease: await r_new.zscore(keys.leases, lease)
                for lease in [*a.ledger._ids, *b.ledger._ids]
            }

            async def renewed_on_new() -> bool:
                for lease, before in scores.items():
                    score = await r_new.zscore(keys.leases, lease)
                    if score is None or score <= (before or 0):
                        return False
                return True

            a._kick()
            b._kick()
            await until_redis(renewed_on_new, "leases renewed on the new primary")

            async def subscribed_on_new() -> bool:
                on_new = dict(await r_new.pubsub_numsub(keys.channel))
                on_old = dict(await r_old.pubsub_numsub(keys.channel))
                return on_new.get(keys.channel) == 2 and on_old.get(keys.channel) == 0

            await until_redis(subscribed_on_new, "subscribed on the new primary")
            # A slot freed on b reaches a waiter through the new primary; the limit holds.
            pb.finish()
            await until(lambda: pa.running == 3, "the slot passed on")
            assert pa.running + pb.running == LIMIT
            assert await r_new.zcard(keys.leases) <= LIMIT
            assert a.ledger.mode is Mode.SHARED and b.ledger.mode is Mode.SHARED
            assert a.ledger.degraded_transitions == 0 and b.ledger.degraded_transitions == 0
            print(f"failover: {len(errors) - base} failed call(s) on a, no degraded mode")
            for m, _ in ms:
                await m.close()
            await r_old.aclose()
            await r_new.aclose()

    run(main())


@pytest.mark.parametrize(
    ("exc", "lost"),
    [
        (ReadOnlyError("You can't write against a read only replica."), True),
        # Redis 6 wraps what a script's write met in ERR ...
        (ResponseError("Error running script (call to f_1): @user_script:6: -READONLY You"), True),
        (ResponseError("MASTERDOWN Link with MASTER is down"), True),
        (RedisConnectionError("Connection reset by peer"), True),
        (ConnectionRefusedError(111, "refused"), True),
        (ResponseError("ERR wrong number of arguments"), False),
        (RedisTimeoutError("Timeout reading from socket"), False),  # slow: this call alone
        (TimeoutError(), False),
    ],
)
def test_which_errors_say_the_node_is_lost(exc: BaseException, lost: bool) -> None:
    assert node_lost(exc) is lost
