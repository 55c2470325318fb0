"""The measure layer, pure: a run's raw results (per-request records, counter snapshots, the
samples and polls taken while it ran) turned into one record of figures per strategy and run
(:class:`RunSummary`), which :mod:`.report` prints and checks against its targets.

Over the measurement window (docs/benchmarks.md, "What the simulator models": a request counts
when its final outcome falls inside, so work drained after the run cannot inflate goodput):
per-class statistics, SLO goodput, wasted work, the counters' deltas, the backend's requests in
flight (:class:`InFlight`). Over time (simulated seconds from the start of the arrivals):
interactive p99 TTFT in sliding windows, and from it how fast a strategy recovers, how fast its
limit settles and how much of the capacity a class left idle the other class used.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Final

from bench.common.stats import percentile
from bench.load.summary import LoadResult, RequestRecord

from .capacity import Capacity
from .options import CLASSES, Options, Strategy
from .scenarios import ScenarioRun
from .slo import SLO_TTFT_S, Window, meets_slo
from .tenants import TenantStats, tenant_stats

__all__ = [
    "SLO_TTFT_S",
    "ClassStats",
    "InFlight",
    "InFlightPoint",
    "RunSummary",
    "Sample",
    "TtftWindow",
    "Window",
    "class_stats",
    "combine_replicas",
    "idle_capacity_use",
    "in_flight_figures",
    "in_flight_point",
    "limit_settle_s",
    "meets_slo",
    "recovery_s",
    "sample_of",
    "scenario_figures",
    "slo_goodput_rps",
    "summarize_run",
    "ttft_windows",
    "with_ratio_to_direct",
]

# Sliding windows: 10 s wide, one every second; a window needs this many answers to count as
# meeting the target (a window where almost nobody was answered proves nothing).
WINDOW_S: Final = 10.0
STEP_S: Final = 1.0
MIN_ANSWERS: Final = 5

# --------------------------------------------------------------------------------------------
# Raw inputs: samples and polls taken while a run runs
# --------------------------------------------------------------------------------------------


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
class InFlightPoint:
    """What the simulators said they held at one moment (``/sim/stats``, summed over them)."""

    t_s: float  # simulated seconds from the start of the arrivals
    running: int  # num_requests_running: in the engine's batch
    waiting: int  # num_requests_waiting: in its FCFS queue


def in_flight_point(t_s: float, stats: Sequence[Mapping[str, Any]]) -> InFlightPoint:
    """One poll of every simulator's ``/sim/stats`` as a point (a missing gauge counts 0)."""
    return InFlightPoint(
        t_s=t_s,
        running=sum(int(s.get("num_requests_running", 0)) for s in stats),
        waiting=sum(int(s.get("num_requests_waiting", 0)) for s in stats),
    )


def combine_replicas(snaps: list[dict[str, float]]) -> dict[str, float]:
    """The counters of several sidecars (or Envoys) as one: summed, except a shared pool's
    limit, which every replica reports for all of them (the highest is kept)."""
    out: dict[str, float] = {}
    for snap in snaps:
        for key, value in snap.items():
            if key == "shared_pool_limit":
                out[key] = max(out.get(key, value), value)
            else:
                out[key] = out.get(key, 0.0) + value
    return out


def sample_of(t_s: float, snap: dict[str, float]) -> Sample:
    """One counter snapshot of a run (``run._snapshot``'s keys) as a sample. Its limit is the
    one on what reaches the backend: a shared pool's, else the sidecar's pool, else Envoy's
    adaptive filter's."""
    limit = snap.get(
        "shared_pool_limit", snap.get("pool_limit", snap.get("envoy.adaptive.concurrency_limit"))
    )
    return Sample(
        t_s=t_s,
        running=snap.get("gauge.num_requests_running", 0.0),
        waiting=snap.get("gauge.num_requests_waiting", 0.0),
        finished=snap.get("sim.finished_requests", 0.0),
        busy_s=snap.get("sim.busy_s", 0.0),
        speed_factor=snap.get("gauge.speed_factor", 1.0),
        limit=limit,
    )


