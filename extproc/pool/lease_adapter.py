"""The local pool as the lease manager of a shared pool sees it.

With ``pool.shared``, several replicas draw the pool's slots from Redis as leases
(``extproc.pool.shared.LeaseManager``). The manager talks to the local pool through this adapter,
which implements its ``LocalPool`` protocol over the gate; the gate knows only that a
``LimitOwner`` holds its limit (``Gate.own_limit``), not that leases or Redis exist.

- ``attach(manager, pool_limit)``: the local pool admits only on leases, none held yet
  (running requests carry on; the manager claims leases for them). ``detach()``: back to the
  policy's limit, from where it starts (the policy has no ``pool.shared`` any more).
- ``take_over(old, manager, pool_limit, on_retired)``: a reload built a new manager (another
  ``pool.shared``); this adapter becomes the gate's owner in ``old``'s place, and ``old``
  *retires* (below). The gate never goes back to the policy's limit in between.
- ``set_leases(held, pool_limit)``: admit at most ``held`` at once (possibly 0; a raised one
  admits at once), with ``max_share`` and caps of ``pool_limit``, the whole pool's.
- ``shared_view()``: (requests holding a slot, {band: waiters one more lease each would let
  in}), the manager's demand (``extproc.pool.demand.lease_demand``).
- The gate's hooks go to the manager: ``before_release`` -> ``on_release`` (a slot is about
  to be freed: the manager may lower the limit first and give the lease to a more urgent
  replica instead of reusing it here), ``changed`` -> ``on_change``.

Switching managers (a reload of any ``pool.shared`` key): *the old manager keeps the leases
of the requests running at the switch and gives one back as each request ends; the new one
admits only on leases of its own.* At the switch the old adapter's ``keep`` is the requests
then running (less what older retiring adapters keep); a release takes one off the oldest
``keep`` first. The retiring manager sees only its ``keep`` running and no demand, so it
gives every lease beyond it back by its rules for spares (at once to whoever waits, else
with its next renewal: ``extproc.pool.shared.decide`` rules 2 and 5) and acquires nothing;
it also stops leading (``extproc.pool.lease_switch``). Requests are not told apart: what
holds is the count. Which pool the new manager's leases are of (``pool_id``: the Redis URL
and the ``key_prefix``) decides the rest:

- **The same pool** (a new ``lease``, ``timeout`` or ``replicas``): the requests kept are
  covered there already, so the new manager's ``shared_view`` leaves them out (it never
  claims a lease for them: nothing is counted twice) and the gate's limit is its leases
  plus every ``keep``. At the switch that is ``running``: nothing new is admitted until the
  new manager holds a lease; a kept request that ends lowers the limit before the core hands
  its slot on. The pool stays within its limit throughout.
- **Another pool** (a new URL or prefix): the new manager counts the kept requests as its
  own, so it claims a lease for each in its pool (rule 5) and the gate's limit is its leases
  alone: nothing is admitted until every running request fits in them, while the old
  manager still holds theirs in the old pool. For one lease the new manager acquires no
  more leases than the old one held (``Ledger.moved_from``): the replicas not reloaded yet
  run on theirs in the old pool meanwhile. Once every replica has reloaded, the new pool
  counts every request at the backend.

A retiring adapter whose ``keep`` reaches 0 calls ``on_retired`` (the control closes its
manager, which leaves the pool).

Shares stay local: ``max_share`` (and ``max_concurrency``) are of the whole pool's limit, so
the core gets them as absolute caps, its own limit being only the leases held; ``min_share`` is
of the leases held. A tenant's ``max_share`` is of the whole pool's limit too
(``whole_limit``), whatever this replica holds; while the pool's published limit is 0 (no
backend yet), caps and tenants' shares stay of the last positive one. ``fail_fast`` is off
(the gate turns it off under an owner).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from extproc.config.policy import BucketPolicy, PoolPolicy
from extproc.pool.demand import lease_demand
from extproc.pool.gate import POOL, Gate
from extproc.pool.shared import LeaseManager, Mode
from extproc.pool.view import gauge

__all__ = ["LeaseAdapter", "LeaseHooks", "SharedSnapshot", "limit_bounds", "starting_limit"]


def starting_limit(pool: PoolPolicy) -> int:
    """Where the pool's limit starts on this replica: the adaptive limit's ``initial`` (until a
    leader publishes one), or the static limit."""
    return pool.adaptive.initial if pool.adaptive is not None else pool.max_concurrency


def limit_bounds(pool: PoolPolicy) -> tuple[int, int]:
    """What this replica accepts as the shared pool's limit, read from Redis: an adaptive
    pool's ``min`` (0 with ``queue_while_no_backend``: the leader publishes 0 while no backend
    exists) and ``max``, a static pool's ``max_concurrency`` alone."""
    if pool.adaptive is not None:
        a = pool.adaptive
        return (0 if a.queue_while_no_backend else a.min_limit), a.max_limit
    return pool.max_concurrency, pool.max_concurrency


