"""What one replica knows of its leases and of the pool, kept without I/O and without a clock.

A ``Ledger`` holds

- the lease ids this replica holds, an ordered set: the newest goes back first; ids are
  ``<replica>:<n>``, ``n`` counting up from 1;
- the *doubtful* ids: those a failed call carried, which Redis may or may not hold; they go
  back with the next renewals, ``decide.RENEW_BATCH`` at most each. Bounded however long
  Redis stays away: one is forgotten a lease after the call that carried it (Redis drops it
  by then if it held it), and past ``MAX_DOUBTFUL`` the oldest go first. Forgetting one
  never admits more: a lease Redis still holds only counts as taken until it expires;
- the pool as the last reply or message told it: its limit (clamped to the replica's
  ``bounds``: an adaptive pool's ``min`` and ``max``, a static pool's own limit; the scripts
  clamp a published limit the same way), the leases held by everyone,
  the live replicas, the leader, the others' demand (replaced on every update, never changed
  in place, so a ``View`` made from them stays as it was), and our demand as our last call
  wrote it;
- its mode and clocks: degraded since when, until when Redis counts our leases, the grace
  after a rejoin;
- the pool's epoch as last heard, and whether its fence stands (``scripts``): a reply of
  another epoch than the one heard before says the pool's state in Redis was lost or reset,
  and the replica re-registers what it runs with a renewal at once; and the *roster*, the
  live replicas as the last renewal outside a fence saw them: until one did, the replica is
  *fresh* (it cannot know who ran before a loss, and says so in its renewals);
- the other policies (limits) live on its ``key_prefix``, as the last renewal said;
- what the shell is to log (``take_notices``): a reset heard, other policies appearing.

Its methods apply one decoded reply (``extproc.pool.shared.replies``) or one change of mode, with
the time passed in, and say what the caller must act on. ``known`` is what the decisions
read (``extproc.pool.shared.decide.View``): made again after each change (every method that
changes a field of it calls ``changed``), and the same object until then. The asyncio shell,
``extproc.pool.shared.leases.LeaseManager``, owns one (its ``ledger``) and does the calls; it
changes the ledger only through these methods (its calls in flight too: ``set_acquiring``,
``set_updating``), so the state a gauge or a test reads (``ledger.limit``, ``ledger.held``,
``ledger.mode``...) is written here alone.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from extproc.config.policy import SharedPolicy
from extproc.pool.shared import decide, replies
from extproc.pool.shared.decide import NO_GRACE, Mode, View
from extproc.pool.shared.scripts import encode_limit

__all__ = ["MAX_DOUBTFUL", "UNBOUNDED", "Ledger", "LocalPool", "Renewed"]

Demand = Mapping[int, int]

# Doubtful ids kept at most (the oldest forgotten first).
MAX_DOUBTFUL = 4 * decide.RENEW_BATCH
# The bounds of an adaptive pool whose policy gave none (a test's manager).
UNBOUNDED = (1, 2**31 - 1)


class LocalPool(Protocol):
    """The local side that the lease manager drives
    (``extproc.pool.shared.adapter.LeaseAdapter``)."""

    def shared_view(self) -> tuple[int, dict[int, int]]:
        """(requests holding a slot, {band: waiters that one more lease each would let in})."""
        ...

    def set_leases(self, held: int, pool_limit: int) -> None:
        """Admit at most ``held`` at once; shares are fractions of ``pool_limit``."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Renewed:
    """What a renewal's answer changed that the caller acts on."""

    raised: bool  # the limit went up, or the fence ended: look at the demand at once
    leader_changed: bool  # we gained or lost the leadership, or lead in a new term
    uncovered: int  # running requests that hold no lease (ids lost, claims refused)
    reset: bool = False  # the pool's state was lost or reset since the last reply


