"""The Redis side of one replica: its two connections, the three scripts called under their
deadline, the events channel.

Every call passes the ARGV each script starts with (the replica's id, the lease in ms, the
replica's own limit and its bounds, the events channel: ``extproc.pool.shared.scripts``), runs
under ``pool.shared.timeout`` and returns the reply decoded (``extproc.pool.shared.replies``).
A call that fails (a Redis error, a socket error, the deadline, a reply that no script of ours
returns) raises ``CallFailed``, which names the script. The first call of a script after Redis
started also loads it (NOSCRIPT, two more round trips, once). A pooled connection found broken
is retried once, at once (a Redis that restarted fails the first use of every old connection);
a timeout never is, so the deadline holds.

The node lost (``node_lost``): a connection error, or a node that no longer takes writes
(``READONLY``: a primary demoted to a replica by a failover; ``MASTERDOWN``). Then every
pooled connection is dropped (``refresh``), the subscription is made again, and the next
connection is opened to the URL's address again: behind an address that follows the primary
(a Kubernetes Service, a DNS name, a proxy) that is the promoted one. A call refused with
``READONLY`` is sent once more at once, on a fresh connection, under the same deadline (the
node ran none of its writes). A timeout drops nothing: a slow call fails alone.

A URL redis-py cannot use (a port that is not a number or out of range, a malformed address:
what policy validation should have refused) does not stop the client from being made: it is
``unusable`` (the reason, logged once), and every call and subscription fails at once with
that reason, as if Redis could not be reached: the replica runs degraded until it is
restarted with a URL that can be used.

Pub/sub has a connection of its own, without a socket timeout (it waits for messages as
long as it likes); ``listen`` returns when a refresh drops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from extproc.config.policy import SharedPolicy
from extproc.pool.shared import replies
from extproc.pool.shared.scripts import ACQUIRE, RENEW, RETURN, Keys, encode_demand

__all__ = ["CallFailed", "PoolClient", "node_lost"]

_R = TypeVar("_R")
_NOWHERE = "/nonexistent/llm-extproc-unusable-redis-url"
# What a node that no longer takes writes answers (Redis 6 wraps a script's in ``ERR ...``).
_NOT_PRIMARY = ("READONLY", "MASTERDOWN")
# How long the listener waits for a message before it looks for a refresh.
_LISTEN_POLL_S = 0.25

log = logging.getLogger("extproc.shared")


class CallFailed(Exception):
    """Script ``call`` (``acquire``, ``return``, ``renew``) or the subscription (``events``)
    failed with ``cause``."""

    def __init__(self, call: str, cause: BaseException) -> None:
        super().__init__(f"{call}: {type(cause).__name__}: {cause}")
        self.call = call
        self.cause = cause
        # Past its deadline (ours, or the socket's): a slow call, not a lost node.
        self.timed_out = isinstance(cause, TimeoutError | RedisTimeoutError)


def node_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the connection's node is gone or no longer the primary (not a
    timeout: a slow call says nothing of the others)."""
    if isinstance(exc, TimeoutError):
        return False
    if isinstance(exc, RedisConnectionError | OSError | ReadOnlyError):
        return True
    return isinstance(exc, ResponseError) and any(w in str(exc) for w in _NOT_PRIMARY)


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
        self.unusable: ValueError | None = None
        self.refreshes = 0  # the pooled connections dropped for a lost node
        try:
            self._redis = aioredis.Redis.from_url(policy.redis, socket_timeout=t, **common)
            self._sub = aioredis.Redis.from_url(policy.redis, **common)
        except ValueError as e:  # redis-py's own check of the URL
            self.unusable = e
            log.error(
                "shared pool: pool.shared.redis %s cannot be used (%s): degraded on a local "
                "share until the sidecar is restarted with one that can be",
                policy.redis_display,
                e,
            )
            # Never used (every call and subscription fails first); were it, no server there.
            self._redis = self._sub = aioredis.Redis(unix_socket_path=_NOWHERE)
        self._acquire = self._redis.register_script(ACQUIRE)
        self._return = self._redis.register_script(RETURN)
        self._renew = self._redis.register_script(RENEW)

    async def acquire(
        self, ask: Mapping[int, int], ids: Sequence[str], *, limit: str
    ) -> replies.Acquired:
        """Ask for ``ask`` (per band) with one candidate id per waiter. ``limit``, in every
        call: ``scripts.encode_limit``."""
        raw = await self._call("acquire", self._acquire, limit, [encode_demand(ask)], ids)
        return self._decode("acquire", replies.acquired, raw, asked=len(ids))

    async def give_back(
        self, ids: Sequence[str], *, to: str, hold_ms: int, limit: str
    ) -> replies.Returned:
        """Give ``ids`` back, kept for replica ``to`` ('' anyone) for ``hold_ms``."""
        raw = await self._call("return", self._return, limit, ["-", to, hold_ms], ids)
        return self._decode("return", replies.returned, raw, sent=len(ids))

    async def write_demand(self, demand: Mapping[int, int], *, limit: str) -> None:
        """Write this replica's demand, giving nothing back (the reply is not read)."""
        await self._call("return", self._return, limit, [encode_demand(demand), "", 0], [])

    async def leave(self, ids: Sequence[str], *, limit: str) -> None:
        """Give ``ids`` back and leave the pool: demand, entry and leadership."""
        await self._call("return", self._return, limit, ["bye", "", 0], ids)

    async def renew(
        self,
        *,
        demand: Mapping[int, int],
        volunteer: bool,
        publish: int | None,
        term: int = 0,
        renew: Sequence[str],
        back: Sequence[str],
        claim: Sequence[str],
        known: Sequence[str] = (),
        fresh: bool = False,
        limit: str,
    ) -> replies.Renewed:
        """Renew ``renew``, give ``back`` back, claim ``claim`` while there is room, write
        ``demand``; ``volunteer``: lead if nobody does; ``publish``: the limit, if leading in
        ``term`` (the leader's as last heard: the script refuses it in another);
        ``known``: the replicas last seen live (expected to re-register in a new epoch);
        ``fresh``: the replica has never seen the pool outside a fence, so it cannot say who
        ran before a loss (its renewal cannot end a fence that only fresh replicas joined)."""
        fields = [
            encode_demand(demand),
            "1" if volunteer else "0",
            "" if publish is None else f"{publish}@{term}",
            len(renew),
            len(back),
            len(claim),
            f"{len(known)}:fresh" if fresh else len(known),
        ]
        ids = [*renew, *back, *claim, *known]
        raw = await self._call("renew", self._renew, limit, fields, ids)
        return self._decode("renew", replies.renewed, raw, renewing=len(renew), claiming=len(claim))

    async def listen(self, on_message: Callable[[bytes], None]) -> None:
        """One subscription to the events channel: every message to ``on_message`` until a
        refresh drops it (returns) or its connection fails (raises ``CallFailed``,
        "events"), which drops the pooled connections too when the node is lost."""
        if self.unusable is not None:
            raise CallFailed("events", self.unusable)
        pubsub = self._sub.pubsub()
        since = self.refreshes
        try:
            async with asyncio.timeout(self._policy.timeout_s):
                await pubsub.subscribe(self.keys.channel)
            while self.refreshes == since:
                msg = await pubsub.get_message(
                    ignore_subscribe_messages=True, timeout=_LISTEN_POLL_S
                )
                if msg is not None and msg.get("type") == "message":
                    on_message(msg["data"])  # what it raises is the listener's guard's
        except (RedisError, OSError, TimeoutError) as e:
            if node_lost(e):
                await self.refresh()
            raise CallFailed("events", e) from e
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def refresh(self) -> None:
        """Drop every pooled connection, and the subscription: the next ones are opened to
        the URL's address again."""
        self.refreshes += 1
        with contextlib.suppress(Exception):
            await self._redis.connection_pool.disconnect()

    async def aclose(self) -> None:
        for client in (self._redis, self._sub):
            with contextlib.suppress(Exception):
                await client.aclose()

    async def _call(
        self, call: str, script: Any, limit: str, fields: Sequence[Any], ids: Sequence[str]
    ) -> Any:
        if self.unusable is not None:
            raise CallFailed(call, self.unusable)
        policy = self._policy
        args = [self._replica, int(policy.lease_s * 1000), limit, self.keys.channel, *fields]
        try:
            async with asyncio.timeout(policy.timeout_s):
                try:
                    return await script(keys=self.keys.all, args=[*args, *ids])
                except ResponseError as e:
                    if not node_lost(e):
                        raise
                    await self.refresh()  # a demoted primary: once more, on a fresh one
                    return await script(keys=self.keys.all, args=[*args, *ids])
        except (RedisError, OSError, TimeoutError) as e:
            if node_lost(e):
                await self.refresh()
            raise CallFailed(call, e) from e

    @staticmethod
    def _decode(call: str, decode: Callable[..., _R], raw: object, **sent: int) -> _R:
        try:
            return decode(raw, **sent)
        except replies.ReplyError as e:
            raise CallFailed(call, e) from e
