"""The lease manager: one replica's share of a pool that several replicas draw from.

Theory of operation
-------------------
Each replica keeps its local admission core (``extproc.admission``) as the authority for local
order: bands, shares, cost order, deadlines, eviction, disconnects. In shared mode the local
pool's limit is the number of leases this replica holds (``LocalPool.set_leases``), so
``running <= held`` locally, and ``sum(held) <= limit`` in Redis (``extproc.shared.scripts``):
the pool is exact across replicas. Waiters never leave their replica's queue; what moves
between replicas is leases.

Leases come and go like this:

- **Acquire** (one round trip, the only one on the admit path): when local waiters that a
  lease would let in ("demand", per band) outnumber the spare leases, one ``ACQUIRE`` asks for
  all of them; the script grants what is free after reserving for more urgent bands elsewhere.
  One acquire is in flight at a time; waiters that arrive meanwhile go in the next. A replica
  that still waits retries when told a lease was freed (pub/sub ``freed``), when its demand
  grows, and every ``POLL_S`` (the fallback for lost messages).
- **Release**: the local core hands the slot to a local waiter (no round trip) unless someone
  elsewhere is more urgent (``on_release``): a more urgent band waiting on another replica, or
  the same band there (then with the probability of their share of that band's waiters, so
  replicas in one band are served in proportion to their waiters; keeping every lease while a
  local queue lasts would freeze the split between replicas forever). Then the lease goes back
  at once (``RETURN``, one round trip off the request's path) *for* one replica of that band,
  drawn in proportion to its waiters: Redis keeps the slot for it for ``HANDOFF_S`` and
  publishes ``freed``, and its next ``ACQUIRE`` gets it. (Given back for anyone, the slot would
  go to whoever's ``ACQUIRE`` arrives first, and pub/sub delivers to the subscribers in the
  same order every time: one replica would win every race.) A release nobody waits for costs
  nothing: the lease stays as a spare, and the next renewal returns it if it is still unused;
  a spare someone else asks for (a ``demand`` message) goes back at once.
- **Renew** (one round trip per ``lease / 3`` for all of the replica's leases): ``RENEW``
  renews the ids, returns the spares, writes the replica's demand, keeps or takes the
  leadership, and answers the pool's count, limit, live replicas and everyone's demand.

Every call has a deadline of ``pool.shared.timeout``; the first call of a script after Redis
started also loads it (NOSCRIPT, two more round trips, once). The replica learns the others'
demand from each answer and from ``demand`` messages, so ``on_release`` decides without a
round trip; it tells the pool of its own when a call writes it (``ACQUIRE`` when waiters
arrive, ``RENEW``, and a ``RETURN`` without ids when a band's waiters are gone or halved,
so that others stop holding slots back for them).

The limit
---------
Static pool: the policy's ``max_concurrency``, passed by each replica with every call.
Adaptive pool: one leader, elected in ``RENEW`` with ``SET NX PX lease`` and renewed with it,
runs the adaptive controller on the pool's whole demand and publishes the limit (``{p}:limit``,
``PX 3 x lease``); every script reads it from Redis, so nobody acquires above a fresh limit.
If the leader dies, another replica takes over within the lease, starting from the limit in
force. When the limit falls below the leases held, replicas give leases back as requests end
instead of reusing them, and return their spares at once.

Redis unreachable
-----------------
A failed call (error or timeout) makes the replica **degraded** (logged once, counted in
``degraded_transitions``, shown in /debug/queues). Its leases are still counted in Redis until
they expire, which is no earlier than ``lease`` after the last renewal was sent: until then it
keeps running on exactly them (``holding``). After that it takes a **local share** of the last
known limit: ``limit // live`` plus one for the first ``limit % live`` replicas by id, so the
shares add up to the limit (a replica that never reached Redis takes ``limit //
pool.shared.replicas``, at least 1). Renewals go on every interval as probes.

Rejoin: a probe that succeeds renews the ids that survived, re-adds the expired ones and claims
leases for running requests that hold none, while the pool has room (ids beyond the running
requests go back in the same call); whatever does not fit is not covered, and the local limit
is the leases held, so the replica admits nobody until its running requests fit in them. For
one lease after rejoining, it acquires no more than its local share (as computed from the
replicas seen before the outage: a restarted Redis knows only those that rejoined already):
replicas still degraded run theirs without leases, and taking their part would overshoot.

Slack: requests at the backend exceed the limit only (1) when a replica's running requests are
above its local share at the moment its leases expire (uneven holdings; at most
``sum(max(0, running - share))``, draining as those requests end), (2) in a partition longer
than the lease, where some replicas reach Redis and others do not (at most the unreachable
replicas' shares), (3) when the live count a degraded replica last saw was too low. Under
even load and an outage of the whole Redis, (1) is zero.

Not shared: ``min_share`` is a fraction of the leases a replica holds, ``max_share`` and caps of
the pool's limit; ``max_tokens_in_flight`` bounds each replica's own requests; ``fail_fast``
is off in shared mode (a local release rate says nothing about the pool's).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import random
import secrets
import socket
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from extproc.config.policy import SharedPolicy
from extproc.shared.scripts import ACQUIRE, RENEW, RETURN, Keys, decode_demand, encode_demand

__all__ = [
    "POLL_S",
    "LeaseManager",
    "LocalPool",
    "Mode",
    "local_share",
    "recipient",
    "return_decision",
]

log = logging.getLogger("extproc.shared")

# How often the manager looks at its clocks (renewals, phases, polling).
TICK_S = 0.05
# A replica with unmet demand asks again at least this often (lost 'freed' messages).
POLL_S = 0.25
# A lease given back for one replica waits this long for it, then is free for anyone.
HANDOFF_S = 3 * POLL_S
# The leases' expiry as this replica sees it, a little early (clock rates differ).
_EXPIRY_MARGIN = 0.98


class Mode(StrEnum):
    SHARED = "shared"
    DEGRADED = "degraded"


class LocalPool(Protocol):
    """The local side (``extproc.admission.gate.Gate``)."""

    def shared_view(self) -> tuple[int, dict[int, int]]:
        """(requests holding a slot, {band: waiters that one more lease each would let in})."""
        ...

    def set_leases(self, held: int, pool_limit: int) -> None:
        """Admit at most ``held`` at once; shares are fractions of ``pool_limit``."""
        ...


def local_share(limit: int, replicas: Sequence[str], me: str) -> int:
    """This replica's part of ``limit`` when Redis is gone: the live replicas split it
    evenly, the remainder going to the first ones by id, so the parts add up to ``limit``."""
    everyone = sorted(set(replicas) | {me})
    base, extra = divmod(max(0, limit), len(everyone))
    return base + (1 if everyone.index(me) < extra else 0)


def return_decision(mine: dict[int, int], theirs: dict[int, int], u: float) -> bool:
    """On a local release: give the lease back (True) or keep it for a local waiter (False).

    ``mine``, ``theirs``: waiters per band here and elsewhere; ``u`` uniform in [0, 1). Back
    when the others' most urgent band is more urgent than ours, or nobody waits here; in the
    same band, back with the probability of their part of that band's waiters."""
    theirs_band = min((b for b, n in theirs.items() if n > 0), default=None)
    if theirs_band is None:
        return False
    mine_band = min((b for b, n in mine.items() if n > 0), default=None)
    if mine_band is None or theirs_band < mine_band:
        return True
    if theirs_band > mine_band:
        return False
    m, o = mine[mine_band], theirs[theirs_band]
    return u < o / (m + o)