class Ledger:
    def __init__(
        self,
        policy: SharedPolicy,
        replica: str,
        *,
        limit: int,
        adaptive: bool,
        bounds: tuple[int, int] = UNBOUNDED,
    ) -> None:
        """``bounds``: an adaptive pool's (its policy's ``min`` and ``max``)."""
        self.policy = policy
        self.replica = replica
        self.static_limit = limit
        self.adaptive = adaptive
        self.adaptive_bounds = bounds
        # The pool as last heard: its limit, leases held by everyone, live replicas, leader.
        self.limit = limit
        self.count = 0
        self.replicas: list[str] = []
        self.leader = ""
        self.term = 0  # the leader's (``scripts``: a limit is published in its term only)
        self._others: Mapping[str, Demand] = {}  # the others' demand as last heard
        self._published: Demand = {}  # our demand as our last call wrote it
        self._ids: dict[str, None] = {}  # leases held (an ordered set)
        self._doubtful: dict[str, float] = {}  # id -> when it stops mattering
        self._seq = itertools.count(1)
        self.mode = Mode.SHARED
        self.connected = False  # a renewal succeeded since the start
        self.degraded_since: float | None = None
        self.degraded_transitions = 0
        self.last_error: str | None = None
        self._valid_until = -math.inf  # our leases live in Redis at least until then
        self._grace = NO_GRACE
        self.epoch: int | None = None  # the pool's epoch in Redis, as last heard
        self.fenced = False  # its fence stands: nobody acquires
        # The live replicas as the last renewal outside a fence saw them (None: none did yet,
        # the replica is *fresh*): who may run leases that a loss of the state left
        # uncounted, named in every renewal while a fence stands (``named``).
        self.roster: list[str] | None = None
        self.other_policies = 0  # other limits live on our key_prefix (a mistake)
        self._notices: list[str] = []  # for the shell to log, in order
        # The calls in flight, which the shell sets (``set_acquiring``, ``set_updating``).
        self._acquiring = False
        self._updating = False
        self._last_acquire = -math.inf
        self._known: View | None = None

    @property
    def held(self) -> int:
        return len(self._ids)

    @property
    def is_leader(self) -> bool:
        return self.connected and self.leader == self.replica

    @property
    def own_limit(self) -> int:
        """The limit each call passes, which the scripts use while no leader publishes one."""
        return self.static_limit if not self.adaptive else self.limit

    @property
    def fresh(self) -> bool:
        """No renewal has seen the pool outside a fence: this replica cannot say who ran
        before a loss of the state (``scripts``: its renewal cannot end a fence)."""
        return self.roster is None

    @property
    def named(self) -> list[str]:
        """The replicas a renewal names as live: those last seen, and those seen outside
        the last fence (a second loss within a fence must still expect them)."""
        if self.roster is None or self.roster is self.replicas:
            return self.replicas
        return sorted({*self.roster, *self.replicas})

    @property
    def bounds(self) -> tuple[int, int]:
        """What a limit read from Redis is clamped to: an adaptive pool's bounds, a static
        pool's own limit."""
        return self.adaptive_bounds if self.adaptive else (self.static_limit, self.static_limit)

    @property
    def limit_arg(self) -> str:
        """ARGV 3 of every call: the own limit and the bounds (``scripts.encode_limit``)."""
        return encode_limit(self.own_limit, *self.bounds)

    def clamped(self, limit: int) -> int:
        least, most = self.bounds
        return min(most, max(least, limit))

    # --- what the decisions read --------------------------------------------------------------

    def known(self) -> View:
        known = self._known
        if known is None:
            known = self._known = self._make_view()
        return known

    def changed(self) -> None:
        """A field of ``known`` changed: make it again when it is next read."""
        self._known = None

    def _make_view(self) -> View:
        return View(
            me=self.replica,
            mode=self.mode,
            limit=self.limit,
            count=self.count,
            replicas=self.replicas,
            connected=self.connected,
            expected_replicas=self.policy.replicas,
            valid_until=self._valid_until,
            others=self._others,
            published=self._published,
            grace=self._grace,
            acquiring=self._acquiring,
            updating=self._updating,
            last_acquire=self._last_acquire,
        )

    def set_acquiring(self, on: bool, now: float | None = None) -> None:
        """An ``ACQUIRE`` went out (``on``, at ``now``) or was answered."""
        self._acquiring = on
        if now is not None:
            self._last_acquire = now
        self.changed()

    def set_updating(self, on: bool) -> None:
        """A demand-only ``RETURN`` went out (``on``) or was answered."""
        self._updating = on
        self.changed()

    # --- ids -----------------------------------------------------------------------------------

    @property
    def ids(self) -> list[str]:
        """The lease ids held, the oldest first."""
        return list(self._ids)

    def set_adaptive(self, adaptive: bool, bounds: tuple[int, int]) -> None:
        """A reload: whether the pool is adaptive, and its bounds (no field of ``known``)."""
        self.adaptive, self.adaptive_bounds = adaptive, bounds

    def set_static_limit(self, limit: int) -> None:
        """The policy's limit changed (a reload); a static pool's limit is that."""
        self.static_limit = limit
        if not self.adaptive:
            self.limit = limit
            self.changed()

    def set_error(self, error: str) -> None:
        """A call failed with ``error`` (``last_error``)."""
        self.last_error = error

    def new_ids(self, n: int) -> list[str]:
        return [f"{self.replica}:{next(self._seq)}" for _ in range(n)]

    def pop_ids(self, n: int) -> list[str]:
        """Up to ``n`` ids no longer held here, the newest first."""
        out: list[str] = []
        while self._ids and len(out) < n:
            lease = next(reversed(self._ids))
            del self._ids[lease]
            out.append(lease)
        return out

    def doubt(self, ids: Sequence[str], now: float) -> None:
        """A call that failed at ``now`` carried ``ids``: Redis may hold them, for a lease
        (one doubtful already: as long as it was)."""
        until = now + self.policy.lease_s
        for lease in ids:
            self._doubtful.setdefault(lease, until)
        while len(self._doubtful) > MAX_DOUBTFUL:
            del self._doubtful[next(iter(self._doubtful))]

    def doubtful(self, now: float) -> list[str]:
        """The oldest doubtful ids that may still matter, ``decide.RENEW_BATCH`` at most, for
        a renewal to give back; they stay doubtful (as long as they were) until ``cleared``."""
        self._doubtful = {lease: t for lease, t in self._doubtful.items() if t > now}
        return list(itertools.islice(self._doubtful, decide.RENEW_BATCH))

    def cleared(self, ids: Sequence[str]) -> None:
        """A call that gave ``ids`` back succeeded: no longer doubtful."""
        for lease in ids:
            self._doubtful.pop(lease, None)

    def take_all(self) -> list[str]:
        """Every id held or doubtful, forgotten here (leaving the pool)."""
        ids = [*self._ids, *self._doubtful]
        self._ids.clear()
        self._doubtful = {}
        return ids

    # --- what the pool told us -----------------------------------------------------------------

    def _heard_pool(self, count: int, limit: int) -> None:
        """A reply's count and limit (every script answers both)."""
        self.count, self.limit = count, self.clamped(limit)
        self.changed()

    def _heard_epoch(self, epoch: int, fenced: bool) -> bool:
        """A reply's epoch and fence; True when the pool's state was lost or reset since the
        last reply (a first reply is no reset)."""
        reset = self.epoch is not None and epoch != self.epoch
        self.epoch, self.fenced = epoch, fenced
        if reset:
            self._notices.append(
                f"its state in Redis was lost or reset (a new epoch, {epoch}): re-registering "
                f"{self.held} lease(s); nobody acquires until the live replicas have, or for "
                "one lease"
            )
        return reset

    def take_notices(self) -> Sequence[str]:
        """What to log since the last call (nothing allocated when there is nothing)."""
        if not self._notices:
            return ()
        notices, self._notices = self._notices, []
        return notices

    def computed_limit(self, limit: int) -> None:
        """Degraded, the limit this replica's own adaptive controller found: its local share
        is of that one (in shared mode, the leader's published limit comes back in replies)."""
        self.limit = self.clamped(limit)
        self.changed()

    def heard_others(self, others: Mapping[str, Demand]) -> None:
        self._others = others
        self.changed()

    def heard_demand(self, replica: str, demand: Demand) -> None:
        """A ``demand`` message: ``replica`` waits for ``demand`` now (empty: nothing)."""
        others = dict(self._others)
        if demand:
            others[replica] = demand
        else:
            others.pop(replica, None)
        self.heard_others(others)

    def gave_back(self, ids: Sequence[str], to: str | None) -> None:
        """``ids`` (popped) go back; for anyone, they leave the pool's count at once."""
        if to is None:
            self.count -= len(ids)
            self.changed()

    def acquired(self, ids: Sequence[str], ask: Demand, reply: replies.Acquired) -> bool:
        """An ``ACQUIRE`` for ``ask`` with ``ids`` answered; True when the pool was reset
        (re-register now)."""
        for lease in ids[: reply.granted]:
            self._ids[lease] = None
        self._heard_pool(reply.count, reply.limit)
        self.heard_others(reply.others)
        self._published = decide.minus(ask, reply.granted)
        self.changed()
        return self._heard_epoch(reply.epoch, reply.fenced)

    def returned(self, reply: replies.Returned) -> bool:
        """A ``RETURN`` answered; True when the pool was reset (re-register now)."""
        self._heard_pool(reply.count, reply.limit)
        return self._heard_epoch(reply.epoch, reply.fenced)

    def wrote_demand(self, demand: Demand) -> None:
        self._published = demand
        self.changed()

    def renewed(
        self, sent: float, claim: Sequence[str], unmet: Demand, reply: replies.Renewed
    ) -> Renewed:
        """A ``RENEW`` sent at ``sent``, claiming ``claim`` and writing ``unmet``, answered."""
        for lease in reply.lost:
            self._ids.pop(lease, None)
        for lease in claim[: reply.claimed]:
            self._ids[lease] = None
        was_leader, was_term = self.is_leader, self.term
        raised = self.clamped(reply.limit) > self.limit
        raised |= self.fenced and not reply.fenced
        reset = self._heard_epoch(reply.epoch, reply.fenced)
        self._heard_pool(reply.count, reply.limit)
        self.leader, self.term = reply.leader, reply.term
        if reply.policies and reply.policies != self.other_policies:
            self._notices.append(
                f"{reply.policies} other policy(ies) with other limits than ours "
                f"({self.limit_arg}) use the key_prefix {self.policy.key_prefix!r} on this "
                "Redis: two deployments make one pool; give each its own key_prefix"
            )
        self.other_policies = reply.policies
        self.replicas = sorted(reply.live)
        if not reply.fenced:
            self.roster = self.replicas
        self.heard_others(reply.others)
        self._published = unmet
        self._valid_until = decide.holding_until(sent, self.policy.lease_s, self.policy.timeout_s)
        self.connected = True
        self.changed()
        return Renewed(
            raised=raised,
            leader_changed=self.is_leader != was_leader or (was_leader and self.term != was_term),
            uncovered=len(reply.lost) + len(claim) - reply.claimed,
            reset=reset,
        )

    # --- mode ----------------------------------------------------------------------------------

    def degrade(self, now: float) -> None:
        self.mode = Mode.DEGRADED
        self.degraded_since = now
        self.degraded_transitions += 1
        self.changed()

    def rejoin(self, now: float, share_before: int) -> float:
        """Shared again; returns how long we were degraded. ``share_before``: the local
        share as it was before the renewal that rejoined (``decide.rejoin``)."""
        since = self.degraded_since if self.degraded_since is not None else now
        self.mode = Mode.SHARED
        self.degraded_since = None
        self._grace = decide.rejoin(now, self.policy.lease_s, self.held, share_before)
        self.changed()
        return now - since

    def outage_plan(self, now: float) -> str:
        """What the replica runs on, degraded at ``now`` (for the log)."""
        if not self.connected:
            return (
                f"Redis never reached: a local share of {decide.share(self.known())} of the "
                f"limit {self.limit} until Redis answers"
            )
        return (
            f"holding {self.held} lease(s) for {max(0.0, self._valid_until - now):.1f} s, "
            "then admitting nobody new until Redis answers"
        )

    # --- views ---------------------------------------------------------------------------------

    def debug_view(self, now: float, running: int, demand: Demand) -> dict[str, Any]:
        """/debug/queues' entry, at ``now``, with the local pool's ``running`` and ``demand``."""
        known = self.known()
        phase = decide.phase(known, now)
        return {
            "state": str(self.mode),
            "phase": None if phase is None else str(phase),
            "redis": self.policy.redis_display,
            "key_prefix": self.policy.key_prefix,
            "lease_s": self.policy.lease_s,
            "replica": self.replica,
            "leader": self.leader or None,
            "is_leader": self.is_leader,
            "held": self.held,
            "running": running,
            "local_limit": decide.local_limit(known, now=now, held=self.held),
            "local_share": decide.share(known),
            "pool_limit": self.limit,
            "pool_held": self.count,
            "replicas": len(self.replicas),
            "demand": {str(b): n for b, n in sorted(demand.items())},
            "others_demand": {
                r: {str(b): n for b, n in sorted(d.items())} for r, d in self._others.items() if d
            },
            "degraded_for_s": None if self.degraded_since is None else now - self.degraded_since,
            "degraded_transitions": self.degraded_transitions,
            "rejoin_grace_s": max(0.0, self._grace.until - now),
            "epoch": self.epoch,
            "fenced": self.fenced,
            "other_policies": self.other_policies,
            "last_error": self.last_error,
        }
