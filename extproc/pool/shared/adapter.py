"""The local pool as the lease manager of a shared pool sees it.

With ``pool.shared``, several replicas draw the pool's slots from Redis as leases
(``extproc.pool.shared.LeaseManager``). The manager talks to the local pool through this adapter,
which implements its ``LocalPool`` protocol over the gate; the gate knows only that a
``LimitOwner`` holds its limit (``Gate.own_limit``), not that leases or Redis exist. The
control (``extproc.pool.control.wiring``) attaches it once, at the start, and a reload never changes
which Redis or ``key_prefix`` the pool's leases are of: a restart does.

- ``attach(manager, pool_limit)``: the local pool admits only on leases, none held yet.
- ``set_leases(held, pool_limit)``: admit at most ``held`` at once (possibly 0; a raised one
  admits at once), with ``max_share`` and caps of ``pool_limit``, the whole pool's.
- ``shared_view()``: (requests holding a slot, {band: waiters one more lease each would let
  in}), the manager's demand (``extproc.pool.core.demand.lease_demand``).
- The gate's hooks go to the manager: ``before_release`` -> ``on_release`` (a slot is about
  to be freed: the manager may lower the limit first and give the lease to a more urgent
  replica instead of reusing it here), ``changed`` -> ``on_change``.

Shares stay local: ``max_share`` (and ``max_concurrency``) are of the whole pool's limit, so
the core gets them as absolute caps, its own limit being only the leases held; ``min_share`` is
of the leases held. A tenant's ``max_share`` is of the whole pool's limit too
(``whole_limit``), whatever this replica holds; while the pool's published limit is 0 (no
backend yet), caps and tenants' shares stay of the last positive one. ``fail_fast`` is off
(the gate turns it off under an owner).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from extproc.config.policy import BucketPolicy, PoolPolicy
from extproc.pool.core.demand import lease_demand
from extproc.pool.core.values import slots
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

    def __init__(self, gate: Gate) -> None:
        self._gate = gate
        self._hooks: LeaseHooks | None = None
        self._held = 0  # leases held: the local pool's limit
        self._share_limit = 0  # the whole pool's limit, what max_share is of
        self._caps: dict[str, int] = {}  # each bucket's cap from the pool's limit

    def attach(self, hooks: LeaseHooks, pool_limit: int) -> None:
        """The pool admits only on leases, none held yet; caps are of ``pool_limit``."""
        self._hooks = hooks
        self._held = 0
        self._share_limit = pool_limit
        self._gate.own_limit(self)

    # --- LocalPool: what the lease manager calls ------------------------------------------

    def set_leases(self, held: int, pool_limit: int) -> None:
        """Admit at most ``held`` at once (a raised one admits at once); caps and the
        tenants' shares are of ``pool_limit``, of the last positive one while it is 0 (no
        backend yet: shares of what is coming, not of nothing)."""
        if self._hooks is None or self._gate.policy.pool is None:
            return
        if pool_limit > 0 and pool_limit != self._share_limit:
            self._share_limit = pool_limit
            self._gate.refresh_caps()
        self._held = held
        self._gate.set_pool_limit(self.pool_limit())

    def shared_view(self) -> tuple[int, dict[int, int]]:
        """(requests holding a slot of the pool, {band: waiters that one more lease each
        would let in}): a waiter held back by its bucket's cap or the overload cut is no
        demand for a lease."""
        pool = self._gate.pool_statistics().get(POOL)
        # Every release asks: the buckets' statistics only when someone waits.
        stats = self._gate.statistics() if pool is not None and pool.queued else {}
        return lease_demand(pool, stats, self._caps)

    # --- LimitOwner: what the gate calls ------------------------------------------------------

    def pool_limit(self) -> int:
        """The leases held."""
        return self._held

    def bucket_share(self, bucket: BucketPolicy) -> tuple[float, int | None]:
        """``max_share`` of the whole pool's limit, as an absolute cap (with the bucket's own
        ``max_concurrency``, when it has one)."""
        top = max(1, slots(bucket.max_share, self._share_limit))
        cap = min(top, bucket.max_concurrency) if bucket.max_concurrency else top
        self._caps[bucket.name] = cap
        return 1.0, cap

    def whole_limit(self) -> int:
        """The whole pool's limit (as last seen positive): what a tenant's share is of."""
        return self._share_limit

    def before_release(self) -> None:
        """A request ends: the manager's ``on_release``."""
        if self._hooks is not None:
            self._hooks.on_release()

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
        ledger = m.ledger
        return cls(
            state=ledger.mode,
            leases_held=ledger.held,
            pool_limit=ledger.limit,
            pool_held=ledger.count,
            replicas=len(ledger.replicas),
            leader=ledger.is_leader,
        )