def recipient(others: dict[str, dict[int, int]], u: float) -> str | None:
    """Who a lease given back is for: a replica waiting in the most urgent band of the
    others, drawn in proportion to its waiters there (``u`` uniform in [0, 1))."""
    band = min((b for d in others.values() for b, n in d.items() if n > 0), default=None)
    if band is None:
        return None
    weights = sorted((r, d[band]) for r, d in others.items() if d.get(band, 0) > 0)
    point = u * sum(n for _, n in weights)
    for replica, n in weights:
        point -= n
        if point < 0:
            return replica
    return weights[-1][0]


def _minus(demand: dict[int, int], n: int) -> dict[int, int]:
    """``demand`` less ``n`` waiters, taken from the most urgent bands (spare leases serve
    those first)."""
    out: dict[int, int] = {}
    for band in sorted(demand):
        take = min(n, demand[band])
        n -= take
        if demand[band] - take > 0:
            out[band] = demand[band] - take
    return out


def _cap(demand: dict[int, int], n: int) -> dict[int, int]:
    """The most urgent ``n`` waiters of ``demand``."""
    out: dict[int, int] = {}
    for band in sorted(demand):
        if n <= 0:
            break
        out[band] = min(n, demand[band])
        n -= out[band]
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Unreachable(Exception):
    """A Redis call failed; the manager is degraded already."""


