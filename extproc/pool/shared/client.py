"""The Redis side of one replica: its two connections, the three scripts called under their
deadline, the events channel.

Every call passes the ARGV each script starts with (the replica's id, the lease in ms, the
replica's own limit, the events channel: ``extproc.pool.shared.scripts``), runs under
``pool.shared.timeout`` and returns the reply decoded (``extproc.pool.shared.replies``). A call
that fails (a Redis error, a socket error, the deadline) raises ``CallFailed``, which names
the script; a reply of another shape raises ``ReplyError``. The first call of a script after
Redis started also loads it (NOSCRIPT, two more round trips, once). A pooled connection
found broken is retried once, at once (a Redis that restarted fails the first use of every
old connection); a timeout never is, so the deadline holds.

Pub/sub has a connection of its own, without a socket timeout (it waits for messages as
long as it likes).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from extproc.config.policy import SharedPolicy
from extproc.pool.shared import replies
from extproc.pool.shared.scripts import ACQUIRE, RENEW, RETURN, Keys, encode_demand

__all__ = ["CallFailed", "PoolClient"]


class CallFailed(Exception):
    """Script ``call`` (``acquire``, ``return``, ``renew``) failed with ``cause``."""

    def __init__(self, call: str, cause: BaseException) -> None:
        super().__init__(f"{call}: {type(cause).__name__}: {cause}")
        self.call = call
        self.cause = cause


class PoolClient:
    def __init__(self, policy: SharedPolicy, replica: str) -> None:
        self._policy = policy
        self._replica = replica
        self.keys = Keys.for_prefix(policy.key_prefix)
        t = policy.timeout_s
        common: dict[str, Any] = {
            "socket_connect_timeout": t,
            "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            "retry_on_timeout": False,
            "client_name": f"llm-extproc:{replica}",
        }
        self._redis = aioredis.Redis.from_url(policy.redis, socket_timeout=t, **common)
        self._sub = aioredis.Redis.from_url(policy.redis, **common)
        self._acquire = self._redis.register_script(ACQUIRE)
        self._return = self._redis.register_script(RETURN)
        self._renew = self._redis.register_script(RENEW)

    async def acquire(
        self, ask: Mapping[int, int], ids: Sequence[str], *, limit: int
    ) -> replies.Acquired:
        """Ask for ``ask`` (per band) with one candidate id per waiter."""
        raw = await self._call("acquire", self._acquire, limit, [encode_demand(ask)], ids)
        return replies.acquired(raw)

    async def give_back(
        self, ids: Sequence[str], *, to: str, hold_ms: int, limit: int
    ) -> replies.Returned:
        """Give ``ids`` back, kept for replica ``to`` ('' anyone) for ``hold_ms``."""
        raw = await self._call("return", self._return, limit, ["-", to, hold_ms], ids)
        return replies.returned(raw)

    async def write_demand(self, demand: Mapping[int, int], *, limit: int) -> None:
        """Write this replica's demand, giving nothing back (the reply is not read)."""
        await self._call("return", self._return, limit, [encode_demand(demand), "", 0], [])

    async def leave(self, ids: Sequence[str], *, limit: int) -> None:
        """Give ``ids`` back and leave the pool: demand, entry and leadership."""
        await self._call("return", self._return, limit, ["bye", "", 0], ids)

    async def renew(
        self,
        *,
        demand: Mapping[int, int],
        volunteer: bool,
        publish: int | None,
        renew: Sequence[str],
        back: Sequence[str],
        claim: Sequence[str],
        limit: int,
    ) -> replies.Renewed:
        """Renew ``renew``, give ``back`` back, claim ``claim`` while there is room, write
        ``demand``; ``volunteer``: lead if nobody does; ``publish``: the limit, if leading."""
        fields = [
            encode_demand(demand),
            "1" if volunteer else "0",
            "" if publish is None else str(publish),
            len(renew),
            len(back),
            len(claim),
        ]
        raw = await self._call("renew", self._renew, limit, fields, [*renew, *back, *claim])
        return replies.renewed(raw)

    async def listen(self, on_message: Callable[[bytes], None], pause_s: float) -> None:
        """Hand every message of the events channel to ``on_message``, for ever; after an
        error, subscribe again ``pause_s`` later."""
        while True:
            pubsub = self._sub.pubsub()
            try:
                async with asyncio.timeout(self._policy.timeout_s):
                    await pubsub.subscribe(self.keys.channel)
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is not None and msg.get("type") == "message":
                        on_message(msg["data"])
            except (RedisError, OSError, TimeoutError):
                pass  # polling carries on; renewals tell whether Redis is back
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
            await asyncio.sleep(pause_s)

    async def aclose(self) -> None:
        for client in (self._redis, self._sub):
            with contextlib.suppress(Exception):
                await client.aclose()

    async def _call(
        self, call: str, script: Any, limit: int, fields: Sequence[Any], ids: Sequence[str]
    ) -> Any:
        policy = self._policy
        args = [self._replica, int(policy.lease_s * 1000), limit, self.keys.channel, *fields]
        try:
            async with asyncio.timeout(policy.timeout_s):
                return await script(keys=self.keys.all, args=[*args, *ids])
        except (RedisError, OSError, TimeoutError) as e:
            raise CallFailed(call, e) from e
