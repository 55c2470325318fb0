"""The band cut: on a latency breach, shrink the least urgent band before the shared limit.

vLLM's latency histograms carry no class, and the pool's limit is shared by every band, so a
cut of the limit answers interference that one band causes by shrinking all of them. The
usual cause is the least urgent band's prefill: a batch request's 2k-token prompt enters one
engine step (vLLM's chunked prefill takes up to ``max_num_batched_tokens`` a step), and that
step is every running stream's inter-token gap, and part of every waiting request's TTFT (on
the A100 profile of ``bench/sim`` a step is 16 ms + 48 us per prefill token + 18 us per
decoding request: a 2k prefill makes it 115 ms, past a 100 ms objective). So what the least
urgent band may hold is cut first, and the limit only once that band is down to its floor.
In requests held, not prompt tokens per second: at the same prompt tokens per second, held
slots stagger the prefills as well as an ideal pacer would (``bench.micro.prefill_pacing``;
docs/pool.md, "The band cut's unit").

Rules (``AdaptiveLimit.update`` asks; ``BandLoad`` is the band now, in requests)
-------------------------------------------------------------------------------
1. **Who is cut first.** A latency objective (``extproc.objectives``) breached while
   the least urgent band holds more than its floor cuts the band, not the limit (the reason
   ``band_<objective>``, ``LimitReason.is_latency``): it may hold ``max(floor, floor(held x
   f))`` requests from now on, ``held`` what it holds now (its requests running, or the cut in
   force if lower) and ``f`` the limit's own factor for this breach (0.5-0.8). vLLM's queue
   and KV cache measure what the whole pool admitted, and still cut the limit.
2. **The floor.** The band's guaranteed share, ``floor(min_share x limit)`` summed over its
   buckets, in requests: no cut takes it away (the core never caps a bucket below its
   guaranteed share), so a band with work always gets at least its share.
3. **When the limit is cut.** Once the band holds no more than its floor (or nothing), a
   breach cuts the limit, as before; the band's floor shrinks with it.
4. **Let a cut land.** A band cut counts as a cut for the limit's cooldown (``window``: no
   further cut, and no growth, until the windowed quantiles describe the new load), and while
   the band runs more than its cut, nothing is cut again: its requests admitted before the cut
   are still running, and the signals describe them. So one breach costs at most one cut per
   cooldown, of the band or of the limit, never a collapse to ``min_limit``.
5. **Lend back.** In a round where the limit could grow (every objective with 10 % to spare,
   vLLM's queue and KV within bounds, no cooldown), and the band is held by its cut (it has
   waiters and holds the cut), the cut rises by the limit's own step (``lend``), ``max(1,
   floor(0.05 x limit))`` requests; at the band's usual cap (``max_share``,
   ``max_concurrency``) the cut is lifted. A round that lends does not grow the limit: one
   step of load a round.
6. **Work-conserving.** The cut applies only while a more urgent band has requests running or
   waiting (``demand.cut_band``, as the overload cut); above its cut the band's waiters are
   no demand for a higher limit (``demand.limit_demand``).

The cut is published as a factor of the band's usual cap (``BandCut.factor``, 1.0: none),
which ``Admission.set_cut(..., band=True)`` applies to each bucket of the band as the overload
monitor's factor is (the lower of the two binds). Pure: no clock, no I/O; the limit's
``update`` passes the band each round.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from extproc.pool.core.demand import least_urgent, protected
from extproc.pool.core.values import BucketStats, slots

__all__ = ["BandCut", "BandLoad", "band_load"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BandLoad:
    """The least urgent band, in requests, as the band cut reads it."""

    running: int  # holding a slot
    waiting: int  # in its queues
    floor: int  # its guaranteed share of the limit
    top: int  # the most it may hold with no band cut (its caps; the overload cut aside)


class _Bucket(Protocol):
    """What ``band_load`` reads of a policy bucket (``BucketPolicy``)."""

    @property
    def name(self) -> str: ...

    @property
    def priority(self) -> int: ...

    @property
    def min_share(self) -> float: ...

    @property
    def max_share(self) -> float: ...

    @property
    def max_concurrency(self) -> int: ...


def band_load(
    limit: int, buckets: Iterable[_Bucket], stats: Mapping[str, BucketStats]
) -> BandLoad | None:
    """The least urgent band of the policy's buckets at ``limit``; None with one band (nothing
    to protect, so nothing to cut first). Floor and cap per bucket as the core computes them
    (``BucketState.min_slots``, ``max_slots``)."""
    buckets = list(buckets)
    if not buckets or not protected(buckets):
        return None
    least = least_urgent(buckets)
    running = waiting = floor = top = 0
    for b in buckets:
        if b.priority != least:
            continue
        st = stats.get(b.name)
        if st is not None:
            running += st.in_flight
            waiting += st.queued
        floor += slots(b.min_share, limit)
        cap = max(1, slots(b.max_share, limit))
        top += min(cap, b.max_concurrency) if b.max_concurrency else cap
    return BandLoad(running=running, waiting=waiting, floor=floor, top=top)


class BandCut:
    """Rules 1-5 of the module docstring: what the least urgent band may hold, as a factor of
    its usual cap."""

    def __init__(self) -> None:
        self._cap: int | None = None  # requests the band may hold; None: no cut

    @property
    def cap(self) -> int | None:
        return self._cap

    def factor(self, band: BandLoad | None) -> float:
        """The cut as a share of the band's usual cap (1.0: none)."""
        if self._cap is None or band is None or band.top < 1:
            return 1.0
        return min(1.0, self._cap / band.top)

    def landing(self, band: BandLoad) -> bool:
        """Whether the band still runs more than its cut allows (rule 4)."""
        return self._cap is not None and band.running > max(self._cap, band.floor)

    def cut(self, band: BandLoad, factor: float) -> bool:
        """A latency breach (rule 1); False when the band holds no more than its floor, so the
        limit is what is left to cut (rule 3)."""
        held = band.running if self._cap is None else min(self._cap, band.running)
        if held <= band.floor:
            return False
        self._cap = max(band.floor, math.floor(held * factor))
        return True

    def lend(self, band: BandLoad, step: int) -> bool:
        """The objectives hold with headroom (rule 5): one step back while the cut holds the
        band; returns whether it lent."""
        cap = self._cap
        if cap is None or band.waiting == 0 or band.running < max(cap, band.floor):
            return False
        cap = max(cap, band.floor) + step
        self._cap = None if cap >= band.top else cap
        return True

    def lift(self) -> None:
        """No band cut (stale data, fallback: the limit's own rules take over)."""
        self._cap = None

    def __repr__(self) -> str:
        return f"<BandCut {'none' if self._cap is None else self._cap}>"
