"""The pool's concurrency limit, found from vLLM's signals and the user's latency objectives.

A static concurrency limit is either too low (GPUs idle while clients get 429s) or too high
(vLLM queues internally, where our deadlines and priorities no longer apply, and TTFT grows for
everyone). ``AdaptiveLimit`` searches for the highest limit at which vLLM still runs everything
it is given within the objectives, and keeps the queue on our side of the wire.

Control law (one ``update`` per scrape; ``L`` is the limit)
-----------------------------------------------------------
Decrease, ``L := floor(L * f)``, when any of these holds, the first one named in ``reason``:

- ``ttft`` / ``itl``: the windowed quantile ``q`` is above its objective ``o``, over at least
  ``min_observations`` (10) observations: fewer, and a p90 is the latency of one request.
  ``f = min(0.8, max(0.5, o / q))``: a small breach takes 20 %, a quantile twice its objective
  halves the limit at once. The first version always took 20 %; when the backend lost half its
  speed (bench.compare ``halve``) the limit needed 100 s, one cut per cooldown, to fall from 86
  to 35, and the queue deadlines expired meanwhile;
- ``vllm_queue`` (``f = 0.8``): vLLM's own waiting queue (summed over endpoints) is longer than
  the allowance ``max(8, floor(0.1 * L))`` in three rounds in a row: vLLM could not take in
  everything we admitted. A request joins vLLM's waiting queue on arrival and leaves it at a
  scheduler step with room in its prefill budget (``max_num_batched_tokens``, 8192 tokens by
  default: four 2k-token prompts), so with the limit refilled at every release a few requests
  are always waiting their prefill turn on a backend that keeps up. Whether that wait matters
  is what the TTFT objective (which includes it) says; this rule only catches a queue that
  stays long. The first version cut on any queue below ``L = 50`` and held the limit at half
  of what the backend could run (bench.compare: 4.6 good req/s at 0.5x load, where every other
  strategy served all 6.3);
- ``kv`` (``f = 0.8``): the fullest endpoint's KV cache is at or above ``max_kv_usage`` (0.9):
  past it vLLM preempts running requests and recomputes them, which costs more than it serves.

A breach does not cut again until the last cut has landed:

- for ``cooldown_s`` (10 s, the scraper's default window) after a decrease the limit holds, up
  or down: the windowed quantiles still hold observations from the old limit;
- while more requests run than the limit (``in_flight > L``), there is no further cut: lowering
  the limit stops no running request, the requests admitted under the old limit finish only over
  their own duration, and until they have the signals describe the old load, not the new
  limit. Without this rule a breach that lasts as long as the longest requests (tens of
  seconds for long answers) cut once per cooldown all along and overshot far below the level
  that meets the objective.

One breach therefore costs at most one cut per cooldown, never a collapse to ``min_limit``.

Objectives protect the urgent bands. ``update(..., objectives=False)``, which the pool's
controller passes while no band but the least urgent has requests running or waiting, leaves
the latency objectives out of both the decrease and the increase: only vLLM's queue and KV
bound the limit. The least urgent band (batch, typically long prompts) would otherwise break
an interactive TTFT objective with its own TTFTs and hold the limit far below what the backend
can run while it is alone (bench.compare ``shift``: the limit fell to 9-12, and batch got 57 %
of the idle capacity). vLLM's histograms have no class label, so the objectives cannot be read
per band.

Increase, ``L := L + max(1, floor(0.05 * L))``, when all of these hold:

- every objective holds with headroom: the quantile is below ``0.9 *`` its objective, or there
  is no observation in the window (nothing is slow). Between 0.9x and 1x the limit holds: the
  quantiles lag by up to the window, so climbing until the objective breaks overshoots;
- vLLM's waiting queue is within the allowance and KV usage is below ``max_kv_usage``;
- there is demand: requests wait in our queue, or ``in_flight >= L - max(1, floor(0.1 * L))``.
  Without demand nothing tests the higher limit, and a limit nobody uses would climb forever
  on good signals that say nothing about it.

The step is 5% of the limit (at least 1), so the climb takes the same number of rounds at any
scale (about 14 rounds to double); a cut takes back four steps or more at once, the usual
asymmetry of AIMD that keeps a shared backend stable. Otherwise the limit holds. It is always
clamped to ``[min_limit, max_limit]``.

Stale data
----------
``signals`` None, no endpoint answering, or signals older than ``stale_after_s`` are no data.
For ``stale_after_s`` (5 s) after the last good scrape the limit simply holds (a missed scrape
is normal), then the state is ``holding``; after ``fallback_after_s`` (30 s) the limit moves to
``fallback_limit`` (by default ``initial``, the operator's static limit): the sidecar neither
freezes on a limit found under conditions long gone nor fails closed. Never 0. When data
returns, tracking resumes at once from the limit in force.

Pure: ``update`` takes ``now`` from the caller; no clock, no I/O. ``Poller`` is the asyncio shell
that scrapes on an interval and feeds ``update``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from enum import StrEnum
from typing import Protocol

from extproc.backend.scrape import Signals

__all__ = ["AdaptiveLimit", "LimitState", "Poller", "SignalSource"]

log = logging.getLogger("extproc.backend")


class LimitState(StrEnum):
    TRACKING = "tracking"  # fresh data: the control law runs
    HOLDING = "holding"  # data stale for stale_after_s: the last limit holds
    FALLBACK = "fallback"  # data stale for fallback_after_s: the fallback limit


class AdaptiveLimit:
    def __init__(
        self,
        *,
        min_limit: int,
        max_limit: int,
        initial: int,
        ttft_slo_s: float | None = None,
        itl_slo_s: float | None = None,
        max_kv_usage: float = 0.9,
        stale_after_s: float = 5.0,
        fallback_after_s: float = 30.0,
        fallback_limit: int | None = None,
        cooldown_s: float = 10.0,
        increase_fraction: float = 0.05,
        decrease_factor: float = 0.8,
        deepest_cut: float = 0.5,
        headroom: float = 0.9,
        min_observations: int = 10,
        queue_tolerance: float = 0.1,
        queue_min: int = 8,
        queue_rounds: int = 3,
        demand_margin: float = 0.1,
    ) -> None:
        """``None`` for an objective: no objective on that latency. ``fallback_limit`` defaults
        to ``initial``. The law's constants are keywords so tests and operators can see them."""
        if min_limit < 1 or max_limit < min_limit:
            raise ValueError("need 1 <= min_limit <= max_limit")
        if (
            not 0.0 < deepest_cut <= decrease_factor < 1.0
            or increase_fraction < 0
            or not 0 < headroom <= 1
        ):
            raise ValueError(
                "need 0 < deepest_cut <= decrease_factor < 1, increase_fraction >= 0, "
                "headroom in (0, 1]"
            )
        if fallback_after_s < stale_after_s:
            raise ValueError("fallback_after_s must not be shorter than stale_after_s")
        self.min_limit = min_limit
        self.max_limit = max_limit
        self.ttft_slo_s = ttft_slo_s
        self.itl_slo_s = itl_slo_s
        self.max_kv_usage = max_kv_usage
        self.stale_after_s = stale_after_s
        self.fallback_after_s = fallback_after_s
        self.fallback_limit = self._clamp(initial if fallback_limit is None else fallback_limit)
        self.cooldown_s = cooldown_s
        self.increase_fraction = increase_fraction
        self.decrease_factor = decrease_factor
        self.deepest_cut = deepest_cut
        self.headroom = headroom
        self.min_observations = min_observations
        self.queue_tolerance = queue_tolerance
        self.queue_min = queue_min
        self.queue_rounds = queue_rounds
        self._queued_rounds = 0  # consecutive rounds with vLLM's queue above the allowance
        self.demand_margin = demand_margin
        self._limit = self._clamp(initial)
        self._state = LimitState.TRACKING
        self._reason = "initial"
        self._last_good: float | None = None  # time of the last good scrape
        self._decreased_at: float | None = None

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def state(self) -> LimitState:
        return self._state

    @property
    def reason(self) -> str:
        """Why the limit or the state last changed: 'initial', 'increase', 'ttft', 'itl',
        'vllm_queue', 'kv', 'stale', 'fallback' or 'resumed'."""
        return self._reason

    def update(
        self,
        now: float,
        signals: Signals | None,
        *,
        in_flight: int,
        waiting: int,
        objectives: bool = True,
    ) -> int:
        """One control step; returns the limit. ``in_flight`` and ``waiting`` are our own
        requests to the pool (holding a slot, queued for one); ``objectives`` False leaves the
        latency objectives out of this step (only the least urgent band has requests)."""
        if signals is None or signals.endpoints_ok == 0 or now - signals.at >= self.stale_after_s:
            return self._no_data(now)
        self._last_good = (
            signals.at if self._last_good is None else max(self._last_good, signals.at)
        )
        if self._state is not LimitState.TRACKING:
            self._state = LimitState.TRACKING
            self._reason = "resumed"
        cooling = self._decreased_at is not None and now - self._decreased_at < self.cooldown_s
        breach = self._breach(signals, objectives)
        if breach is not None:
            reason, factor = breach
            landing = self._decreased_at is not None and in_flight > self._limit
            if not cooling and not landing:
                cut = self._clamp(math.floor(self._limit * factor))
                if cut < self._limit:
                    self._limit = cut
                    self._reason = reason
                    self._decreased_at = now
            return self._limit
        if not cooling and self._may_grow(signals, in_flight, waiting, objectives):
            step = max(1, math.floor(self._limit * self.increase_fraction))
            grown = self._clamp(self._limit + step)
            if grown > self._limit:
                self._limit = grown
                self._reason = "increase"
        return self._limit

    def __repr__(self) -> str:
        return f"<AdaptiveLimit {self._limit} {self._state} ({self._reason})>"

    # --- internals ---------------------------------------------------------------------------

    def _queue_allowance(self) -> int:
        return max(self.queue_min, math.floor(self.queue_tolerance * self._limit))

    def _clamp(self, limit: int) -> int:
        return min(self.max_limit, max(self.min_limit, limit))

    def _no_data(self, now: float) -> int:
        if self._last_good is None:
            self._last_good = now  # no scrape ever succeeded: count from the first update
        age = now - self._last_good
        if age >= self.fallback_after_s:
            if self._state is not LimitState.FALLBACK:
                self._state = LimitState.FALLBACK
                self._limit = self.fallback_limit
                self._reason = "fallback"
        elif age >= self.stale_after_s and self._state is LimitState.TRACKING:
            self._state = LimitState.HOLDING
            self._reason = "stale"
        return self._limit

    def _slo_breached(self, q: float | None, count: int, slo: float | None) -> bool:
        return slo is not None and q is not None and count >= self.min_observations and q > slo

    def _slo_has_headroom(self, q: float | None, slo: float | None) -> bool:
        return slo is None or q is None or q < self.headroom * slo

    def _latency_cut(self, q: float, slo: float) -> float:
        """The factor for a latency breach: the objective over the quantile, within
        [deepest_cut, decrease_factor]."""
        return min(self.decrease_factor, max(self.deepest_cut, slo / q))

    def _breach(self, s: Signals, objectives: bool) -> tuple[str, float] | None:
        """(reason, factor) of the first rule broken, or None."""
        if objectives:
            if self._slo_breached(s.ttft_s, s.ttft_count, self.ttft_slo_s):
                assert s.ttft_s is not None and self.ttft_slo_s is not None
                return "ttft", self._latency_cut(s.ttft_s, self.ttft_slo_s)
            if self._slo_breached(s.itl_s, s.itl_count, self.itl_slo_s):
                assert s.itl_s is not None and self.itl_slo_s is not None
                return "itl", self._latency_cut(s.itl_s, self.itl_slo_s)
        if s.waiting > self._queue_allowance():
            self._queued_rounds += 1
            if self._queued_rounds >= self.queue_rounds:
                return "vllm_queue", self.decrease_factor
        else:
            self._queued_rounds = 0
        if s.kv_usage >= self.max_kv_usage:
            return "kv", self.decrease_factor
        return None

    def _may_grow(self, s: Signals, in_flight: int, waiting: int, objectives: bool) -> bool:
        margin = max(1, math.floor(self.demand_margin * self._limit))
        return (
            (
                not objectives
                or (
                    self._slo_has_headroom(s.ttft_s, self.ttft_slo_s)
                    and self._slo_has_headroom(s.itl_s, self.itl_slo_s)
                )
            )
            and s.waiting <= self._queue_allowance()
            and s.kv_usage < self.max_kv_usage
            and (waiting > 0 or in_flight >= self._limit - margin)
        )