class LeaseHooks(Protocol):
    """What the lease manager hears from the local pool. Called synchronously; must not
    block."""

    def on_release(self) -> None:
        """A slot of the pool is about to be freed (it may call ``set_leases`` first)."""
        ...

    def on_change(self) -> None:
        """Waiters or slots of the pool changed."""
        ...


class LeaseAdapter:
    """The ``LocalPool`` of ``extproc.pool.shared.LeaseManager``, and the gate's ``LimitOwner``."""

    def __init__(self, gate: Gate, pool_id: object = None) -> None:
        """``pool_id``: which pool its manager's leases are of (the Redis URL and the
        ``key_prefix``): equal ids, one pool."""
        self._gate = gate
        self.pool_id = pool_id
        self._hooks: LeaseHooks | None = None
        self._held = 0  # leases held: the local pool's limit
        self._share_limit = 0  # the whole pool's limit, what max_share is of
        self._caps: dict[str, int] = {}  # each bucket's cap from the pool's limit
        self._keep: int | None = None  # retiring: the running requests it still covers
        self._on_retired: Callable[[], None] = lambda: None
        self._retiring: list[LeaseAdapter] = []  # those this one took over from, oldest first

    def attach(self, hooks: LeaseHooks, pool_limit: int) -> None:
        """The pool admits only on leases, none held yet; caps are of ``pool_limit``."""
        self._hooks = hooks
        self._held = 0
        self._share_limit = pool_limit
        self._gate.own_limit(self)

    def take_over(
        self, old: LeaseAdapter, hooks: LeaseHooks, pool_limit: int, on_retired: Callable[[], None]
    ) -> None:
        """Own the gate's limit in ``old``'s place; ``old`` retires, keeping the requests
        running now that the adapters it retired before do not keep (module docstring).
        ``on_retired``: called once ``old`` keeps none; at once if none runs."""
        stats = self._gate.pool_statistics().get(POOL)
        running = stats.in_flight if stats is not None else 0
        self._retiring, old._retiring = [*old._retiring, old], []
        old._keep = max(0, running - sum(a._keep or 0 for a in self._retiring))
        old._on_retired = on_retired
        old_hooks = old._hooks
        self._hooks = hooks
        self._held = 0
        self._share_limit = pool_limit
        self._gate.own_limit(self)  # the limit: the requests kept, no more
        if old_hooks is not None:
            old_hooks.on_change()  # its spares: back to whoever waits (rule 2, or renewal)
        self._drop_retired()

    def detach(self) -> None:
        """Back to a pool of this replica alone, at the policy's limit; the adapters it took
        over from are forgotten (their managers are closed by the control)."""
        if self._hooks is None:
            return
        self._hooks = None
        self._caps.clear()
        self._retiring = []
        pool = self._gate.policy.pool
        self._gate.disown_limit(starting_limit(pool) if pool is not None else 0)

    @property
    def keep(self) -> int | None:
        """Retiring: the running requests it still covers; else None."""
        return self._keep

    @property
    def _kept(self) -> int:
        """The requests retiring adapters of this one's pool keep (another pool's: this one
        covers them too). Nothing retiring (the request path): no work."""
        if not self._retiring:
            return 0
        return sum(a._keep or 0 for a in self._retiring if a.pool_id == self.pool_id)

    def _drop_retired(self) -> None:
        done = [a for a in self._retiring if not a._keep]
        if done:
            self._retiring = [a for a in self._retiring if a._keep]
            for a in done:
                a._on_retired()

    # --- LocalPool: what the lease manager calls ------------------------------------------

    def set_leases(self, held: int, pool_limit: int) -> None:
        """Admit at most ``held`` at once (a raised one admits at once); caps and the
        tenants' shares are of ``pool_limit``, of the last positive one while it is 0 (no
        backend yet: shares of what is coming, not of nothing)."""
        if self._hooks is None or self._keep is not None or self._gate.policy.pool is None:
            return
        if pool_limit > 0 and pool_limit != self._share_limit:
            self._share_limit = pool_limit
            self._gate.refresh_caps()
        self._held = held
        self._gate.set_pool_limit(self.pool_limit())

    def shared_view(self) -> tuple[int, dict[int, int]]:
        """(requests holding a slot of the pool, {band: waiters that one more lease each
        would let in}): a waiter held back by its bucket's cap or the overload cut is no
        demand for a lease. Not counted: the requests that retiring adapters of this pool
        keep. Retiring: the requests it keeps, and no demand."""
        if self._keep is not None:
            return self._keep, {}
        pool = self._gate.pool_statistics().get(POOL)
        # Every release asks: the buckets' statistics only when someone waits.
        stats = self._gate.statistics() if pool is not None and pool.queued else {}
        view = lease_demand(pool, stats, self._caps)
        if not self._retiring:
            return view
        return max(0, view[0] - self._kept), view[1]

    # --- LimitOwner: what the gate calls ------------------------------------------------------

    def pool_limit(self) -> int:
        """The leases held, and the requests that retiring adapters of this pool keep."""
        return self._held + self._kept

    def bucket_share(self, bucket: BucketPolicy) -> tuple[float, int | None]:
        """``max_share`` of the whole pool's limit, as an absolute cap (with the bucket's own
        ``max_concurrency``, when it has one)."""
        top = max(1, math.floor(bucket.max_share * self._share_limit + 1e-9))
        cap = min(top, bucket.max_concurrency) if bucket.max_concurrency else top
        self._caps[bucket.name] = cap
        return 1.0, cap

    def whole_limit(self) -> int:
        """The whole pool's limit (as last seen positive): what a tenant's share is of."""
        return self._share_limit

    def before_release(self) -> None:
        """A request ends: one fewer for the oldest retiring adapter that keeps any (its
        manager gives that lease back; of this pool, the limit drops first, so the slot is
        not handed on); then, unless it was of this pool, the manager's ``on_release``."""
        if self._retiring and self._one_fewer_kept():
            return
        if self._hooks is not None:
            self._hooks.on_release()

    def _one_fewer_kept(self) -> bool:
        """Take one off the oldest ``keep``; True when it was of this pool."""
        old = next((a for a in self._retiring if a._keep), None)
        if old is None or old._keep is None:
            return False
        old._keep -= 1
        if old._hooks is not None:
            old._hooks.on_change()
        self._drop_retired()
        if old.pool_id != self.pool_id:
            return False
        self._gate.set_pool_limit(self.pool_limit())
        return True

    def changed(self) -> None:
        if self._hooks is not None:
            self._hooks.on_change()