# --------------------------------------------------------------------------------------------
# Over the window
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ClassStats:
    """One class (or ``all``) over the window; shares are of the requests resolved in it."""

    resolved: int
    good: int
    goodput_rps: float
    goodput_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None  # from the original arrival, retries included
    ttft_p99_first_attempt_s: float | None  # requests answered at their first attempt
    e2e_p50_s: float | None
    e2e_p99_s: float | None  # answered (200) requests
    outcomes: dict[str, float]  # good, late, 429, 5xx, 4xx, timeout, other
    attempts: int


OUTCOME_KEYS: Final = ("good", "late", "429", "5xx", "4xx", "timeout", "other")


def _final_outcome(r: RequestRecord) -> str:
    if r.outcome == "ok":
        return "good" if r.good else "late"
    if r.outcome == "http_error" and r.status is not None:
        if r.status == 429:
            return "429"
        return "5xx" if r.status >= 500 else "4xx"
    return "timeout" if r.outcome == "timeout" else "other"


def slo_goodput_rps(records: Sequence[RequestRecord], window: Window) -> float:
    """Requests resolved in the window that met their SLO (:func:`meets_slo`), per second."""
    return sum(1 for r in records if window.holds(r) and meets_slo(r)) / window.span_s


def class_stats(records: Sequence[RequestRecord], window: Window) -> ClassStats:
    """Window statistics of some records (the caller picks the class)."""
    rs = [r for r in records if window.holds(r)]
    ok = [r for r in rs if r.outcome == "ok"]
    good = [r for r in ok if r.good]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    first = [r.ttft_s for r in ok if r.ttft_s is not None and r.attempts == 1]
    e2e = [r.e2e_s for r in ok]
    counts = dict.fromkeys(OUTCOME_KEYS, 0)
    for r in rs:
        counts[_final_outcome(r)] += 1
    n = len(rs) or 1
    return ClassStats(
        resolved=len(rs),
        good=len(good),
        goodput_rps=len(good) / window.span_s,
        goodput_tokens_per_s=sum(r.output_tokens for r in good) / window.span_s,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99),
        ttft_p99_first_attempt_s=percentile(first, 99),
        e2e_p50_s=percentile(e2e, 50),
        e2e_p99_s=percentile(e2e, 99),
        outcomes={k: v / n for k, v in counts.items()},
        attempts=sum(r.attempts for r in rs),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class InFlight:
    """The backend's requests in flight over a run, from polls every 0.5 s of wall time
    (:data:`.run.IN_FLIGHT_EVERY_S`): a sampled peak, so a peak shorter than that may be missed.
    What the backend itself says it ran, whatever the gateways think they admitted (with
    several replicas, the overshoot of limits that are not shared shows here)."""

    samples: int
    running_peak: int  # the most running at once, whole run (warm-up and drain included)
    running_peak_window: int | None  # the same over the measurement window
    running_mean_window: float | None
    waiting_peak: int  # the most waiting in the simulator's own queue, whole run
    held_peak: int  # the most running + waiting at one poll, whole run: all the backend held


def in_flight_figures(points: Sequence[InFlightPoint], window: Window) -> InFlight | None:
    """The peaks and the window's mean of some polls; None without any."""
    if not points:
        return None
    inside = [p.running for p in points if window.start_s <= p.t_s < window.end_s]
    return InFlight(
        samples=len(points),
        running_peak=max(p.running for p in points),
        running_peak_window=max(inside) if inside else None,
        running_mean_window=statistics.fmean(inside) if inside else None,
        waiting_peak=max(p.waiting for p in points),
        held_peak=max(p.running + p.waiting for p in points),
    )


