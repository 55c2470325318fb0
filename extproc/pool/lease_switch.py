"""Which lease manager a replica's shared pool runs on, across policy reloads.

``LeaseSwitch`` owns the lease managers (``extproc.pool.shared.LeaseManager``) of one
``extproc.pool.control.PoolControl``: the one in force (``manager``), those a reload replaced
that still cover running requests (retiring), and the tasks that close them.

- ``build(pool)``: a new manager on a new ``LeaseAdapter`` (its ``pool_id``: the Redis URL
  and the ``key_prefix``), not started, when the policy's ``pool.shared`` is another than
  the one in force (else None). It changes nothing. When redis-py cannot use the URL
  (``LeaseManager.unusable``), with ``refuse_unusable`` (a reload) it raises ``ValueError``,
  closing what it made; without (the start) it logs that the replica runs degraded on it.
- ``switch(pool, built)``: follow the policy. Another ``pool.shared``: the built manager
  takes over without the gate ever leaving the leases (``LeaseAdapter.take_over``): the old
  one retires, keeping the leases of the requests running at the switch and giving one back
  as each ends, and is closed (it leaves the pool) once it keeps none. Retiring, it stops
  volunteering for the leadership (``LeaseManager.retiring``: its next renewal gives it up,
  so the new manager can lead), and the control hears no more of its mode or leadership
  (only the manager in force calls ``on_mode`` and ``on_leader``). The same: the manager
  in force takes the new limit and bounds. None: shared mode ends, every manager is closed
  (its leases go back at once) and the gate is back at the policy's limit
  (``LeaseAdapter.detach``).
- ``discard(built)``: the policy was refused after ``build``: close what it made.
- ``close()``: after the last request, every manager gives its leases back and leaves.
- ``debug()``: the retiring managers (/debug/queues, ``/pool`` -> ``shared`` ->
  ``retiring``).

Every task started here (a manager closing) is kept until it ends and awaited by ``close``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from extproc.config.policy import PoolPolicy, SharedPolicy
from extproc.ops.metrics import Metrics
from extproc.pool.gate import Gate
from extproc.pool.lease_adapter import LeaseAdapter, limit_bounds, starting_limit
from extproc.pool.shared import LeaseManager, Mode

__all__ = ["Built", "LeaseSwitch"]

log = logging.getLogger("extproc.shared")


@dataclass(frozen=True, slots=True, kw_only=True)
class Built:
    """A new lease manager (not started) and its local pool, for a policy's ``pool.shared``."""

    shared: SharedPolicy
    manager: LeaseManager
    leases: LeaseAdapter