_MODE_CODES: dict[str, int] = {Mode.SHARED: 0, Mode.DEGRADED: 1}


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedSnapshot:
    """The lease manager's gauges (its /debug/queues entry is ``LeaseManager.debug``)."""

    state: Mode = field(
        metadata=gauge(
            "shared_state",
            "Shared pool (pool.shared): 0 shared, 1 degraded (Redis unreachable).",
            codes=_MODE_CODES,
        )
    )
    leases_held: int = field(
        metadata=gauge("shared_leases_held", "Leases of the shared pool this replica holds.")
    )
    pool_limit: int = field(
        metadata=gauge(
            "shared_pool_limit", "The shared pool's limit, all replicas together (as last seen)."
        )
    )
    pool_held: int = field(
        metadata=gauge("shared_pool_held", "Leases held by all replicas together (as last seen).")
    )
    replicas: int = field(
        metadata=gauge("shared_replicas", "Live replicas of the shared pool (as last seen).")
    )
    leader: bool = field(
        metadata=gauge(
            "shared_leader", "1 when this replica computes the shared pool's adaptive limit."
        )
    )

    @classmethod
    def of(cls, m: LeaseManager) -> SharedSnapshot:
        return cls(
            state=m.mode,
            leases_held=m.held,
            pool_limit=m.limit,
            pool_held=m.count,
            replicas=len(m.replicas),
            leader=m.is_leader,
        )