class LeaseManager:
    def __init__(
        self,
        pool: LocalPool,
        policy: SharedPolicy,
        *,
        limit: int,
        adaptive: bool = False,
        replica: str | None = None,
        rand: Callable[[], float] = random.random,
        on_degraded: Callable[[], None] | None = None,
        on_error: Callable[[str], None] | None = None,
        on_leader: Callable[[bool], None] | None = None,
    ) -> None:
        """``limit``: the policy's (a static pool) or the one to fall back to (adaptive: the
        leader's limit is used while one publishes). ``adaptive``: this replica would lead.
        Made on the event loop it runs on."""
        self._loop = asyncio.get_running_loop()
        self.policy = policy
        self.replica = replica or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.keys = Keys.for_prefix(policy.key_prefix)
        self._pool = pool
        self._rand = rand
        self._on_degraded = on_degraded
        self._on_error = on_error
        self._on_leader = on_leader
        self.static_limit = limit
        self.adaptive = adaptive
        # The pool as last seen: its limit, leases held by everyone, live replicas, leader.
        self.limit = limit
        self.count = 0
        self.replicas: list[str] = []
        self.leader = ""
        self._others: dict[str, dict[int, int]] = {}
        self._ids: dict[str, None] = {}  # leases held (an ordered set)
        self._doubtful: list[str] = []  # ids of failed calls: maybe held; given back next time
        self._seq = itertools.count(1)
        self._published = ""  # our demand as our last call wrote it
        self._leader_limit: int | None = None
        self.mode = Mode.SHARED
        self.connected = False  # a renewal succeeded since the start
        self._valid_until = -math.inf  # our leases live in Redis at least until then
        self._grace_until = -math.inf
        self._grace_cap = 0
        self._applied: tuple[int, int] | None = None
        self.degraded_since: float | None = None
        self.degraded_transitions = 0
        self.last_error: str | None = None
        self._acquiring = False
        self._rewake = False  # a lease was freed while we were acquiring: ask again after
        self._renewing = False
        self._updating = False
        self._last_acquire = -math.inf
        self._next_renew = 0.0
        self._pump_handle: asyncio.Handle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._runner: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None
        self._closed = False
        t = policy.timeout_s
        common: dict[str, Any] = {
            "socket_connect_timeout": t,
            # Once, at once, on a broken connection only: a pooled connection to a Redis that
            # restarted fails on first use. Never on a timeout; the call's deadline holds.
            "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            "retry_on_timeout": False,
            "client_name": f"llm-extproc:{self.replica}",
        }
        self._redis = aioredis.Redis.from_url(policy.redis, socket_timeout=t, **common)
        # Pub/sub waits for messages as long as it likes; its reads have no socket timeout.
        self._sub = aioredis.Redis.from_url(policy.redis, **common)
        self._acquire_script = self._redis.register_script(ACQUIRE)
        self._return_script = self._redis.register_script(RETURN)
        self._renew_script = self._redis.register_script(RENEW)

    # --- life --------------------------------------------------------------------------------

    @property
    def interval_s(self) -> float:
        """Between renewals (and probes while degraded)."""
        return self.policy.lease_s / 3

    @property
    def held(self) -> int:
        return len(self._ids)

    @property
    def is_leader(self) -> bool:
        return self.connected and self.leader == self.replica

    def start(self) -> None:
        self._apply()
        self._runner = self._loop.create_task(self._run(), name="shared-pool")
        self._listener = self._loop.create_task(self._listen(), name="shared-pool-events")

    async def close(self, give_back: bool = True) -> None:
        """Stop; give every lease back and leave the pool (when Redis answers). Without
        ``give_back`` the leases are left to expire, as when the process dies."""
        self._closed = True
        if self._pump_handle is not None:
            self._pump_handle.cancel()
        for task in (self._runner, self._listener):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.policy.timeout_s)
        ids = [*self._ids, *self._doubtful]
        self._ids.clear()
        self._doubtful = []
        if give_back:
            with contextlib.suppress(_Unreachable):
                await self._call("return", self._return_script, ["bye", "", 0], ids)
        for client in (self._redis, self._sub):
            with contextlib.suppress(Exception):
                await client.aclose()

    def set_static_limit(self, limit: int) -> None:
        """The policy's limit changed (a reload)."""
        self.static_limit = limit
        if not self.adaptive:
            self.limit = limit
        self._kick()

    def publish_limit(self, limit: int) -> None:
        """The leader's adaptive controller found a limit: published with the next renewal,
        which goes out now."""
        self._leader_limit = limit
        self._kick()

    # --- what the gate tells us (synchronous, no I/O) -----------------------------------------

    def on_change(self) -> None:
        """Waiters or slots of the local pool changed: look again soon (once per loop turn)."""
        if self._pump_handle is None and not self._closed:
            self._pump_handle = asyncio.get_running_loop().call_soon(self._pump)

    def on_release(self) -> None:
        """A local slot is about to be freed: keep its lease for a local waiter, or give it
        back now because someone elsewhere is more urgent (or the pool is above its limit)."""
        if self.mode is not Mode.SHARED or not self._ids:
            return
        running, demand = self._pool.shared_view()
        if running < self.held:
            return  # a spare already: this one becomes another, handled by _pump
        if self.count > self.limit:
            self._give_back(1, None)
        elif return_decision(demand, self._theirs(), self._rand()):
            self._give_back(1, recipient(self._others, self._rand()))

    # --- views -------------------------------------------------------------------------------

    def pool_demand(self) -> tuple[int, int]:
        """(leases held in the pool, waiters of every replica) for the adaptive limit."""
        _, mine = self._pool.shared_view()
        waiting = sum(mine.values()) + sum(sum(d.values()) for d in self._others.values())
        return self.count, waiting

    def local_share(self) -> int:
        if not self.connected:
            return max(1, self.limit // self.policy.replicas)
        return local_share(self.limit, self.replicas, self.replica)

    def local_limit(self) -> int:
        """What the local pool may run now."""
        if self.mode is Mode.SHARED or self._loop.time() < self._valid_until:
            return self.held
        return self.local_share()

    def debug(self) -> dict[str, Any]:
        running, demand = self._pool.shared_view()
        now = self._loop.time()
        return {
            "state": str(self.mode),
            "phase": (
                None
                if self.mode is Mode.SHARED
                else "holding"
                if now < self._valid_until
                else "local_share"
            ),
            "redis": self.policy.redis_display,
            "key_prefix": self.policy.key_prefix,
            "lease_s": self.policy.lease_s,
            "replica": self.replica,
            "leader": self.leader or None,
            "is_leader": self.is_leader,
            "held": self.held,
            "running": running,
            "local_limit": self.local_limit(),
            "local_share": self.local_share(),
            "pool_limit": self.limit,
            "pool_held": self.count,
            "replicas": len(self.replicas),
            "demand": {str(b): n for b, n in sorted(demand.items())},
            "others_demand": {
                r: {str(b): n for b, n in sorted(d.items())} for r, d in self._others.items() if d
            },
            "degraded_for_s": None if self.degraded_since is None else now - self.degraded_since,
            "degraded_transitions": self.degraded_transitions,
            "rejoin_grace_s": max(0.0, self._grace_until - now),
            "last_error": self.last_error,
        }

    def __repr__(self) -> str:
        return f"<LeaseManager {self.replica} {self.mode} {self.held}/{self.limit}>"

    # --- internals: deciding -----------------------------------------------------------------

    def _theirs(self) -> dict[int, int]:
        merged: dict[int, int] = {}
        for d in self._others.values():
            for band, n in d.items():
                merged[band] = merged.get(band, 0) + n
        return merged

    def _apply(self) -> None:
        """Give the local pool its limit when it changed."""
        wanted = (self.local_limit(), self.limit)
        if wanted != self._applied:
            self._applied = wanted
            self._pool.set_leases(*wanted)

    def _kick(self) -> None:
        self._next_renew = 0.0

    def _pump(self, force: bool = False) -> None:
        """Acquire for unmet demand, return spares others want, correct stale demand."""
        self._pump_handle = None
        if self._closed or self.mode is not Mode.SHARED:
            return
        if force and self._acquiring:
            self._rewake = True
        running, demand = self._pool.shared_view()
        spare = max(0, self.held - running)
        unmet = _minus(demand, spare)
        total = sum(unmet.values())
        if not demand and spare:
            wanted = max(self.count - self.limit, sum(self._theirs().values()))
            if wanted > 0:
                over = self.count > self.limit
                self._give_back(min(spare, wanted), None if over else recipient(self._others, 0.5))
                return
        now = self._loop.time()
        if total and not self._acquiring:
            if now < self._grace_until:
                unmet = _cap(unmet, self._grace_cap - self.held)
                total = sum(unmet.values())
            if total and (force or self._understated(unmet) or now - self._last_acquire >= POLL_S):
                self._spawn(self._acquire(unmet))
                return
        if not self._acquiring and not self._updating and self._overstated(unmet):
            self._spawn(self._update_demand())

    def _understated(self, unmet: dict[int, int]) -> bool:
        """Waiters the pool has not heard of: ask (the acquire tells the others too)."""
        published = decode_demand(self._published)
        return any(n > published.get(band, 0) for band, n in unmet.items())

    def _overstated(self, unmet: dict[int, int]) -> bool:
        """Our demand in Redis makes others hold back for waiters we no longer have: a band
        gone, or less than half of it left."""
        published = decode_demand(self._published)
        for band, n in published.items():
            now = unmet.get(band, 0)
            if now == 0 or 2 * now <= n:
                return True
        return False

    def _give_back(self, n: int, to: str | None) -> None:
        """Give ``n`` leases back now, for replica ``to`` (None: for anyone)."""
        ids = [self._ids_pop() for _ in range(min(n, self.held))]
        if not ids:
            return
        if to is None:
            self.count -= len(ids)
        self._apply()
        self._spawn(self._return(ids, to or ""))

    def _ids_pop(self) -> str:
        lease = next(reversed(self._ids))
        del self._ids[lease]
        return lease

    def _new_ids(self, n: int) -> list[str]:
        return [f"{self.replica}:{next(self._seq)}" for _ in range(n)]

    def _spawn(self, coro: Any) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _set_others(self, flat: Sequence[Any]) -> None:
        others: dict[str, dict[int, int]] = {}
        for i in range(0, len(flat) - 1, 2):
            d = decode_demand(flat[i + 1])
            if d:
                others[_text(flat[i])] = d
        self._others = others

    # --- internals: calls --------------------------------------------------------------------

    async def _call(self, name: str, script: Any, fields: Sequence[Any], ids: Sequence[str]) -> Any:
        """One script under the timeout; a failure makes us degraded and raises."""
        args = [
            self.replica,
            int(self.policy.lease_s * 1000),
            self.static_limit if not self.adaptive else self.limit,
            self.keys.channel,
            *fields,
            *ids,
        ]
        try:
            async with asyncio.timeout(self.policy.timeout_s):
                return await script(keys=self.keys.all, args=args)
        except (RedisError, OSError, TimeoutError) as e:
            self._failed(name, e)
            raise _Unreachable from e

    async def _acquire(self, ask: dict[int, int]) -> None:
        self._acquiring = True
        self._last_acquire = self._loop.time()
        ids = self._new_ids(sum(ask.values()))
        try:
            granted, count, limit, flat = await self._call(
                "acquire", self._acquire_script, [encode_demand(ask)], ids
            )
        except _Unreachable:
            self._doubtful.extend(ids)
            return
        finally:
            self._acquiring = False
        granted = int(granted)
        for lease in ids[:granted]:
            self._ids[lease] = None
        self.count, self.limit = int(count), int(limit)
        self._set_others(flat)
        left = _minus(ask, granted)
        self._published = encode_demand(left)
        self._apply()
        rewake, self._rewake = self._rewake, False
        self._pump(force=rewake)

    async def _return(self, ids: list[str], to: str) -> None:
        hold_ms = int(HANDOFF_S * 1000)
        try:
            _, count, limit = await self._call(
                "return", self._return_script, ["-", to, hold_ms], ids
            )
        except _Unreachable:
            self._doubtful.extend(ids)
            return
        self.count, self.limit = int(count), int(limit)

    async def _update_demand(self) -> None:
        self._updating = True
        try:
            running, demand = self._pool.shared_view()
            text = encode_demand(_minus(demand, max(0, self.held - running)))
            await self._call("return", self._return_script, [text, "", 0], [])
            self._published = text
        except _Unreachable:
            pass
        finally:
            self._updating = False

    async def _renew(self) -> None:
        self._renewing = True
        sent = self._loop.time()
        running, demand = self._pool.shared_view()
        back: list[str] = []
        # Spares nobody here used since go back; rejoining, every lease not covering a running
        # request does (re-adding them would take what another replica's running ones need).
        if (not demand or self.mode is Mode.DEGRADED) and self.held > running:
            back = [self._ids_pop() for _ in range(self.held - running)]
            self._apply()
        claim = self._new_ids(max(0, running - self.held))
        renew = list(self._ids)
        doubtful, self._doubtful = self._doubtful, []
        unmet = encode_demand(_minus(demand, max(0, self.held - running)))
        volunteer = "1" if self.adaptive else "0"
        publish = "" if self._leader_limit is None else str(self._leader_limit)
        try:
            reply = await self._call(
                "renew",
                self._renew_script,
                [unmet, volunteer, publish, len(renew), len(back) + len(doubtful), len(claim)],
                [*renew, *back, *doubtful, *claim],
            )
        except _Unreachable:
            self._doubtful.extend([*back, *doubtful, *claim])
            return
        finally:
            self._renewing = False
        count, limit, leader, lost, claimed, live, flat = reply
        share = self.local_share()  # from the replicas seen before: a restarted Redis knows
        # only those that rejoined already
        for lease in lost:
            self._ids.pop(_text(lease), None)
        for lease in claim[: int(claimed)]:
            self._ids[lease] = None
        was_leader, raised = self.is_leader, int(limit) > self.limit
        self.count, self.limit, self.leader = int(count), int(limit), _text(leader)
        self.replicas = sorted(_text(r) for r in live)
        self._set_others(flat)
        self._published = unmet
        self._valid_until = sent + self.policy.lease_s * _EXPIRY_MARGIN
        self.connected = True
        if self.mode is Mode.DEGRADED:
            self._rejoin(running, len(lost) + len(claim) - int(claimed), share)
        self._apply()
        if self.is_leader != was_leader and self._on_leader is not None:
            self._on_leader(self.is_leader)
        self._pump(force=raised)

    # --- internals: degraded mode ------------------------------------------------------------

    def _failed(self, call: str, exc: BaseException) -> None:
        self.last_error = f"{call}: {type(exc).__name__}: {exc}"
        if self._on_error is not None:
            self._on_error(call)
        if self.mode is Mode.DEGRADED or self._closed:
            return
        self.mode = Mode.DEGRADED
        now = self._loop.time()
        self.degraded_since = now
        self.degraded_transitions += 1
        if self._on_degraded is not None:
            self._on_degraded()
        log.warning(
            "shared pool degraded, Redis unreachable (%s): holding %d lease(s) for %.1f s, "
            "then a local share of %d of the limit %d (%d live replicas)",
            self.last_error,
            self.held,
            max(0.0, self._valid_until - now),
            self.local_share(),
            self.limit,
            max(1, len(self.replicas)),
        )
        self._apply()

    def _rejoin(self, running: int, uncovered: int, share: int) -> None:
        now = self._loop.time()
        since = self.degraded_since if self.degraded_since is not None else now
        self.mode = Mode.SHARED
        self.degraded_since = None
        self._grace_until = now + self.policy.lease_s
        self._grace_cap = max(self.held, share)
        log.warning(
            "shared pool rejoined after %.1f s: %d lease(s) for %d running request(s)%s",
            now - since,
            self.held,
            running,
            f", {uncovered} not covered (no new admissions until they end)" if uncovered else "",
        )

    # --- internals: tasks --------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            now = self._loop.time()
            if not self._renewing and now >= self._next_renew:
                self._next_renew = now + self.interval_s
                self._spawn(self._renew())
            if self.mode is Mode.DEGRADED:
                self._apply()  # holding -> local share when our leases expire
            elif not self._acquiring and now - self._last_acquire >= POLL_S:
                self._pump()
            await asyncio.sleep(TICK_S)

    async def _listen(self) -> None:
        """``freed`` and ``demand`` messages; reconnects after errors, every interval."""
        while True:
            pubsub = self._sub.pubsub()
            try:
                async with asyncio.timeout(self.policy.timeout_s):
                    await pubsub.subscribe(self.keys.channel)
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is not None and msg.get("type") == "message":
                        self._on_message(_text(msg["data"]))
            except (RedisError, OSError, TimeoutError):
                pass  # polling carries on; renewals tell whether Redis is back
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
            await asyncio.sleep(self.interval_s)

    def _on_message(self, text: str) -> None:
        kind, _, rest = text.partition(" ")
        replica, _, arg = rest.partition(" ")
        if replica == self.replica or self.mode is not Mode.SHARED:
            return
        if kind == "freed":
            _, _, to = arg.partition(" ")
            if to in ("", self.replica):  # one handed to someone else is not ours to race for
                self._pump(force=True)
        elif kind == "demand":
            d = decode_demand(arg)
            if d:
                self._others[replica] = d
            else:
                self._others.pop(replica, None)
            self.on_change()
