"""One slow call (over ``pool.shared.timeout``) degrades only itself, on a real redis-server
made slow for a moment (``DEBUG SLEEP``, which holds the server's one thread): the replica
stays shared, acquisition goes on at once, a failed renewal goes again a poll later (not an
interval), and the leases the slow call may have been granted go back. Each stage waits for a
fact (the server busy, an answer applied), not for a time."""

from __future__ import annotations

import asyncio
import socket

from extproc.pool.shared import LeaseManager, Mode
from extproc.pool.shared.decide import POLL_S
from testing.leases import FakePool, leases_in_redis, replica, run, until, until_redis
from testing.redis import RedisServer

LIMIT = 4
LEASE_S = 10.0  # no renewal falls due during the test unless it is kicked
TIMEOUT_S = 0.5
SLEEP_S = 0.8  # the server's pause: one call times out, the next one (a poll later) does not


def pause(server: RedisServer) -> socket.socket:
    """Redis busy for ``SLEEP_S`` from now: returns once another client's PING waits."""
    busy = socket.create_connection(("127.0.0.1", server.port), 2)
    busy.sendall(f"DEBUG SLEEP {SLEEP_S}\r\n".encode())
    for _ in range(100):
        with socket.create_connection(("127.0.0.1", server.port), 2) as probe:
            probe.settimeout(0.05)
            probe.sendall(b"PING\r\n")
            try:
                probe.recv(16)
            except TimeoutError:
                return busy  # the PING waits: Redis runs the sleep
    busy.settimeout(1)
    raise AssertionError(f"redis-server never got busy; DEBUG SLEEP answered {busy.recv(200)!r}")


async def started(server: RedisServer) -> tuple[LeaseManager, FakePool, list[str]]:
    """Replica "a", started and connected; the list its failed calls go to."""
    errors: list[str] = []
    a, pa = replica(
        server.url, "a", LIMIT, lease_s=LEASE_S, timeout_s=TIMEOUT_S, on_error=errors.append
    )
    a.start()
    await until(lambda: a.ledger.connected, "a reached Redis")
    return a, pa, errors


async def renewed_after(m: LeaseManager, t: float) -> None:
    await until(lambda: m.ledger.known().valid_until > t, "a renewal answered")


def test_one_slow_acquire_fails_alone(redis_server: RedisServer) -> None:
    async def main() -> None:
        a, pa, errors = await started(redis_server)
        busy = pause(redis_server)
        pa.arrive(0, 2)  # its ACQUIRE waits for the sleep, past the timeout
        await until(lambda: errors == ["acquire"], "the acquire timed out")
        assert a.ledger.mode is Mode.SHARED
        await until(lambda: pa.running == 2, "the next acquire admitted them")
        busy.close()
        assert a.ledger.mode is Mode.SHARED and a.ledger.degraded_transitions == 0
        assert a.debug()["rejoin_grace_s"] == 0  # nothing caps what it takes

        async def only_its_own() -> bool:  # the late grant went back with the renewal
            _, leases = await leases_in_redis(redis_server.url)
            return sorted(leases) == sorted(a.ledger._ids)

        await until_redis(only_its_own, "Redis holds exactly a's leases")
        pa.arrive(0, 2)
        await until(lambda: pa.running == LIMIT, "the whole pool")
        await a.close()

    run(main())


def test_one_slow_renewal_fails_alone_and_goes_again_a_poll_later(
    redis_server: RedisServer,
) -> None:
    async def main() -> None:
        a, pa, errors = await started(redis_server)
        pa.arrive(0, 2)
        await until(lambda: pa.running == 2, "a runs 2")
        before = a.ledger.known().valid_until
        busy = pause(redis_server)
        a._kick()  # a renewal now, into the sleep
        await until(lambda: errors == ["renew"], "the renewal timed out")
        assert a.ledger.mode is Mode.SHARED
        assert a._next_renew <= asyncio.get_running_loop().time() + POLL_S  # not an interval
        await renewed_after(a, before)  # a poll later, not an interval (3.3 s)
        busy.close()
        assert errors == ["renew"]
        assert a.ledger.mode is Mode.SHARED and a.ledger.degraded_transitions == 0
        assert a.debug()["local_limit"] == 2 and a.debug()["rejoin_grace_s"] == 0
        pa.arrive(0, 2)
        await until(lambda: pa.running == LIMIT, "the whole pool")
        await a.close()

    run(main(), limit_s=30)
