"""The pool's concurrency limit, found from vLLM's signals and the user's latency objectives.

A static concurrency limit is either too low (GPUs idle while clients get 429s) or too high
(vLLM queues internally, where our deadlines and priorities no longer apply, and TTFT grows for
everyone). ``AdaptiveLimit`` searches for the highest limit at which vLLM still runs everything
it is given within the objectives, and keeps the queue on our side of the wire.

Control law (one ``update`` per scrape; ``L`` is the limit)
-----------------------------------------------------------
Decrease, ``L := floor(L * f)``, when any of these holds, the first one named in ``reason``:

- a latency objective (``extproc.objectives``, in its order; the reason is its name,
  ``ttft`` say): the windowed quantile ``q`` is above its objective ``o``, over at least
  ``MIN_OBSERVATIONS`` (10) observations: fewer, and a p90 is the latency of one request.
  ``f = min(0.8, max(0.5, o / q))``: a small breach takes 20 %, a quantile twice its objective
  halves the limit at once, so a backend that lost half its speed is followed in one cut, not
  one cut per cooldown while the queue deadlines expire;
- ``vllm_queue`` (``f = 0.8``): vLLM's own waiting queue (summed over endpoints) is longer than
  the allowance ``max(8, floor(0.1 * L))`` in three rounds in a row: vLLM could not take in
  everything we admitted. (A few requests always wait their prefill turn, within
  ``max_num_batched_tokens``, on a backend that keeps up; whether that wait matters is the
  TTFT objective's question. This rule only catches a queue that stays long.)
- ``vllm_refused`` (``f = 0.8``, checked first): vLLM itself refused requests since the last
  round (``vllm:admission_rejections_total`` grew: its ``--max-num-queued-reqs`` or
  ``--max-num-queued-tokens`` cap). Those were requests the sidecar admitted and their clients
  got vLLM's 503: the plainest sign that more is admitted than the engine takes in;
- ``kv`` (``f = 0.8``): the fullest endpoint's KV cache is at or above ``max_kv_usage`` (0.9):
  past it vLLM preempts running requests and recomputes them, which costs more than it serves;
- ``abandoned`` (``f = 0.8``, with ``slo.abandoned``): of the slot time of the requests whose
  streams ended in the window (at least ``MIN_OBSERVATIONS``; ``ended``, from
  ``extproc.pool.ends``), a larger share than the objective went to requests that ended at or
  after their deadline, for clients who had given up. It bounds what a loose streaming
  objective lets through (long answers outliving their clients' patience, which no quantile
  shows); the sidecar's own count, it applies with or without ``objectives`` and always cuts
  the limit, not the band: every band's streams slow down together.

A breach does not cut again until the last cut has landed:

- for ``cooldown_s`` (the policy's ``window``, the scraper's) after a decrease the limit holds,
  up or down: the windowed quantiles still hold observations from the old limit;
- while more requests run than the limit (``in_flight > L``), there is no further cut: the
  requests admitted under the old limit finish over their own duration, and until they have,
  the signals describe the old load (cutting once per cooldown meanwhile would overshoot far
  below the level that meets the objective).

One breach therefore costs at most one cut per cooldown, never a collapse to ``min_limit``.

The least urgent band first (``extproc.pool.control.bandcut``, with ``band`` passed): a
latency breach while that band holds more than its guaranteed share cuts what the band may hold
by the same factor and leaves the limit, which is cut once the band is down to its share. A band
cut counts as a decrease for the cooldown, and while the band runs more than its cut a latency
breach cuts nothing; a round where the limit could grow lends a band held by its cut one step
back instead (``lend``).

Objectives protect the urgent bands. ``update(..., objectives=False)``, which the pool's
controller passes while no band but the least urgent has requests running or waiting, leaves
the latency objectives out of both the decrease and the increase: only vLLM's queue and KV
bound the limit. The least urgent band (batch, typically long prompts) would otherwise break
an interactive TTFT objective with its own TTFTs and hold the limit far below what the backend
can run while it is alone (vLLM's histograms have no class label: the objectives cannot be read
per band; ``extproc.pool.core.demand.objectives_apply``).

Increase, ``L := L + max(1, floor(0.05 * L))``, when all of these hold (and no band cut is
eased in the same round):

- every objective holds with headroom: the quantile (the abandoned share) is below ``0.9 *``
  its objective, or there is no observation in the window (nothing is slow). Between 0.9x
  and 1x the limit holds: the quantiles lag by up to the window, so climbing until the
  objective breaks overshoots;
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
``signals`` None, no endpoint answering, or signals older than ``stale_after_s`` are no data:
the limit holds (a missed scrape is normal), in state ``holding`` after ``stale_after_s``; after
``fallback_after_s`` it moves to ``fallback_limit`` (``initial``, or the operator's static
limit the controller passes): neither frozen on a limit found under conditions long gone nor
failing closed. Never 0, but for the next case. When data returns, tracking resumes at once.

No backend at all (``queue_while_no_backend``, off by default): while every host of
``backend.metrics`` names no address (``Signals.no_backend``: NXDOMAIN, what a headless Service
with no ready pod answers, as opposed to a DNS failure, which is no data), the limit is 0
(state ``no_backend``): requests wait in the queue to their deadline and get 429 with
Retry-After, rather than being admitted into Envoy's 503 ``no_healthy_upstream``; their queue
is the demand an autoscaler scales from zero on (docs/autoscaling.md). At the first scrape that
reaches an endpoint, tracking resumes from ``initial``. Off, a name that never resolves (a typo)
is no data, as above, and never stops traffic.

The settings are the policy's ``AdaptivePolicy``; the law's constants are named below. Pure:
``update`` takes ``now`` from the caller; no clock, no I/O. ``snapshot()`` is what the gauges
and /debug/queues show. ``extproc.pool.control.poller.Poller`` is the asyncio shell that
scrapes every ``interval`` and feeds ``update``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from extproc.backend.scrape import Latency, Signals
from extproc.config.policy import AdaptivePolicy
from extproc.objectives import OBJECTIVES
from extproc.pool.control.bandcut import BandCut, BandLoad
from extproc.pool.view import HIDDEN, gauge

__all__ = ["AdaptiveLimit", "AdaptiveSnapshot", "LimitReason", "LimitState"]

# The law's constants (the settings are the policy's).
INCREASE_FRACTION: Final = 0.05  # the step up, of the limit (at least 1)
DECREASE_FACTOR: Final = 0.8  # the cut for vLLM's queue and KV, and the mildest latency cut
DEEPEST_CUT: Final = 0.5  # the deepest latency cut in one step
HEADROOM: Final = 0.9  # a quantile below this share of its objective lets the limit grow
MIN_OBSERVATIONS: Final = 10  # observations in the window before a quantile can breach
QUEUE_TOLERANCE: Final = 0.1  # vLLM's queue allowance, of the limit ...
QUEUE_MIN: Final = 8  # ... and at least this many
QUEUE_ROUNDS: Final = 3  # rounds in a row above the allowance that are a breach
DEMAND_MARGIN: Final = 0.1  # in flight within this share of the limit is demand


class LimitState(StrEnum):
    TRACKING = "tracking"  # fresh data: the control law runs
    HOLDING = "holding"  # data stale for stale_after_s: the last limit holds
    FALLBACK = "fallback"  # data stale for fallback_after_s: the fallback limit
    NO_BACKEND = "no_backend"  # queue_while_no_backend and no host has an address: 0


class LimitReason(StrEnum):
    """Why the limit, the band cut or the state last changed: these, and a latency objective's
    breach, its name (the limit cut) or ``band_<name>`` (the band cut), made from
    ``OBJECTIVES`` when first asked for (``_missing_``): a new objective adds no member."""

    INITIAL = "initial"
    INCREASE = "increase"
    LEND = "lend"  # the band cut eased
    VLLM_REFUSED = "vllm_refused"
    VLLM_QUEUE = "vllm_queue"
    KV = "kv"
    ABANDONED = "abandoned"
    STALE = "stale"
    FALLBACK = "fallback"
    NO_BACKEND = "no_backend"
    RESUMED = "resumed"

    @classmethod
    def _missing_(cls, value: object) -> LimitReason | None:
        names = {o.name for o in OBJECTIVES}
        if not isinstance(value, str) or value.removeprefix("band_") not in names:
            return None
        reason = str.__new__(cls, value)
        reason._name_, reason._value_ = value.upper(), value
        return cls._value2member_map_.setdefault(value, reason)  # type: ignore[return-value]

    @property
    def is_latency(self) -> bool:
        """A latency objective's breach, which cuts the least urgent band first."""
        return self in {o.name for o in OBJECTIVES}

    @property
    def moves_band(self) -> bool:
        """The band cut moved, not the limit: ``lend``, ``band_<name>``."""
        return self is LimitReason.LEND or self in {f"band_{o.name}" for o in OBJECTIVES}


