"""The adaptive limit's asyncio shell: scrape the backend on an interval, feed the limit.

``Poller`` runs one round per ``interval`` (the limit's ``AdaptivePolicy``) in one task that
``start`` creates and ``stop`` cancels and awaits: scrape (``SignalSource``: a
``extproc.backend.scrape.Scraper``, or a fake in tests), read the pool's demand, whether the
latency objectives apply and the least urgent band, ``AdaptiveLimit.update``, hand the limit
to ``on_update``.
``BackendSnapshot`` is the signals of a round as the gauges and /debug/queues show them (a
gauge per latency objective, ``extproc.objectives``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from extproc.backend.scrape import Signals
from extproc.loops import Guard
from extproc.objectives import OBJECTIVES
from extproc.pool.control.adaptive import AdaptiveLimit, LimitState
from extproc.pool.control.bandcut import BandLoad
from extproc.pool.view import each, gauge

__all__ = ["BackendSnapshot", "Poller", "SignalSource"]

log = logging.getLogger("extproc.backend")


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendSnapshot:
    """The signals of the poller's last round, as the gauges and /debug/queues show them."""

    endpoints_ok: int = field(
        metadata=gauge(
            "backend_up", "Backend metrics endpoints scraped successfully in the last round."
        )
    )
    endpoints_failed: int
    waiting: int = field(
        metadata=gauge(
            "backend_waiting",
            "vllm:num_requests_waiting, summed over the backend's endpoints.",
            when="endpoints_ok",
        )
    )
    running: int = field(
        metadata=gauge(
            "backend_running",
            "vllm:num_requests_running, summed over the backend's endpoints.",
            when="endpoints_ok",
        )
    )
    kv_usage: float = field(
        metadata=gauge(
            "backend_kv_usage",
            "vllm:kv_cache_usage_perc, the highest over the endpoints (0-1).",
            when="endpoints_ok",
        )
    )
    quantiles: Mapping[str, float | None] = field(
        metadata=each(
            {
                o.name: gauge(
                    f"backend_{o.name}_seconds",
                    f"Windowed quantile of {o.what} (the SLO's).",
                    key=f"{o.name}_s",
                )
                for o in OBJECTIVES
            }
        )
    )
    errors: tuple[str, ...]

    @classmethod
    def of(cls, s: Signals) -> BackendSnapshot:
        return cls(
            endpoints_ok=s.endpoints_ok,
            endpoints_failed=s.endpoints_failed,
            waiting=s.waiting,
            running=s.running,
            kv_usage=s.kv_usage,
            quantiles={name: reading.seconds for name, reading in s.latency.items()},
            errors=tuple(s.errors),
        )


class SignalSource(Protocol):
    """What the poller scrapes: a ``Scraper``, or a fake in tests."""

    async def scrape(self, now: float) -> Signals: ...


class Poller:
    """Scrape every ``interval`` (the limit's policy), update the limit, hand it to
    ``on_update``.

    Rounds run one after another in one task, so there is never more than one scrape in flight;
    a round that takes longer than the interval delays the next one rather than overlapping it.
    An exception in a round (scrape, ``demand``, ``on_update``) is logged and the loop goes on: a
    scrape that raised counts as no data, so the limit degrades to holding and fallback. Any
    other exception of a round is the loop's guard's (``extproc.loops``: logged, counted
    by ``on_loop_error``, the next round after a backoff).
    """

    def __init__(
        self,
        scraper: SignalSource,
        adaptive: AdaptiveLimit,
        on_update: Callable[[int, Signals | None], None],
        demand: Callable[[], tuple[int, int]],
        objectives: Callable[[], bool] | None = None,
        on_loop_error: Callable[[str], None] | None = None,
        band: Callable[[], BandLoad | None] | None = None,
        ended: Callable[[float, float], tuple[int, float]] | None = None,
    ) -> None:
        """``demand()`` returns our (in_flight, waiting) for the pool, read at each round;
        ``objectives()`` whether the latency objectives apply this round (default: always);
        ``band()`` the least urgent band for the band cut (default: none); ``ended(now,
        window)`` the admitted requests ended over the window and the abandoned share of their
        slot time
        (``extproc.pool.ends``; default: none)."""
        interval_s = adaptive.policy.interval_s
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.scraper = scraper
        self.adaptive = adaptive
        self.interval_s = interval_s
        self._on_update = on_update
        self._demand = demand
        self._objectives = objectives
        self._band = band
        self._ended = ended
        self._task: asyncio.Task[None] | None = None
        self._guard = Guard("backend-poller", log, on_loop_error)
        self._next_at: float | None = None  # when the next round is due (None: now)
        self._lock = asyncio.Lock()
        self._errors: tuple[str, ...] = ()  # the last round's endpoint errors, logged on change
        self.rounds = 0

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("poller already started")
        self._next_at = None
        self._task = self._guard.start(self._round, self.interval_s)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def poll_once(self) -> int:
        """One round: scrape, update, notify; returns the limit."""
        async with self._lock:
            loop = asyncio.get_running_loop()
            signals: Signals | None = None
            try:
                signals = await self.scraper.scrape(loop.time())
            except Exception:
                log.exception("backend scrape failed")
            try:
                in_flight, waiting = self._demand()
            except Exception:
                log.exception("backend demand callback failed")
                in_flight, waiting = 0, 0  # no increase; decreases and staleness still apply
            objectives = True
            if self._objectives is not None:
                try:
                    objectives = self._objectives()
                except Exception:
                    log.exception("backend objectives callback failed")
            band: BandLoad | None = None
            if self._band is not None:
                try:
                    band = self._band()
                except Exception:
                    log.exception("backend band callback failed")  # this round: no band cut
            now = loop.time()
            ended: tuple[int, float] = (0, 0.0)
            if self._ended is not None:
                try:
                    ended = self._ended(now, self.adaptive.policy.window_s)
                except Exception:
                    log.exception("backend ended callback failed")  # this round: no count
            before = (self.adaptive.limit, self.adaptive.state)
            limit = self.adaptive.update(
                now,
                signals,
                in_flight=in_flight,
                waiting=waiting,
                objectives=objectives,
                band=band,
                ended=ended,
            )
            self.rounds += 1
            self._log_round(before, signals)
            try:
                self._on_update(limit, signals)
            except Exception:
                log.exception("backend on_update callback failed")
            return limit

    async def _round(self) -> float:
        """One round of the loop; the pause until the next one is due. The rounds keep to
        a grid of intervals from the first one (or the one after a round that raised)."""
        loop = asyncio.get_running_loop()
        due, self._next_at = (loop.time() if self._next_at is None else self._next_at), None
        await self.poll_once()
        now = loop.time()
        self._next_at = max(due + self.interval_s, now)  # late: now, do not catch up
        return self._next_at - now

    def _log_round(self, before: tuple[int, LimitState], signals: Signals | None) -> None:
        a = self.adaptive
        if (a.limit, a.state) != before:
            log.info("backend limit %d -> %d, %s (%s)", before[0], a.limit, a.state, a.reason)
        errors = signals.errors if signals is not None else ()
        if errors != self._errors:
            self._errors = errors
            if errors:
                log.warning("backend scrape: %s", "; ".join(errors))