# --------------------------------------------------------------------------------------------
# Over time
# --------------------------------------------------------------------------------------------


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
    records: Sequence[RequestRecord],
    *,
    since_s: float,
    until_s: float,
    target_s: float = SLO_TTFT_S,
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
    final = percentile([v for _, v in post[-max(1, len(post) // 4) :]], 50) or 0.0
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


# --------------------------------------------------------------------------------------------
# One record of figures per strategy and run
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSummary:
    """One strategy on one scenario run, over the measurement window (simulated seconds)."""

    strategy: str
    scenario: str
    label: str  # "2x" (steady) or the scenario's name
    load: float  # steady: the offered load; otherwise the scenario's base load
    offered_rps: float  # mean over the arrivals
    window_s: tuple[float, float]
    overall: ClassStats
    per_class: dict[str, ClassStats]
    slo_goodput_rps: float
    refused_frac: float  # final outcomes that were refusals (429, 5xx), of those resolved
    ratio_to_direct: float | None
    wasted_frac: float | None  # tokens generated for aborted requests / all generated
    wasted_prefill_frac: float | None  # the same for prefill tokens
    late_tokens_frac: float | None  # tokens of 200s that came after the client timeout
    backend: dict[str, float]  # simulator counter deltas over the window; gauges at its end
    admission: dict[str, float]  # sidecar or Envoy counter deltas over the window (attempts)
    sim_lag_s_max: float | None
    sim_lag_s_mean: float | None
    loadgen_lag_s_max: float
    harness_ok: bool
    wall_s: float
    # The scenario's figures (recovery_s, limit_settle_s, idle_use, ...), see summarize_run.
    scenario_figures: dict[str, float | None]
    in_flight: InFlight | None = None  # the backend's requests in flight, polled
    # Per tenant (:mod:`.tenants`), for the runs whose requests carry one.
    per_tenant: dict[str, TenantStats] = field(default_factory=dict)

    @property
    def in_flight_peak(self) -> int | None:
        """The most requests the backend ran at once (sampled), whole run."""
        return self.in_flight.running_peak if self.in_flight is not None else None

    @property
    def goodput_rps(self) -> float:
        return self.overall.goodput_rps

    @property
    def ttft_p99_s(self) -> float | None:
        c = self.per_class.get("interactive")
        return c.ttft_p99_s if c is not None else None

    @property
    def ttft_p99_first_attempt_s(self) -> float | None:
        c = self.per_class.get("interactive")
        return c.ttft_p99_first_attempt_s if c is not None else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["goodput_rps"] = self.goodput_rps
        out["goodput_tokens_per_s"] = self.overall.goodput_tokens_per_s
        out["interactive_ttft_p99_s"] = self.ttft_p99_s
        out["interactive_ttft_p99_first_attempt_s"] = self.ttft_p99_first_attempt_s
        out["in_flight_peak"] = self.in_flight_peak
        for name, t in self.per_tenant.items():
            out["per_tenant"][name]["attainment"] = t.attainment
        return out


def scenario_figures(
    run: ScenarioRun,
    records: Sequence[RequestRecord],
    samples: Sequence[Sample],
    cap: Capacity,
) -> dict[str, float | None]:
    """What each scenario measures (see :mod:`.scenarios`):

    * ``recovery_s`` (shift, halve, spike): :func:`recovery_s` from the burst, the
      change or the spike's end, until the next phase (shift) or the end;
    * halve: ``limit_settle_s`` and ``limit_final`` (:func:`limit_settle_s`),
      ``limit_before`` (the median limit over the 20 s before the change);
    * shift: ``idle_use`` (batch's tokens answered per second while interactive is quiet, over
      batch's own saturation throughput, :func:`idle_capacity_use`) and
      ``busy_frac`` (the engine's busy share then).
    """
    m = run.marks
    out: dict[str, float | None] = {}
    if "recover_from_s" in m:
        out["recovery_s"] = recovery_s(
            records, since_s=m["recover_from_s"], until_s=m.get("both_s", run.duration_s)
        )
    if run.scenario == "halve":
        change = m["change_s"]
        settle, final = limit_settle_s(samples, since_s=change)
        before = [s.limit for s in samples if change - 20 <= s.t_s < change and s.limit is not None]
        out["limit_settle_s"] = settle
        out["limit_final"] = final
        out["limit_before"] = percentile(before, 50)
    if run.scenario == "shift":
        use, busy = idle_capacity_use(
            records,
            samples,
            cls="batch",
            from_s=m["idle_from_s"],
            to_s=m["idle_to_s"],
            capacity_tokens_s=cap.class_capacity_tokens_s.get("batch", 0.0),
        )
        out["idle_use"] = use
        out["busy_frac"] = busy
    return out


def summarize_run(
    strategy: Strategy,
    run: ScenarioRun,
    result: LoadResult,
    snaps: Sequence[Mapping[str, float]],
    samples: Sequence[Sample],
    window: Window,
    opts: Options,
    cap: Capacity,
    wall_s: float,
    *,
    in_flight: Sequence[InFlightPoint] = (),
) -> RunSummary:
    """Window statistics of one run. ``snaps``: counters at the start, at the window's start and
    at its end; ``in_flight``: the polls of the backend's requests in flight. Wasted work is
    taken from the start of the run to the end of the window: a request's tokens count as
    aborted only when it ends, so over a window that starts while requests are running the
    ratio could pass 100 %."""
    start, before, after = snaps

    def delta(prefix: str, since: Mapping[str, float]) -> dict[str, float]:
        return {
            k.split(".", 1)[1]: v - since.get(k, 0.0)
            for k, v in after.items()
            if k.startswith(prefix)
        }

    backend = delta("sim.", before)
    backend.pop("lag_s_max", None)
    backend.pop("lag_s_mean", None)
    for gauge in ("num_requests_running", "num_requests_waiting"):
        backend[f"{gauge}_at_end"] = after.get(f"gauge.{gauge}", 0.0)
    admission = {
        **delta("sidecar.", before),
        **delta("envoy.", before),
        **delta("gateway.", before),
    }
    for gauge in (
        "adaptive.concurrency_limit",
        "workers",
        "running",
        "queued_short",
        "queued_long",
    ):
        admission.pop(gauge, None)  # gauges, not counters
    whole = delta("sim.", start)
    generated = whole.get("generation_tokens", 0.0)
    wasted = whole.get("aborted_generation_tokens", 0.0) / generated if generated else None
    prefilled = whole.get("prefill_tokens_computed", 0.0)
    wasted_prefill = whole.get("aborted_prefill_tokens", 0.0) / prefilled if prefilled else None
    in_window = backend.get("generation_tokens", 0.0)
    late_tokens = sum(
        r.output_tokens
        for r in result.records
        if r.outcome == "ok" and not r.good and window.holds(r)
    )
    sim_lag = after.get("sim.lag_s_max")
    harness_ok = result.loadgen_lag_s_max <= opts.max_lag_s and (
        sim_lag is None or sim_lag <= opts.max_lag_s
    )
    recs = result.records
    overall = class_stats(recs, window)
    return RunSummary(
        strategy=strategy,
        scenario=run.scenario,
        label=run.label,
        load=run.load,
        offered_rps=run.offered_rps,
        window_s=(window.start_s, window.end_s),
        overall=overall,
        per_class={c: class_stats([r for r in recs if r.cls == c], window) for c in CLASSES},
        slo_goodput_rps=slo_goodput_rps(recs, window),
        refused_frac=overall.outcomes["429"] + overall.outcomes["5xx"],
        ratio_to_direct=None,
        wasted_frac=wasted,
        wasted_prefill_frac=wasted_prefill,
        late_tokens_frac=late_tokens / in_window if in_window else None,
        backend=backend,
        admission=admission,
        sim_lag_s_max=sim_lag,
        sim_lag_s_mean=after.get("sim.lag_s_mean"),
        loadgen_lag_s_max=result.loadgen_lag_s_max,
        harness_ok=harness_ok,
        wall_s=wall_s,
        scenario_figures=scenario_figures(run, recs, samples, cap),
        in_flight=in_flight_figures(in_flight, window),
        per_tenant=tenant_stats(recs, window),
    )


def with_ratio_to_direct(rows: Sequence[RunSummary]) -> list[RunSummary]:
    """Each row with its goodput over ``direct``'s in the same run (where direct ran)."""
    direct = {(r.scenario, r.label): r.goodput_rps for r in rows if r.strategy == "direct"}
    return [
        replace(r, ratio_to_direct=r.goodput_rps / d)
        if (d := direct.get((r.scenario, r.label)))
        else r
        for r in rows
    ]