_LIMIT_CODES: dict[str, int] = {
    LimitState.TRACKING: 0,
    LimitState.HOLDING: 1,
    LimitState.FALLBACK: 2,
    LimitState.NO_BACKEND: 3,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class AdaptiveSnapshot:
    """The adaptive limit as the gauges and /debug/queues' ``adaptive`` show it."""

    limit: int = field(metadata=HIDDEN)  # shown as the pool's own limit (``pool_limit``)
    state: LimitState = field(
        metadata=gauge(
            "adaptive_state",
            "The adaptive limit: 0 tracking, 1 holding (stale), 2 fallback, 3 no backend "
            "(limit 0).",
            codes=_LIMIT_CODES,
        )
    )
    reason: LimitReason


class AdaptiveLimit:
    def __init__(
        self,
        policy: AdaptivePolicy,
        *,
        initial: int | None = None,
        fallback_limit: int | None = None,
    ) -> None:
        """The policy's settings; ``initial`` (default the policy's) is where the limit starts
        (the pool's controller passes the limit in force), ``fallback_limit`` (default
        ``initial``) where it goes once the data has been stale for ``fallback_after_s``. An
        objective absent from ``policy.slo_s``: no objective on that latency."""
        if policy.min_limit < 1 or policy.max_limit < policy.min_limit:
            raise ValueError("need 1 <= min_limit <= max_limit")
        if policy.fallback_after_s < policy.stale_after_s:
            raise ValueError("fallback_after_s must not be shorter than stale_after_s")
        self.policy = policy
        # The quantiles are over the scraper's window: a cut has landed in them after one.
        self.cooldown_s = policy.window_s
        start = policy.initial if initial is None else initial
        self.fallback_limit = self._clamp(start if fallback_limit is None else fallback_limit)
        self._queued_rounds = 0  # consecutive rounds with vLLM's queue above the allowance
        self._limit = self._clamp(start)
        self._state = LimitState.TRACKING
        self._reason = LimitReason.INITIAL
        self._last_good: float | None = None  # time of the last good scrape
        self._decreased_at: float | None = None
        self._ended: tuple[int, float] = (0, 0.0)  # this round's (ended, abandoned share)
        self.band_cut = BandCut()

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def state(self) -> LimitState:
        return self._state

    @property
    def reason(self) -> LimitReason:
        return self._reason

    def update(
        self,
        now: float,
        signals: Signals | None,
        *,
        in_flight: int,
        waiting: int,
        objectives: bool = True,
        band: BandLoad | None = None,
        ended: tuple[int, float] = (0, 0.0),
    ) -> int:
        """One control step; returns the limit. ``in_flight`` and ``waiting`` are our own
        requests to the pool (holding a slot, queued for one); ``objectives`` False leaves the
        latency objectives out of this step (only the least urgent band has requests);
        ``ended``: the admitted requests whose streams ended in the window, and the share of
        their slot time that went to those that ended after their deadline
        (``slo.abandoned``);
        ``band`` the least urgent band, for the band cut (None: no band cut, the limit
        answers every breach). ``band_cut.factor(band)`` is then what that band may hold."""
        if (
            self.policy.queue_while_no_backend
            and signals is not None
            and signals.no_backend
            and now - signals.at < self.policy.stale_after_s
        ):
            return self._no_backend(signals.at)
        if (
            signals is None
            or signals.endpoints_ok == 0
            or now - signals.at >= self.policy.stale_after_s
        ):
            return self._no_data(now)
        self._last_good = (
            signals.at if self._last_good is None else max(self._last_good, signals.at)
        )
        if self._state is not LimitState.TRACKING:
            if self._state is LimitState.NO_BACKEND:
                self._limit = self._clamp(self.policy.initial)  # a backend from zero
            self._state = LimitState.TRACKING
            self._reason = LimitReason.RESUMED
        cooling = self._decreased_at is not None and now - self._decreased_at < self.cooldown_s
        self._ended = ended
        breach = self._breach(signals, objectives)
        if breach is not None:
            reason, factor = breach
            landing = self._decreased_at is not None and in_flight > self._limit
            first = band if reason.is_latency else None  # whom a latency breach cuts first
            if cooling or landing or (first is not None and self.band_cut.landing(first)):
                return self._limit
            if first is not None and self.band_cut.cut(first, factor):
                self._reason = LimitReason(f"band_{reason}")  # the least urgent band first
                self._decreased_at = now
                return self._limit
            cut = self._clamp(math.floor(self._limit * factor))
            if cut < self._limit:
                self._limit = cut
                self._reason = reason
                self._decreased_at = now
            return self._limit
        if cooling or not self._has_room(signals, objectives):
            return self._limit
        step = max(1, math.floor(self._limit * INCREASE_FRACTION))
        if band is not None and self.band_cut.lend(band, step):
            self._reason = LimitReason.LEND
        elif self._demand(in_flight, waiting):
            grown = self._clamp(self._limit + step)
            if grown > self._limit:
                self._limit = grown
                self._reason = LimitReason.INCREASE
        return self._limit

    def snapshot(self) -> AdaptiveSnapshot:
        return AdaptiveSnapshot(limit=self._limit, state=self._state, reason=self._reason)

    def __repr__(self) -> str:
        return f"<AdaptiveLimit {self._limit} {self._state} ({self._reason})>"

    # --- internals ---------------------------------------------------------------------------

    def _queue_allowance(self) -> int:
        return max(QUEUE_MIN, math.floor(QUEUE_TOLERANCE * self._limit))

    def _clamp(self, limit: int) -> int:
        return min(self.policy.max_limit, max(self.policy.min_limit, limit))

    def _no_backend(self, at: float) -> int:
        self._last_good = at if self._last_good is None else max(self._last_good, at)
        self._state, self._limit, self._reason = LimitState.NO_BACKEND, 0, LimitReason.NO_BACKEND
        self.band_cut.lift()
        return 0

    def _no_data(self, now: float) -> int:
        if self._last_good is None:
            self._last_good = now  # no scrape ever succeeded: count from the first update
        age = now - self._last_good
        if age >= self.policy.fallback_after_s:
            if self._state is not LimitState.FALLBACK:
                self._state = LimitState.FALLBACK
                self._limit = self.fallback_limit
                self.band_cut.lift()
                self._reason = LimitReason.FALLBACK
        elif age >= self.policy.stale_after_s and self._state is LimitState.TRACKING:
            self._state = LimitState.HOLDING
            self._reason = LimitReason.STALE
        return self._limit

    def _objectives(self, s: Signals) -> list[tuple[str, Latency, float]]:
        """(name, reading, objective) of each latency objective set, in the table's order."""
        slo_s = self.policy.slo_s
        return [
            (o.name, s.latency.get(o.name, Latency()), slo_s[o.name])
            for o in OBJECTIVES
            if o.name in slo_s
        ]

    def _latency_cut(self, q: float, slo: float) -> float:
        """The factor for a latency breach: the objective over the quantile, within
        [DEEPEST_CUT, DECREASE_FACTOR]."""
        return min(DECREASE_FACTOR, max(DEEPEST_CUT, slo / q))

    def _breach(self, s: Signals, objectives: bool) -> tuple[LimitReason, float] | None:
        """(reason, factor) of the first rule broken, or None."""
        if s.refused > 0:
            return LimitReason.VLLM_REFUSED, DECREASE_FACTOR
        if objectives:
            for name, (q, count), objective in self._objectives(s):
                if q is not None and count >= MIN_OBSERVATIONS and q > objective:
                    return LimitReason(name), self._latency_cut(q, objective)
        if s.waiting > self._queue_allowance():
            self._queued_rounds += 1
            if self._queued_rounds >= QUEUE_ROUNDS:
                return LimitReason.VLLM_QUEUE, DECREASE_FACTOR
        else:
            self._queued_rounds = 0
        if s.kv_usage >= self.policy.max_kv_usage:
            return LimitReason.KV, DECREASE_FACTOR
        share, slo = self._abandoned()
        if share is not None and slo is not None and share > slo:
            return LimitReason.ABANDONED, DECREASE_FACTOR
        return None

    def _abandoned(self) -> tuple[float | None, float | None]:
        """(the abandoned share of this round's ends, its objective): the share None with
        fewer than ``MIN_OBSERVATIONS`` ends, the objective None when there is none."""
        ended, share = self._ended
        return (share if ended >= MIN_OBSERVATIONS else None), self.policy.abandoned_max

    def _has_room(self, s: Signals, objectives: bool) -> bool:
        """The signals let the load grow: the objectives with headroom, vLLM's queue and KV
        within bounds."""
        return (
            (
                not objectives
                or all(q is None or q < HEADROOM * slo for _, (q, _), slo in self._objectives(s))
            )
            and s.waiting <= self._queue_allowance()
            and s.kv_usage < self.policy.max_kv_usage
            and self._abandoned_room()
        )

    def _abandoned_room(self) -> bool:
        share, slo = self._abandoned()
        return slo is None or share is None or share < HEADROOM * slo

    def _demand(self, in_flight: int, waiting: int) -> bool:
        margin = max(1, math.floor(DEMAND_MARGIN * self._limit))
        return waiting > 0 or in_flight >= self._limit - margin
