"""Figures over time, pure: the backend and the limit as sampled during a run, interactive p99
TTFT in sliding windows, and from them how fast a strategy recovers, how fast its limit
settles and how much of the capacity a class left idle the other class used.

Times are simulated seconds from the start of the arrivals.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bench.common.stats import percentile
from bench.load.summary import RequestRecord

__all__ = [
    "Sample",
    "TtftWindow",
    "idle_capacity_use",
    "limit_settle_s",
    "recovery_s",
    "ttft_windows",
]

# Sliding windows: 10 s wide, one every second; a window needs this many answers to count as
# meeting the target (a window where almost nobody was answered proves nothing).
WINDOW_S = 10.0
STEP_S = 1.0
MIN_ANSWERS = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """The backend (summed over its replicas) and the strategy's limit at one instant."""

    t_s: float
    running: float
    waiting: float
    finished: float  # the simulator's finished_requests counter
    busy_s: float  # the simulator's busy time counter (simulated s)
    speed_factor: float
    limit: float | None  # the sidecar's pool limit or Envoy's adaptive limit; None: none shown


@dataclass(frozen=True, slots=True, kw_only=True)
class TtftWindow:
    """Interactive requests that *arrived* in ``[start_s, start_s + WINDOW_S)`` and were
    answered: their p99 TTFT, counted from the original arrival (retries included)."""

    start_s: float
    answers: int
    p99_s: float | None

    def meets(self, target_s: float) -> bool:
        return self.answers >= MIN_ANSWERS and self.p99_s is not None and self.p99_s < target_s


def ttft_windows(
    records: Sequence[RequestRecord], *, start_s: float, end_s: float, cls: str = "interactive"
) -> list[TtftWindow]:
    """Windows starting every ``STEP_S`` from ``start_s`` while they fit before ``end_s``."""
    answered = sorted(
        (r.arrival_s, r.ttft_s)
        for r in records
        if r.cls == cls and r.outcome == "ok" and r.ttft_s is not None
    )
    arrivals = [a for a, _ in answered]
    out = []
    k = 0
    while (u := start_s + k * STEP_S) + WINDOW_S <= end_s + 1e-9:
        lo, hi = bisect.bisect_left(arrivals, u), bisect.bisect_left(arrivals, u + WINDOW_S)
        ttfts = [t for _, t in answered[lo:hi]]
        out.append(TtftWindow(start_s=u, answers=len(ttfts), p99_s=percentile(ttfts, 99)))
        k += 1
    return out


def recovery_s(
    records: Sequence[RequestRecord], *, since_s: float, until_s: float, target_s: float = 2.0
) -> float | None:
    """How long after ``since_s`` interactive p99 TTFT is under ``target_s`` to stay: the first
    window start from which every window up to ``until_s`` meets the target, minus
    ``since_s`` (0: never missed). None: still missed in the last window, or no window fits."""
    windows = ttft_windows(records, start_s=since_s, end_s=until_s)
    if not windows or not windows[-1].meets(target_s):
        return None
    i = len(windows) - 1
    while i > 0 and windows[i - 1].meets(target_s):
        i -= 1
    return windows[i].start_s - since_s


def limit_settle_s(
    samples: Sequence[Sample], *, since_s: float, band: float = 0.2, min_band: float = 2.0
) -> tuple[float | None, float | None]:
    """When the limit settles after ``since_s``: (seconds after ``since_s`` from which every
    later sample stays within ``band`` (20 %, at least ``min_band``) of the final limit, the
    final limit). The final limit is the median over the last quarter of the samples after
    ``since_s``. (None, None) without limit samples."""
    post = [(s.t_s, s.limit) for s in samples if s.t_s >= since_s and s.limit is not None]
    if len(post) < 4:
        return None, None
    final = statistics.median(v for _, v in post[-max(1, len(post) // 4) :])
    width = max(band * final, min_band)
    i = len(post)
    while i > 0 and abs(post[i - 1][1] - final) <= width:
        i -= 1
    if i == len(post):
        return None, final
    return post[i][0] - since_s, final


def idle_capacity_use(
    records: Sequence[RequestRecord],
    samples: Sequence[Sample],
    *,
    cls: str,
    from_s: float,
    to_s: float,
    capacity_tokens_s: float,
) -> tuple[float | None, float | None]:
    """(the work ``cls`` got done over ``[from_s, to_s)``, as a share of what the backend does
    for that class alone at saturation; the share of that time the engine was busy).

    Work is tokens (prompt + output) of the class's answers completed in the interval, against
    the model's tokens per second for the class alone at ``max_num_seqs``: counting requests
    instead would credit an order that picks the cheap ones first (requests per second grow,
    tokens per second do not). Answers only: tokens for abandoned requests are not work done.
    Busy: from the first and last samples inside (None without two)."""
    span = to_s - from_s
    if span <= 0 or capacity_tokens_s <= 0:
        return None, None
    done = sum(
        r.prompt_tokens + r.output_tokens
        for r in records
        if r.cls == cls and r.outcome == "ok" and from_s <= r.arrival_s + r.e2e_s < to_s
    )
    inside = [s for s in samples if from_s <= s.t_s <= to_s]
    busy = None
    if len(inside) >= 2 and inside[-1].t_s > inside[0].t_s:
        a, b = inside[0], inside[-1]
        busy = (b.busy_s - a.busy_s) / (b.t_s - a.t_s)
    return done / span / capacity_tokens_s, busy