# --- the asyncio shell -------------------------------------------------------------------------


class SignalSource(Protocol):
    """What the poller scrapes: a ``Scraper``, or a fake in tests."""

    async def scrape(self, now: float) -> Signals: ...


class Poller:
    """Scrape every ``interval_s``, update the limit, hand it to ``on_update``.

    Rounds run one after another in one task, so there is never more than one scrape in flight;
    a round that takes longer than the interval delays the next one rather than overlapping it.
    An exception in a round (scrape, ``demand``, ``on_update``) is logged and the loop goes on: a
    scrape that raised counts as no data, so the limit degrades to holding and fallback.
    """

    def __init__(
        self,
        scraper: SignalSource,
        adaptive: AdaptiveLimit,
        interval_s: float,
        on_update: Callable[[int, Signals | None], None],
        demand: Callable[[], tuple[int, int]],
        objectives: Callable[[], bool] | None = None,
    ) -> None:
        """``demand()`` returns our (in_flight, waiting) for the pool, read at each round;
        ``objectives()`` whether the latency objectives apply this round (default: always)."""
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.scraper = scraper
        self.adaptive = adaptive
        self.interval_s = interval_s
        self._on_update = on_update
        self._demand = demand
        self._objectives = objectives
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._errors: tuple[str, ...] = ()  # the last round's endpoint errors, logged on change
        self.rounds = 0

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("poller already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="backend-poller")

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
            before = (self.adaptive.limit, self.adaptive.state)
            limit = self.adaptive.update(
                loop.time(), signals, in_flight=in_flight, waiting=waiting, objectives=objectives
            )
            self.rounds += 1
            self._log_round(before, signals)
            try:
                self._on_update(limit, signals)
            except Exception:
                log.exception("backend on_update callback failed")
            return limit

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            await self.poll_once()
            next_at += self.interval_s
            now = loop.time()
            next_at = max(next_at, now)  # late: start the next round now, do not catch up
            await asyncio.sleep(next_at - now)

    def _log_round(self, before: tuple[int, LimitState], signals: Signals | None) -> None:
        a = self.adaptive
        if (a.limit, a.state) != before:
            log.info("backend limit %d -> %d, %s (%s)", before[0], a.limit, a.state, a.reason)
        errors = signals.errors if signals is not None else ()
        if errors != self._errors:
            self._errors = errors
            if errors:
                log.warning("backend scrape: %s", "; ".join(errors))