class LeaseSwitch:
    def __init__(
        self,
        gate: Gate,
        metrics: Metrics,
        *,
        on_mode: Callable[[Mode], None],
        on_leader: Callable[[bool], None],
        on_loop_error: Callable[[str], None],
    ) -> None:
        """The callbacks go to every manager made here (a retiring one drops them)."""
        self._gate = gate
        self._metrics = metrics
        self._on_mode = on_mode
        self._on_leader = on_leader
        self._on_loop_error = on_loop_error
        self.manager: LeaseManager | None = None
        self._key: SharedPolicy | None = None
        self._leases: LeaseAdapter | None = None
        self._retiring: dict[LeaseManager, LeaseAdapter] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._timers: list[asyncio.TimerHandle] = []  # retiring managers' ends, after a move

    def build(self, pool: PoolPolicy | None, *, refuse_unusable: bool) -> Built | None:
        shared = pool.shared if pool is not None else None
        if pool is None or shared is None or shared == self._key:
            return None
        metrics = self._metrics
        for call in ("acquire", "return", "renew", "events", "demand"):
            metrics.shared_redis_errors.labels(call)
        leases = LeaseAdapter(self._gate, (shared.redis, shared.key_prefix))
        made: list[LeaseManager] = []  # the control hears only the manager in force

        def on_mode(mode: Mode) -> None:
            if made[0] is self.manager:
                self._on_mode(mode)

        def on_leader(leads: bool) -> None:
            if made[0] is self.manager:
                self._on_leader(leads)

        manager = LeaseManager(
            leases,
            shared,
            limit=starting_limit(pool),
            adaptive=pool.adaptive is not None,
            bounds=limit_bounds(pool),
            on_mode=on_mode,
            on_error=lambda call: metrics.shared_redis_errors.labels(call).inc(),
            on_leader=on_leader,
            on_loop_error=self._on_loop_error,
        )
        made.append(manager)
        if manager.unusable is not None:
            if refuse_unusable:
                self._spawn(manager.close(give_back=False))
                raise ValueError(
                    f"pool.shared.redis: {shared.redis_display} cannot be used: {manager.unusable}"
                )
            log.error(
                "shared pool: pool.shared.redis %s cannot be used (%s): degraded on a local "
                "share until a policy names one that can be",
                shared.redis_display,
                manager.unusable,
            )
        return Built(shared=shared, manager=manager, leases=leases)

    def discard(self, built: Built | None) -> None:
        if built is not None:
            self._spawn(built.manager.close(give_back=False))

    def switch(self, pool: PoolPolicy | None, built: Built | None, *, started: bool) -> bool:
        """Follow the policy (module docstring); ``started``: start a new manager. True when
        another manager took over from one in force."""
        shared = pool.shared if pool is not None else None
        if shared == self._key:
            if self.manager is not None and pool is not None:
                self.manager.adaptive = pool.adaptive is not None
                self.manager.adaptive_bounds = limit_bounds(pool)
                self.manager.set_static_limit(starting_limit(pool))
            return False
        assert built is None or built.shared == shared
        self._key = shared
        old, old_leases = self.manager, self._leases
        if built is None:  # no pool.shared any more: leave the pool
            self.manager = self._leases = None
            if old_leases is not None:
                old_leases.detach()
            for m in (*self._retiring, *([old] if old is not None else [])):
                self._spawn(m.close())
            self._retiring = {}
            return False
        self.manager, self._leases = built.manager, built.leases
        if old is None or old_leases is None:
            built.leases.attach(built.manager, built.manager.limit)
        else:
            self._retiring[old] = old_leases
            old.retiring = True  # its next renewal gives the leadership up
            # The same Redis, reached: a first call of the new manager that fails does not
            # make this replica one that never reached it (decide rule 7), whose local share
            # would come on top of the leases the old manager keeps.
            same_redis = built.shared.redis == old.policy.redis
            built.manager.reached_before = same_redis and (old.connected or old.reached_before)
            if built.leases.pool_id != old_leases.pool_id:  # another pool: a lease's grace
                now = asyncio.get_running_loop().time()
                left = [m for m, a in self._retiring.items() if a.pool_id == old_leases.pool_id]
                built.manager.moved_from(now, sum(m.held for m in left))
                for m in left:  # every manager of the old pool keeps what it holds meanwhile
                    m.keeps_until = now + m.policy.lease_s
            built.leases.take_over(
                old_leases, built.manager, built.manager.limit, lambda: self._retired(old)
            )
        if started:
            built.manager.start()
        return old is not None

    async def close(self) -> None:
        managers = [*self._retiring, *([self.manager] if self.manager is not None else [])]
        self.manager, self._retiring = None, {}
        for timer in self._timers:
            timer.cancel()
        for m in managers:
            await m.close()
        if self._closing:
            await asyncio.wait(self._closing)

    def debug(self) -> list[dict[str, Any]]:
        """The retiring managers, for /debug/queues: replica id, leases held, requests kept."""
        return [
            {"replica": m.replica, "held": m.held, "keep": leases.keep}
            for m, leases in self._retiring.items()
        ]

    def _retired(self, manager: LeaseManager) -> None:
        """A replaced manager covers no running request any more: it leaves the pool (one
        that keeps its leases after a move, once that ends)."""
        if manager not in self._retiring:
            return
        later = manager.keeps_until - asyncio.get_running_loop().time()
        if later > 0:
            self._timers.append(
                asyncio.get_running_loop().call_later(later, self._retired, manager)
            )
            return
        del self._retiring[manager]
        self._spawn(manager.close())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
