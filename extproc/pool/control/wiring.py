"""The shared pool's three controllers, wired to the gate on the sidecar's event loop.

- The adaptive limit (``pool.adaptive``): ``extproc.pool.control.poller.Poller`` scrapes the
  backend's metrics (``backend.metrics``) every ``interval``, runs
  ``extproc.pool.control.adaptive.AdaptiveLimit`` on them and gives the limit it finds to
  ``Gate.set_pool_limit``, on the demand ``extproc.pool.core.demand.limit_demand`` counts and with
  the latency objectives while ``objectives_apply``; the band cut it finds for the least urgent
  band (``extproc.pool.control.bandcut``: cut before the limit) goes to
  ``Gate.set_cut(..., band=True)``.
- Shared leases (``pool.shared``): ``extproc.pool.shared.LeaseManager``, through
  ``extproc.pool.shared.adapter.LeaseAdapter``, sets the gate's limit to the leases this replica
  holds. With an adaptive pool, only the replica that holds the leadership (elected in Redis)
  runs the poller, on the whole pool's demand (``demand.shared_limit_demand``), and publishes
  the limit through the manager; the others read it from Redis. A replica that gains the
  leadership starts its poller from the limit in force; one that loses it stops its own. A
  degraded replica (Redis unreachable, or a URL that cannot be used) hears no leader, so it
  runs a poller of its own, on its demand standing for each replica's, and its local share is
  of the limit that poller finds: the limit keeps following the backend; shared again, it
  stops that poller unless it leads. A limit read from Redis is clamped to the policy's
  (``limit_bounds``).
- Staged recovery (``pool.overload``, ``extproc.pool.control.recovery``) and the tenant-header
  watch (``extproc.pool.control.headers``): one tick a second.

Each transition is one log line (``extproc.control``). The gauges (``gauges``, read by the
metrics collector at scrape time) and the pool's entry of /debug/queues (``debug``) render the
controllers' snapshots (``extproc.pool.view``): the pool's ``PoolStats``, the monitor's, the
adaptive limit's and the signals of its last round, the lease manager's.

A policy (re)load is two steps. ``prepare`` checks everything the policy needs that could
fail (``pool.shared`` as it was: ``extproc.pool.control.reload``; the adaptive limit and its
scraper, the overload monitor) and changes nothing: what raises there refuses the policy.
``apply`` then only switches, and cannot fail. A reload rebuilds a controller only when its own
settings changed, and the adaptive limit carries on from the limit in force. The lease manager
is made by the first ``apply`` (the start) and closed by ``close``; a reload keeps it, and
applies a new limit and adaptive bounds to it in place.

Every task started here has an owner: the overload tick and the poller's own task are awaited
by ``stop``, a poller stopped on a reload or a change of leader is awaited there too, and the
lease manager is closed by ``close``. The loops run under guards (``extproc.loops``),
counted in ``llm_extproc_loop_errors_total{loop}``.

What the controllers count goes to ``Counters``, the counters and gauges they are given
(``extproc.ops.metrics.Metrics`` is one; the pool imports nothing of ops).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from extproc.backend.scrape import Scraper, Signals
from extproc.config.policy import AdaptivePolicy, BackendPolicy, Policy, PolicyError, PoolPolicy
from extproc.loops import Guard
from extproc.pool.control.adaptive import AdaptiveLimit
from extproc.pool.control.bandcut import BandLoad, band_load
from extproc.pool.control.headers import Levels, TenantHeaders
from extproc.pool.control.overload import Overload, OverloadMonitor
from extproc.pool.control.poller import BackendSnapshot, Poller
from extproc.pool.control.recovery import Recovery
from extproc.pool.control.reload import shared_change
from extproc.pool.core import demand
from extproc.pool.gate import POOL, Gate
from extproc.pool.shared import LeaseManager, Mode
from extproc.pool.shared.adapter import LeaseAdapter, SharedSnapshot, limit_bounds, starting_limit
from extproc.pool.view import render_debug, render_gauges

__all__ = ["OVERLOAD_TICK_S", "Counters", "PoolControl", "Prepared"]

log = logging.getLogger("extproc.control")

OVERLOAD_TICK_S = 1.0


class _Count(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class _Counts(Protocol):  # a family of counts by their label
    def labels(self, *values: str) -> _Count: ...


class Counters(Protocol):
    """What the controllers count, each one a Prometheus series of the same name."""

    @property
    def loop_errors(self) -> _Counts: ...  # by loop
    @property
    def shared_redis_errors(self) -> _Counts: ...  # by call
    @property
    def shared_degraded(self) -> _Count: ...
    @property
    def backend_scrape_errors(self) -> _Count: ...
    @property
    def adaptive_changes(self) -> _Counts: ...  # by reason
    @property
    def overload_transitions(self) -> _Counts: ...  # by state
    @property
    def tenant_header_missing(self) -> Levels: ...  # by bucket


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepared:
    """A policy that ``PoolControl.prepare`` checked."""

    policy: Policy


class PoolControl:
    def __init__(self, gate: Gate, metrics: Counters) -> None:
        self._gate = gate
        self._metrics = metrics
        self._policy: Policy | None = None
        self._poller: Poller | None = None
        self._poller_key: tuple[AdaptivePolicy, BackendPolicy, int] | None = None  # its settings
        self._recovery = Recovery(gate, lambda s: metrics.overload_transitions.labels(s).inc())
        self._signals: Signals | None = None
        self._task: asyncio.Task[None] | None = None
        self._started = False
        self._shared: LeaseManager | None = None  # pool.shared's, from the start to close
        self._stopping: set[asyncio.Task[None]] = set()  # pollers being stopped
        self._headers = TenantHeaders(metrics.tenant_header_missing, gate.tenants_seen)

    # --- life --------------------------------------------------------------------------------

    def prepare(self, policy: Policy) -> Prepared:
        """Check what ``policy`` needs (module docstring); raises, changing nothing, when it
        cannot be used: ``PolicyError`` for a reload that changes ``pool.shared``."""
        pool = policy.pool
        if self._policy is not None and (why := shared_change(self._policy.pool, pool)):
            raise PolicyError(why)
        if pool is not None and pool.adaptive is not None:
            AdaptiveLimit(pool.adaptive)
            Scraper.from_policy(policy.backend, pool.adaptive)
        if pool is not None and pool.overload.enabled:
            OverloadMonitor(pool.overload)
        return Prepared(policy=policy)

    def discard(self, prepared: Prepared) -> None:
        """The policy was refused after ``prepare``, which builds nothing to close."""

    def apply(self, next_policy: Policy | Prepared) -> None:
        """Follow a (re)loaded policy, ``prepare``d (a bare one, at the start, is prepared
        here); the gate has been reconfigured already. The first one makes the lease manager
        of its ``pool.shared``; a reload gives it the new limit and bounds."""
        prepared = next_policy
        if not isinstance(prepared, Prepared):
            prepared = self.prepare(prepared)
        first = self._policy is None
        self._policy = policy = prepared.policy
        pool = policy.pool
        if first and pool is not None and pool.shared is not None:
            self._shared = self._join(pool)
        elif self._shared is not None and pool is not None:
            self._shared.set_limits(
                starting_limit(pool), adaptive=pool.adaptive is not None, bounds=limit_bounds(pool)
            )
        adaptive = pool.adaptive if pool is not None else None
        key = (adaptive, policy.backend, pool.max_concurrency) if adaptive and pool else None
        if key != self._poller_key:
            self._stop_poller()
            self._poller_key = key
            self._signals = None  # no backend_* gauges left from a poller that is gone
            if pool is not None:
                self._gate.set_cut(1.0, band=True)  # a new limit starts with no band cut
            if key is not None and self._leads():
                self._run_poller()
        self._recovery.follow(policy)
        self._headers.follow(policy)

    def start(self) -> None:
        self._started = True
        if self._shared is not None:
            self._shared.start()
        if self._poller is not None:
            self._poller.start()
        guard = Guard("overload", log, self._loop_error)
        self._task = guard.start(self._tick_round, OVERLOAD_TICK_S, first_s=OVERLOAD_TICK_S)

    async def stop(self) -> None:
        """Stop the controllers. A shared pool's leases stay held (and renewed) until
        ``close``: the requests still running need them."""
        self._started = False
        self._stop_poller()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._stopping:
            await asyncio.wait(self._stopping)

    async def close(self) -> None:
        """After the last request: give a shared pool's leases back and leave it."""
        if self._shared is not None:
            await self._shared.close()

    def _loop_error(self, loop: str) -> None:
        self._metrics.loop_errors.labels(loop).inc()

    # --- the shared pool ---------------------------------------------------------------------

    def _join(self, pool: PoolPolicy) -> LeaseManager:
        """The lease manager of ``pool.shared``, owning the gate's limit (started with the
        controllers)."""
        assert pool.shared is not None
        metrics = self._metrics
        for call in ("acquire", "return", "renew", "events", "demand"):
            metrics.shared_redis_errors.labels(call)
        leases = LeaseAdapter(self._gate)
        manager = LeaseManager(
            leases,
            pool.shared,
            limit=starting_limit(pool),
            adaptive=pool.adaptive is not None,
            bounds=limit_bounds(pool),
            on_mode=self._on_mode,
            on_error=lambda call: metrics.shared_redis_errors.labels(call).inc(),
            on_leader=self._on_leader,
            on_loop_error=self._loop_error,
        )
        leases.attach(manager, manager.ledger.limit)
        if self._started:
            manager.start()
        return manager

    def _leads(self) -> bool:
        """Whether this replica runs the adaptive poller: always, unless the pool is shared,
        in shared mode, and another replica leads."""
        s = self._shared.ledger if self._shared is not None else None
        return s is None or s.is_leader or s.mode is Mode.DEGRADED

    def _on_mode(self, mode: Mode) -> None:
        """The lease manager went degraded or shared again: who runs the poller follows."""
        if mode is Mode.DEGRADED:
            self._metrics.shared_degraded.inc()
        if self._poller_key is None:
            return  # not adaptive
        if self._leads() and self._poller is None:
            log.warning("shared pool degraded: this replica computes the adaptive limit itself")
            self._run_poller()
        elif not self._leads() and self._poller is not None:
            log.warning("shared pool: shared again, the leader computes the adaptive limit")
            self._stop_poller()

    def _on_leader(self, leads: bool) -> None:
        if self._poller_key is None:
            return  # not adaptive
        log.warning(
            "shared pool: this replica %s the adaptive limit",
            "now leads" if leads else "no longer leads",
        )
        self._stop_poller()
        if leads:
            self._run_poller()

    def _stop_poller(self) -> None:
        """Stop the poller in a task that ``stop`` awaits."""
        poller, self._poller = self._poller, None
        if poller is not None:
            task = asyncio.get_running_loop().create_task(poller.stop())
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    # --- the adaptive limit ------------------------------------------------------------------

    def _run_poller(self) -> None:
        """A poller on the adaptive settings in force, from the limit in force (started with
        the controllers)."""
        assert self._poller_key is not None
        a, backend, fallback = self._poller_key
        current = self._gate.pool_statistics().get(POOL)
        initial = a.initial if current is None else current.limit
        if self._shared is not None:
            initial = self._shared.ledger.limit
        limit = AdaptiveLimit(a, initial=initial, fallback_limit=fallback)
        scraper = Scraper.from_policy(backend, a)
        if self._shared is not None:
            self._shared.publish_limit(limit.limit)
        else:
            self._gate.set_pool_limit(limit.limit)
        self._poller = Poller(
            scraper,
            limit,
            self._on_limit,
            self._demand,
            self._objectives_apply,
            on_loop_error=self._loop_error,
            band=self._band,
            ended=self._gate.ends.count,
        )
        if self._started:
            self._poller.start()

    def _demand(self) -> tuple[int, int]:
        """(in flight, waiting) for the adaptive limit: ``demand.limit_demand`` for a pool of
        this replica alone, ``demand.shared_limit_demand`` for a shared one."""
        if self._shared is not None:
            held, waiting = self._shared.pool_demand()
            return demand.shared_limit_demand(held, waiting, self._shared.ledger.limit)
        s = self._gate.pool_statistics().get(POOL)
        if s is None:
            return (0, 0)
        buckets = self._policy.buckets if self._policy is not None else ()
        return demand.limit_demand(s, self._gate.statistics(), buckets)

    def _objectives_apply(self) -> bool:
        """``demand.objectives_apply`` over the policy's buckets here. A shared pool's leader
        reads its own replica's bands (with requests spread over the replicas, the same
        answer)."""
        if self._policy is None:
            return True
        stats = self._gate.statistics()
        return demand.objectives_apply(
            [stats[b.name] for b in self._policy.buckets if b.name in stats]
        )

    def _band(self, limit: int | None = None) -> BandLoad | None:
        """The least urgent band for the band cut (``extproc.pool.control.bandcut``), at ``limit``
        (default: in force); None in a shared pool, whose leader sees only its own bands."""
        s = self._gate.pool_statistics().get(POOL)
        if self._shared is not None or self._policy is None or s is None:
            return None
        limit = s.limit if limit is None else limit
        return band_load(limit, self._policy.buckets, self._gate.statistics())

    def _on_limit(self, limit: int, signals: Signals | None) -> None:
        self._signals = signals
        if signals is not None and signals.endpoints_failed:
            self._metrics.backend_scrape_errors.inc(signals.endpoints_failed)
        if self._shared is not None:
            if self._shared.ledger.limit != limit:
                assert self._poller is not None
                self._metrics.adaptive_changes.labels(self._poller.adaptive.reason).inc()
            self._shared.publish_limit(limit)
            return
        current = self._gate.pool_statistics().get(POOL)
        if self._poller is None:
            return  # stopped meanwhile
        adaptive = self._poller.adaptive
        if current is not None and current.limit != limit:
            self._metrics.adaptive_changes.labels(adaptive.reason).inc()
            self._gate.set_pool_limit(limit)
        factor = adaptive.band_cut.factor(self._band(limit))
        if current is not None and factor != current.band_cut:
            if adaptive.reason.moves_band:  # not the limit moving its cap
                self._metrics.adaptive_changes.labels(adaptive.reason).inc()
                log.info("band cut %.2f -> %.2f (%s)", current.band_cut, factor, adaptive.reason)
            self._gate.set_cut(factor, band=True)

    # --- the overload tick -------------------------------------------------------------------

    async def _tick_round(self) -> None:
        """One round of the overload loop (its guard logs and counts a failure): staged
        recovery's look, then the tenant headers'."""
        now = asyncio.get_running_loop().time()
        self.tick(now)
        self._headers.look(now)

    def tick(self, now: float) -> Overload | None:
        """One look at the protected bands (``Recovery.tick``)."""
        return self._recovery.tick(now)

    # --- views -------------------------------------------------------------------------------

    def gauges(self) -> dict[str, float]:
        """The pool's gauges (``extproc.ops.metrics.POOL_GAUGES``); empty without a pool."""
        s = self._gate.pool_statistics().get(POOL)
        if s is None:
            return {}
        out: dict[str, float] = {}
        render_gauges(s, out)
        render_gauges(self._recovery.snapshot(s.cut), out)
        if self._poller is not None:
            render_gauges(self._poller.adaptive.snapshot(), out)
        if self._shared is not None:
            render_gauges(SharedSnapshot.of(self._shared), out)
        if self._signals is not None:
            render_gauges(BackendSnapshot.of(self._signals), out)
        return out

    def debug(self) -> dict[str, Any] | None:
        """The pool for /debug/queues; None without a pool."""
        s = self._gate.pool_statistics().get(POOL)
        if s is None:
            return None
        out = render_debug(s)
        out["overload"] = render_debug(self._recovery.snapshot(s.cut))
        if headers := self._headers.debug():
            out["tenant_headers"] = headers
        if self._shared is not None:
            out["shared"] = self._shared.debug()
        if self._poller is not None:
            sig = self._signals
            out["adaptive"] = {
                **render_debug(self._poller.adaptive.snapshot()),
                "signals": None if sig is None else render_debug(BackendSnapshot.of(sig)),
            }
        return out
