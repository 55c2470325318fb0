"""The shared pool's two controllers, on the sidecar's event loop.

- The adaptive limit (``pool.adaptive``): ``extproc.backend.adaptive.Poller`` scrapes the
  backend's metrics (``backend.metrics``) every ``interval`` and gives the limit it finds to
  ``Gate.set_pool_limit``.
- Staged recovery (``pool.overload``): once a second, ``extproc.backend.overload.OverloadMonitor``
  reads the counts of the protected traffic, every band but the least urgent, from the gate
  (admitted, evicted, refused, the p95 of recent waits, the queue) and, when its state or factor
  changes, gives the factor to ``Gate.set_cut``: while overloaded, the least urgent band holds
  no more than its guaranteed share; when it clears, its cap comes back 50% -> 80% -> 100%,
  each step held ``step_hold``. A policy whose buckets share one priority has nothing to
  protect and no cut.

- A pool shared by several replicas (``pool.shared``): ``extproc.shared.LeaseManager`` sets the
  gate's limit to the leases this replica holds. With an adaptive pool, only the replica that
  holds the leadership (elected in Redis) runs the poller, on the whole pool's demand, and
  publishes the limit through the manager; the others read it from Redis. A replica that gains
  the leadership starts its poller from the limit in force; one that loses it stops its own.

Each transition is one log line (``extproc.control``); the state, the limit and the signals are
gauges (``gauges``, read by the metrics collector at scrape time) and part of /debug/queues.
A policy reload rebuilds a controller only when its own settings changed, and the adaptive
limit carries on from the limit in force.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from extproc.admission.gate import POOL, Gate
from extproc.backend.adaptive import AdaptiveLimit, LimitState, Poller
from extproc.backend.overload import Overload, OverloadMonitor, OverloadState
from extproc.backend.scrape import Scraper, Signals
from extproc.config.policy import (
    AdaptivePolicy,
    BackendPolicy,
    BucketPolicy,
    OverloadPolicy,
    Policy,
    PoolPolicy,
    SharedPolicy,
)
from extproc.ops.metrics import Metrics
from extproc.shared import LeaseManager, Mode

__all__ = ["OVERLOAD_TICK_S", "PoolControl"]

log = logging.getLogger("extproc.control")

OVERLOAD_TICK_S = 1.0
_STATE_CODE = {OverloadState.NORMAL: 0, OverloadState.OVERLOADED: 1, OverloadState.RECOVERING: 2}
_LIMIT_CODE = {LimitState.TRACKING: 0, LimitState.HOLDING: 1, LimitState.FALLBACK: 2}


def _protected(policy: Policy) -> tuple[int, list[BucketPolicy]]:
    """(the least urgent band, the buckets of every band more urgent than it): what the
    overload cut and the latency objectives protect. One band: nothing is protected."""
    least = max(b.priority for b in policy.buckets)
    return least, [b for b in policy.buckets if b.priority < least]


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


class PoolControl:
    def __init__(self, gate: Gate, metrics: Metrics) -> None:
        self._gate = gate
        self._metrics = metrics
        self._policy: Policy | None = None
        self._poller: Poller | None = None
        self._poller_key: tuple[AdaptivePolicy, BackendPolicy, int] | None = None
        self._monitor: OverloadMonitor | None = None
        self._monitor_key: OverloadPolicy | None = None
        self._overload: Overload | None = None
        self._signals: Signals | None = None
        self._task: asyncio.Task[None] | None = None
        self._started = False
        self._shared: LeaseManager | None = None
        self._shared_key: SharedPolicy | None = None
        self._closing: set[asyncio.Task[None]] = set()

    # --- life --------------------------------------------------------------------------------

    def apply(self, policy: Policy) -> None:
        """Follow a (re)loaded policy; the gate has been reconfigured already."""
        self._policy = policy
        pool = policy.pool
        self._apply_shared(pool)
        adaptive = pool.adaptive if pool is not None else None
        key = (adaptive, policy.backend, pool.max_concurrency) if adaptive and pool else None
        if key != self._poller_key:
            self._stop_poller()
            self._poller_key = key
            self._signals = None  # no backend_* gauges left from a poller that is gone
            if adaptive is not None and pool is not None and self._leads():
                self._poller = self._make_poller(adaptive, policy.backend, pool.max_concurrency)
                if self._started:
                    self._poller.start()
        overload = pool.overload if pool is not None and pool.overload.enabled else None
        if overload != self._monitor_key:
            self._monitor_key = overload
            self._overload = None
            if pool is not None:
                self._gate.set_cut(1.0)
            self._monitor = (
                OverloadMonitor(
                    window_s=overload.window_s,
                    tighten_rate=overload.tighten_eviction_rate,
                    clear_rate=min(0.01, overload.tighten_eviction_rate),
                    step_hold_s=overload.step_hold_s,
                )
                if overload is not None
                else None
            )

    def start(self) -> None:
        self._started = True
        if self._shared is not None:
            self._shared.start()
        if self._poller is not None:
            self._poller.start()
        self._task = asyncio.get_running_loop().create_task(self._tick_loop(), name="overload")

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

    async def close(self) -> None:
        """After the last request: give a shared pool's leases back and leave it."""
        manager, self._shared = self._shared, None
        if manager is not None:
            await manager.close()
        if self._closing:
            await asyncio.wait(self._closing)

    # --- the shared pool ---------------------------------------------------------------------

    def _apply_shared(self, pool: PoolPolicy | None) -> None:
        shared = pool.shared if pool is not None else None
        if shared == self._shared_key and (self._shared is None or pool is None):
            return
        if shared != self._shared_key:
            self._shared_key = shared
            old, self._shared = self._shared, None
            if old is not None:
                self._gate.detach_leases()
                task = asyncio.get_running_loop().create_task(old.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            if shared is None or pool is None:
                return
            metrics = self._metrics
            for call in ("acquire", "return", "renew"):
                metrics.shared_redis_errors.labels(call)
            self._shared = LeaseManager(
                self._gate,
                shared,
                limit=self._shared_limit(pool),
                adaptive=pool.adaptive is not None,
                on_degraded=metrics.shared_degraded.inc,
                on_error=lambda call: metrics.shared_redis_errors.labels(call).inc(),
                on_leader=self._on_leader,
            )
            self._gate.attach_leases(self._shared, self._shared.limit)
            if self._started:
                self._shared.start()
            return
        assert self._shared is not None and pool is not None
        self._shared.adaptive = pool.adaptive is not None
        self._shared.set_static_limit(self._shared_limit(pool))

    @staticmethod
    def _shared_limit(pool: PoolPolicy) -> int:
        """Each replica's own limit for the pool: the static one, or where an adaptive pool
        starts until a leader publishes one."""
        return pool.adaptive.initial if pool.adaptive is not None else pool.max_concurrency

    def _leads(self) -> bool:
        """Whether this replica runs the adaptive poller: always, unless the pool is shared
        and another replica leads."""
        return self._shared is None or self._shared.is_leader

    def _on_leader(self, leads: bool) -> None:
        policy = self._policy
        pool = policy.pool if policy is not None else None
        if policy is None or pool is None or pool.adaptive is None:
            return
        log.warning(
            "shared pool: this replica %s the adaptive limit",
            "now leads" if leads else "no longer leads",
        )
        self._stop_poller()
        if leads:
            self._poller = self._make_poller(pool.adaptive, policy.backend, pool.max_concurrency)
            if self._started:
                self._poller.start()

    def _stop_poller(self) -> None:
        poller, self._poller = self._poller, None
        if poller is not None:
            asyncio.get_running_loop().create_task(poller.stop())

    # --- the adaptive limit ------------------------------------------------------------------

    def _make_poller(self, a: AdaptivePolicy, backend: BackendPolicy, fallback: int) -> Poller:
        current = self._gate.pool_statistics().get(POOL)
        initial = a.initial if current is None else current.limit
        if self._shared is not None:
            initial = self._shared.limit
        limit = AdaptiveLimit(
            min_limit=a.min_limit,
            max_limit=a.max_limit,
            initial=min(a.max_limit, max(a.min_limit, initial)),
            ttft_slo_s=a.ttft_slo_s,
            itl_slo_s=a.itl_slo_s,
            max_kv_usage=a.max_kv_usage,
            stale_after_s=a.stale_after_s,
            fallback_after_s=a.fallback_after_s,
            fallback_limit=min(a.max_limit, max(a.min_limit, fallback)),
            cooldown_s=a.window_s,
        )
        scraper = Scraper(
            backend.metrics,
            timeout_s=backend.scrape_timeout_s,
            window_s=a.window_s,
            ttft_quantile=a.ttft_quantile,
            itl_quantile=a.itl_quantile,
        )
        if self._shared is not None:
            self._shared.publish_limit(limit.limit)
        else:
            self._gate.set_pool_limit(limit.limit)
        return Poller(
            scraper, limit, a.interval_s, self._on_limit, self._demand, self._objectives_apply
        )

    def _demand(self) -> tuple[int, int]:
        """(in flight, waiting) for the adaptive limit. Waiters count as demand while the pool
        is full, or while their bucket is held at its share of the limit (``max_share``),
        which grows with the limit. Waiters held back by a bucket's absolute cap
        (``max_concurrency``), by the overload cut (down to a guaranteed share that may be 0;
        the staged recovery, not the limit, lets them in) or by the token bound would not use
        a higher limit, so they must not raise it. (The first version counted waiters only
        while the pool was full: a batch flood alone, held at ``max_share: 0.9`` of the limit,
        never filled the pool, and the limit stayed where it started. The second counted the
        cut's waiters too: at half load, with batch held back by an early overload, the limit
        climbed to its maximum with 25 requests running, and the next burst went to vLLM
        unchecked; bench.compare 0.5x.) A shared pool: every replica's waiters, counted while
        the whole pool is full."""
        if self._shared is not None:
            held, waiting = self._shared.pool_demand()
            return (held, waiting if held >= self._shared.limit else 0)
        s = self._gate.pool_statistics().get(POOL)
        if s is None:
            return (0, 0)
        if s.in_flight >= s.limit:
            return (s.in_flight, s.queued)
        policy = self._policy
        if policy is None:
            return (s.in_flight, 0)
        stats = self._gate.statistics()
        least, _ = _protected(policy)
        held_by_share = 0
        for b in policy.buckets:
            st = stats.get(b.name)
            if st is None or st.queued == 0 or st.in_flight < st.capacity:
                continue
            if b.max_concurrency and st.capacity >= b.max_concurrency:
                continue  # its absolute cap binds: a higher limit changes nothing
            if s.cut < 1.0 and b.priority == least:
                continue  # held by the overload cut: the staged recovery lets them in
            held_by_share += st.queued
        return (s.in_flight, held_by_share)

    def _objectives_apply(self) -> bool:
        """Whether the latency objectives bound the limit now: while a band more urgent than
        the least urgent has requests running or waiting here, or when all buckets share one
        band. A shared pool's leader reads its own replica's bands (with requests spread over
        the replicas, the same answer)."""
        policy = self._policy
        if policy is None:
            return True
        _, urgent = _protected(policy)
        if not urgent:
            return True
        stats = self._gate.statistics()
        return any(
            stats[b.name].in_flight > 0 or stats[b.name].queued > 0
            for b in urgent
            if b.name in stats
        )

    def _on_limit(self, limit: int, signals: Signals | None) -> None:
        self._signals = signals
        if signals is not None and signals.endpoints_failed:
            self._metrics.backend_scrape_errors.inc(signals.endpoints_failed)
        if self._shared is not None:
            if self._shared.limit != limit:
                assert self._poller is not None
                self._metrics.adaptive_changes.labels(self._poller.adaptive.reason).inc()
            self._shared.publish_limit(limit)
            return
        current = self._gate.pool_statistics().get(POOL)
        if current is not None and current.limit != limit:
            assert self._poller is not None
            self._metrics.adaptive_changes.labels(self._poller.adaptive.reason).inc()
            self._gate.set_pool_limit(limit)

    # --- overload ----------------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(OVERLOAD_TICK_S)
            try:
                self.tick(loop.time())
            except Exception:
                log.exception("overload tick failed")

    def tick(self, now: float) -> Overload | None:
        """One look at the protected bands; apply the factor when it changes."""
        policy, monitor = self._policy, self._monitor
        if policy is None or policy.pool is None or monitor is None:
            return None
        stats = self._gate.statistics()
        protected = [b for b in _protected(policy)[1] if b.name in stats]
        if not protected:
            return None  # one band: nothing to protect it from
        waits: list[float] = []
        for b in protected:
            waits.extend(self._gate.recent_waits(b.name))
        verdict = monitor.update(
            now,
            admitted=sum(stats[b.name].admitted_total for b in protected),
            evicted=sum(stats[b.name].evicted_total for b in protected),
            refused=sum(stats[b.name].refused_total for b in protected),
            p95_wait_s=_p95(waits),
            queued=sum(stats[b.name].queued for b in protected),
            deadline_s=max((b.queue_timeout_s for b in protected), default=0.0),
        )
        previous, self._overload = self._overload, verdict
        if verdict.changed:
            self._gate.set_cut(verdict.factor)
            if previous is None or previous.state is not verdict.state:
                self._metrics.overload_transitions.labels(str(verdict.state)).inc()
            rate = "-" if verdict.eviction_rate is None else f"{verdict.eviction_rate:.1%}"
            log.warning(
                "pool %s: least urgent band at %.0f%% of its cap (%s; eviction rate %s, "
                "p95 wait %s s%s)",
                verdict.state,
                100 * verdict.factor,
                verdict.reason,
                rate,
                "-" if verdict.p95_wait_s is None else f"{verdict.p95_wait_s:.2f}",
                "; the backend needs capacity" if verdict.needs_capacity else "",
            )
        return verdict

    # --- views -------------------------------------------------------------------------------

    def gauges(self) -> dict[str, float]:
        """The pool's gauges (``extproc.ops.metrics.POOL_GAUGES``); empty without a pool."""
        s = self._gate.pool_statistics().get(POOL)
        if s is None:
            return {}
        out: dict[str, float] = {
            "pool_limit": s.limit,
            "pool_in_flight": s.in_flight,
            "pool_queued": s.queued,
            "pool_tokens_limit": s.max_tokens or 0,
            "pool_tokens_in_flight": s.tokens_in_flight,
        }
        if s.release_rate is not None:
            out["pool_release_rate"] = s.release_rate
        o = self._overload
        out["overload_state"] = _STATE_CODE[o.state] if o is not None else 0
        out["overload_factor"] = o.factor if o is not None else s.cut
        if o is not None and o.eviction_rate is not None:
            out["overload_eviction_rate"] = o.eviction_rate
        if o is not None and o.p95_wait_s is not None:
            out["overload_p95_wait_seconds"] = o.p95_wait_s
        if self._poller is not None:
            out["adaptive_state"] = _LIMIT_CODE[self._poller.adaptive.state]
        m = self._shared
        if m is not None:
            out["shared_state"] = 0 if m.mode is Mode.SHARED else 1
            out["shared_leases_held"] = m.held
            out["shared_pool_limit"] = m.limit
            out["shared_pool_held"] = m.count
            out["shared_replicas"] = len(m.replicas)
            out["shared_leader"] = 1 if m.is_leader else 0
        sig = self._signals
        if sig is not None:
            out["backend_up"] = sig.endpoints_ok
            if sig.endpoints_ok:
                out["backend_waiting"] = sig.waiting
                out["backend_running"] = sig.running
                out["backend_kv_usage"] = sig.kv_usage
            if sig.ttft_s is not None:
                out["backend_ttft_seconds"] = sig.ttft_s
            if sig.itl_s is not None:
                out["backend_itl_seconds"] = sig.itl_s
        return out

    def debug(self) -> dict[str, Any] | None:
        """The pool for /debug/queues; None without a pool."""
        s = self._gate.pool_statistics().get(POOL)
        if s is None:
            return None
        o = self._overload
        out: dict[str, Any] = {
            "limit": s.limit,
            "in_flight": s.in_flight,
            "queued": s.queued,
            "max_tokens_in_flight": s.max_tokens,
            "tokens_in_flight": s.tokens_in_flight,
            "release_rate": s.release_rate,
            "overload": {
                "state": str(o.state) if o is not None else "normal",
                "factor": o.factor if o is not None else s.cut,
                "reason": o.reason if o is not None else None,
                "eviction_rate": o.eviction_rate if o is not None else None,
                "p95_wait_s": o.p95_wait_s if o is not None else None,
                "needs_capacity": o.needs_capacity if o is not None else False,
            },
        }
        if self._shared is not None:
            out["shared"] = self._shared.debug()
        if self._poller is not None:
            a = self._poller.adaptive
            sig = self._signals
            out["adaptive"] = {
                "state": str(a.state),
                "reason": a.reason,
                "signals": None
                if sig is None
                else {
                    "endpoints_ok": sig.endpoints_ok,
                    "endpoints_failed": sig.endpoints_failed,
                    "waiting": sig.waiting,
                    "running": sig.running,
                    "kv_usage": sig.kv_usage,
                    "ttft_s": sig.ttft_s,
                    "itl_s": sig.itl_s,
                    "errors": list(sig.errors),
                },
            }
        return out
