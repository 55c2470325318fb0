"""``python -m bench.compare``: admission strategies side by side, same workload, same simulator.

What it measures
----------------
Three ways to put an LLM server under load, each run against a *fresh* simulator
(:mod:`bench.vllm_sim`, one profile, one speedup) with the *same* open-loop schedule
(:mod:`bench.workload`, one seed) at each offered load:

``direct``
    The clients talk to the simulator. Its own FCFS waiting queue is the only admission
    control (vLLM has no other): under overload the queue grows until clients give up.
``envoy-cb``
    Envoy in front, no ext_proc filter, circuit breakers on the backend cluster set the way an
    operator would: ``max_connections = max_requests = C`` (HTTP/1.1 upstream: one request per
    connection, so C requests run at once) and ``max_pending_requests = P``, a modest FIFO in
    Envoy; beyond it Envoy answers 503 (``x-envoy-overloaded``). Built by transforming
    ``envoy/envoy.yaml`` in code (:func:`testing.envoy.render_envoy_config`, ``ext_proc=False``).
``sidecar``
    Envoy + llm-extproc with a generated policy: an ``interactive`` bucket (header
    ``x-llm-class: interactive``) and a catch-all ``batch`` bucket whose slots add up to the same
    C, each with a queue deadline that fits its clients (see :func:`sidecar_policy`).

Clients are :mod:`bench.loadgen`'s: interactive requests are streamed and give up after 30 s,
batch requests are not streamed and give up after 300 s, and by default they retry like the
OpenAI SDK (2 retries, Retry-After honoured). A request is *good* if its final answer is a
complete 200 within its class's timeout counted from the original arrival (retries included).

Capacity, honestly
------------------
Offered loads are multiples of the backend's capacity for *this* workload, which is computed, not
guessed: :func:`closed_loop` runs the simulator's own scheduler core
(:class:`bench.vllm_sim.Scheduler`, the code the server runs, minus the clock and the sockets)
over the workload's length mix, keeping exactly ``c`` requests in flight (a finished request is
replaced at once), and measures completions per simulated second between the 10th and 90th
percentile of completion times (warm-up and drain excluded).

* **capacity** = that throughput at ``c = max_num_seqs`` (the engine never has more running, so
  this is saturation: more offered load only adds waiting);
* **C**, the concurrency "the backend handles well", is the largest multiple of 8 at which the
  model still finishes 99 % of interactive requests within the client timeout *minus* the
  interactive queue deadline (a request admitted at its deadline still makes it) and 99 % of
  batch requests within theirs minus the batch deadline. Found by bisection (p99 latency grows
  with ``c``). Both envoy-cb and the sidecar get this same C.

A short live saturation run (``--live-capacity-s``; ``max_num_seqs`` requests kept in flight
against the real simulator process at the chosen speedup) is printed next to the model's figure:
it shows whether this host can drive the simulator at that speedup.

Time and the measurement window
-------------------------------
Everything reported is in simulated seconds. The simulator and the load generator scale by
``--speedup`` themselves; Envoy and the sidecar run on the wall clock, so the sidecar policy's
queue deadlines are written as ``simulated / speedup``. Retry-After is the exception: the
sidecar computes it from wall-clock slot hold times and the load generator reads it as simulated
seconds, so at speedup S the adaptive part of Retry-After is S times too short in simulated
time (the 1 s floor and 60 s ceiling are left unscaled, so they are right). Clients therefore
come back sooner than the sidecar asked: more retry pressure, never less.

Arrivals run for ``--duration`` (+1 s); the run is then cut. Everything is measured over the
steady-state window ``[--warmup, --duration)``: a request counts in it if its *final* outcome
(last byte, last refusal, or giving up) falls inside. Goodput is the rate of good outcomes in
the window, so work queued during the run and drained after it cannot inflate it (counting good
answers per second of *arrivals* would, by up to the drain time over the window). The default
warm-up, (retries + 1) x the interactive timeout = 90 s, is the longest an interactive request
takes to end, so the interactive outcome mix is in steady state inside the window. Batch
requests may take 3 x 300 s: their queues (in the simulator for ``direct``, in the sidecar) are
still filling at the end of a few-minute run, so batch figures there are those of a system
heading into overload, not of its steady state (see docs/benchmarks.md).

Wasted work is read from the simulator's ``/sim/stats``: tokens generated for requests that were
aborted because their client disconnected (gave up), as a share of all tokens generated, from
the start of the run to the end of the window (a request's tokens count as aborted only when it
ends). Counters (simulator, sidecar, Envoy) are snapshotted at the start, at the window's start
and at its end while the load runs.

Health of the harness: two cores run the simulator, Envoy, the sidecar and the load generator.
Every run reports the simulator's engine lag (how late step results reached the sockets) and the
load generator's send lag; a run where either exceeds ``--max-lag-s`` is flagged, because its
latencies include the host's, not only the backend's.

Outputs (``--out``, default ``bench/results/``): ``compare.json`` (settings, capacity, policy,
per-run summaries, target checks), ``records.json`` (per-request outcomes), ``goodput.png``
(goodput and interactive p99 TTFT vs offered load per strategy), ``latency_cdf.png`` (per class
and load, the fraction of requests answered within t, per strategy).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import signal
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any, Final, Literal

import aiohttp

from bench.loadgen import (
    LoadConfig,
    LoadResult,
    RequestRecord,
    percentile,
    request_payload,
    run_load,
)
from bench.vllm_sim import PROFILES, EngineConfig, Scheduler
from bench.workload import ClassSpec, PlannedRequest, build_schedule, default_classes
from testing.stack import REPO, Stack

__all__ = [
    "STRATEGIES",
    "Capacity",
    "ClosedLoopPoint",
    "Options",
    "RunSummary",
    "closed_loop",
    "compare",
    "determine_capacity",
    "envoy_breakers",
    "main",
    "sidecar_policy",
    "slot_split",
]

Strategy = Literal["direct", "envoy-cb", "sidecar"]
STRATEGIES: Final[tuple[Strategy, ...]] = ("direct", "envoy-cb", "sidecar")
DEFAULT_OUT: Final = REPO / "bench" / "results"
CLASSES: Final = ("interactive", "batch")
# Targets of issue 3 (checked at 2x and 4x for goodput, at every load for the rest).
GOODPUT_VS_DIRECT: Final = 1.25
TTFT_TARGET_S: Final = 2.0
WASTE_TARGET: Final = 0.05


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """One comparison. Durations are simulated seconds."""

    profile: str = "a100"
    speedup: float = 3.0
    duration_s: float = 200.0  # arrivals; the measurement window is [warmup_s, duration_s)
    warmup_s: float = 90.0  # (max_retries + 1) x the interactive timeout
    loads: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    strategies: tuple[Strategy, ...] = STRATEGIES
    seed: int = 0
    arrivals: Literal["poisson", "trace"] = "poisson"
    interactive_share: float = 0.8
    interactive_timeout_s: float = 30.0
    batch_timeout_s: float = 300.0
    max_retries: int = 2
    interactive_queue_timeout_s: float = 1.5
    batch_queue_timeout_frac: float = 0.8
    queue_bound: Literal["deadline", "drain"] = "drain"
    cb_pending_s: float = 2.0
    concurrency: int | None = None  # None: derived (see determine_capacity)
    model_requests: int = 4000
    live_capacity_s: float = 45.0
    max_lag_s: float = 1.0
    traces_dir: str | None = None
    out_dir: Path = DEFAULT_OUT
    max_requests: int = 200_000

    def classes(self, rate: float) -> tuple[ClassSpec, ...]:
        """The two-class mix at ``rate`` requests per simulated second, with our timeouts."""
        timeouts = {"interactive": self.interactive_timeout_s, "batch": self.batch_timeout_s}
        return tuple(
            replace(c, timeout_s=timeouts[c.name])
            for c in default_classes(
                rate, interactive_share=self.interactive_share, arrivals=self.arrivals
            )
        )

    @property
    def engine(self) -> EngineConfig:
        return EngineConfig(profile=PROFILES[self.profile])

    @property
    def queue_timeouts_s(self) -> dict[str, float]:
        return {
            "interactive": self.interactive_queue_timeout_s,
            "batch": self.batch_queue_timeout_frac * self.batch_timeout_s,
        }

    @property
    def timeouts_s(self) -> dict[str, float]:
        return {"interactive": self.interactive_timeout_s, "batch": self.batch_timeout_s}


# --------------------------------------------------------------------------------------------
# Capacity: the simulator's scheduler core, closed loop (pure, no clock)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ClosedLoopPoint:
    """Steady state of the backend model with ``concurrency`` requests always in flight."""

    concurrency: int
    throughput_rps: float
    class_rps: dict[str, float]
    in_flight: dict[str, float]  # mean requests in flight per class (Little's law)
    ttft_p99_s: dict[str, float | None]
    e2e_p99_s: dict[str, float | None]


def workload_mix(opts: Options) -> list[PlannedRequest]:
    """The workload's length mix (the first ``model_requests`` requests of the schedule), without
    the requests the simulator refuses outright (prompt + output above ``max_model_len``)."""
    schedule = build_schedule(
        opts.classes(10.0),
        duration_s=1e9,
        max_requests=opts.model_requests,
        seed=opts.seed,
        traces_dir=opts.traces_dir,
    )
    limit = opts.engine.max_model_len
    return [r for r in schedule if r.prompt_tokens + r.output_tokens <= limit]


def closed_loop(
    engine: EngineConfig, mix: Sequence[PlannedRequest], concurrency: int
) -> ClosedLoopPoint:
    """Run :class:`Scheduler` with ``concurrency`` requests in flight until ``mix`` is used up."""
    core = Scheduler(engine)
    pending = iter(mix)
    cls_of: dict[int, str] = {}

    def add(at: float) -> None:
        r = next(pending, None)
        if r is not None:
            rid = core.add(prompt_tokens=r.prompt_tokens, max_tokens=r.output_tokens, arrival_s=at)
            cls_of[rid] = r.cls

    for _ in range(concurrency):
        add(0.0)
    t = 0.0
    finished = []
    while core.has_work:
        t = core.next_start_s(t)
        plan = core.schedule(t)
        if plan is None:
            raise RuntimeError("scheduler stalled")
        outcome = core.complete(plan)
        t = outcome.end_s
        for f in outcome.finished:
            finished.append(f)
            add(t)
    ends = sorted(f.finish_s for f in finished)
    lo, hi = ends[len(ends) // 10], ends[(9 * len(ends)) // 10]
    span = hi - lo
    done_in = [f for f in finished if lo < f.finish_s <= hi]
    started_in = [f for f in finished if lo <= f.arrival_s <= hi]
    names = sorted(set(cls_of.values()))
    in_flight: dict[str, float] = {}
    for name in names:
        # Time each request of the class spent in the system inside [lo, hi], over the span.
        busy = sum(
            max(0.0, min(f.finish_s, hi) - max(f.arrival_s, lo))
            for f in finished
            if cls_of[f.rid] == name
        )
        in_flight[name] = busy / span
    return ClosedLoopPoint(
        concurrency=concurrency,
        throughput_rps=len(done_in) / span,
        class_rps={n: sum(1 for f in done_in if cls_of[f.rid] == n) / span for n in names},
        in_flight=in_flight,
        ttft_p99_s={
            n: percentile([f.ttft_s for f in started_in if cls_of[f.rid] == n], 99) for n in names
        },
        e2e_p99_s={
            n: percentile([f.e2e_s for f in started_in if cls_of[f.rid] == n], 99) for n in names
        },
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Capacity:
    """How much the backend can do for this workload, and the concurrency it handles well."""

    profile: str
    capacity_rps: float  # closed loop at max_num_seqs
    saturation: ClosedLoopPoint
    concurrency: int  # C
    at_concurrency: ClosedLoopPoint
    concurrency_rule: str
    sweep: tuple[ClosedLoopPoint, ...]
    live_rps: float | None = None
    live_note: str = ""

    def describe(self) -> str:
        s, a = self.saturation, self.at_concurrency
        lines = [
            f"capacity: the simulator's scheduler core ({self.profile} profile), closed loop over "
            "the workload's length mix:",
            f"  saturation (max_num_seqs={s.concurrency} in flight): "
            f"{self.capacity_rps:.2f} req/s  <- 1x offered load",
            f"  C = {self.concurrency} in flight: {a.throughput_rps:.2f} req/s "
            f"({a.throughput_rps / self.capacity_rps:.0%} of capacity), interactive p99 e2e "
            f"{_f(a.e2e_p99_s.get('interactive'))} s, p99 TTFT "
            f"{_f(a.ttft_p99_s.get('interactive'))} s",
            f"  rule for C: {self.concurrency_rule}",
            "  sweep (c: req/s, interactive p99 e2e s): "
            + ", ".join(
                f"{p.concurrency}: {p.throughput_rps:.1f}, {_f(p.e2e_p99_s.get('interactive'), 0)}"
                for p in self.sweep
            ),
        ]
        if self.live_rps is not None:
            lines.append(
                f"  live check: {self.live_rps:.2f} req/s with max_num_seqs in flight against "
                f"the simulator process ({self.live_note})"
            )
        return "\n".join(lines)


def _fits(point: ClosedLoopPoint, opts: Options) -> bool:
    limits = {name: opts.timeouts_s[name] - opts.queue_timeouts_s[name] for name in opts.timeouts_s}
    return all(
        v is None or v <= limits[name] for name, v in point.e2e_p99_s.items() if name in limits
    )


def determine_capacity(opts: Options, *, log: bool = True) -> Capacity:
    """Capacity (saturation throughput) and C (see the module docstring)."""
    engine = opts.engine
    mix = workload_mix(opts)
    cache: dict[int, ClosedLoopPoint] = {}

    def point(c: int) -> ClosedLoopPoint:
        if c not in cache:
            cache[c] = closed_loop(engine, mix, c)
        return cache[c]

    top = engine.max_num_seqs
    saturation = point(top)
    rule = (
        "largest multiple of 8 whose p99 e2e, per class, is within the client timeout minus "
        f"the queue deadline (interactive {opts.interactive_timeout_s:g}-"
        f"{opts.queue_timeouts_s['interactive']:g} s, batch {opts.batch_timeout_s:g}-"
        f"{opts.queue_timeouts_s['batch']:g} s)"
    )
    if opts.concurrency is not None:
        best = opts.concurrency
        rule = "given with --concurrency"
    elif _fits(saturation, opts):
        best = top
    else:
        lo, hi = 0, top // 8  # in units of 8; lo fits (or is 0), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if _fits(point(8 * mid), opts):
                lo = mid
            else:
                hi = mid
        best = max(8, 8 * lo)
        if lo == 0:
            rule += "; nothing fits, using 8"
    sweep_cs = sorted({16, 32, 64, 128, top, best} & set(range(1, top + 1)))
    cap = Capacity(
        profile=opts.profile,
        capacity_rps=saturation.throughput_rps,
        saturation=saturation,
        concurrency=best,
        at_concurrency=point(best),
        concurrency_rule=rule,
        sweep=tuple(point(c) for c in sweep_cs),
    )
    if log:
        print(cap.describe(), flush=True)
    return cap


# --------------------------------------------------------------------------------------------
# Configurations of the strategies
# --------------------------------------------------------------------------------------------


def slot_split(cap: Capacity) -> dict[str, int]:
    """C slots split between the buckets in proportion to each class's mean in-flight count at C
    (Little's law), so that under overload each class keeps its share of the backend."""
    fl = cap.at_concurrency.in_flight
    total = sum(fl.values()) or 1.0
    batch = max(1, round(cap.concurrency * fl.get("batch", 0.0) / total))
    batch = min(batch, cap.concurrency - 1) if cap.concurrency > 1 else 1
    return {"interactive": max(1, cap.concurrency - batch), "batch": batch}


def _duration(sim_s: float, speedup: float) -> str:
    """A policy duration: simulated seconds on the wall clock, whole milliseconds."""
    return f"{max(1, round(1000 * sim_s / speedup))}ms"


def sidecar_policy(cap: Capacity, opts: Options) -> str:
    """The sidecar's policy (YAML) for this backend and these clients.

    * buckets: ``interactive`` by header, everything else ``batch``; slots from
      :func:`slot_split`; no length conditions in ``match`` (the class is the client's);
    * ``queue_timeout``: interactive ``--interactive-queue-timeout`` (default 1.5 s: queue no
      longer than a 2 s TTFT objective allows, answer 429 + Retry-After instead); batch
      ``--batch-queue-frac`` x its client timeout (default 80 %: a batch request admitted at its
      deadline still has a fifth of its timeout to run, far more than its p99 service time at C);
    * ``max_queue`` (``--queue-bound``): ``drain`` (default) bounds each queue by what its
      slots can admit before the deadline (Little's law: slots / mean hold at C x deadline), so
      the surplus is refused at once instead of after waiting the whole deadline; ``deadline``
      makes it large (2000 / 5000), so the deadline, not the bound, decides who is refused
      (the first design: measured worse, see docs/benchmarks.md);
    * limits: prompts above the simulator's ``max_model_len`` get 413 at the door; the output cap
      (2048) is above every trace row, so nothing is clamped and all strategies do the same work.
    """
    slots = slot_split(cap)
    qt = opts.queue_timeouts_s
    s = opts.speedup
    max_queue = {"interactive": 2000, "batch": 5000}
    if opts.queue_bound == "drain":
        point = cap.at_concurrency
        for name in max_queue:
            hold_s = point.in_flight.get(name, 0.0) / max(point.class_rps.get(name, 0.0), 1e-9)
            max_queue[name] = max(1, math.ceil(slots[name] / max(hold_s, 1e-9) * qt[name]))
    max_len = opts.engine.max_model_len
    return f"""\
# Generated by bench.compare for the {opts.profile} profile at speedup {s:g}: queue deadlines are
# wall-clock, so each is (simulated seconds) / {s:g}. C = {cap.concurrency} slots in all.
tokens:
  chars_per_token: 4.0
limits:
  max_prompt_tokens: {max_len}
  default_max_tokens: 256
  max_output_tokens: 2048
  on_excess: clamp
retry_after: {{min: 1s, max: 60s}}   # not scaled: see "Time" in bench/compare.py
buckets:
  - name: interactive
    match: {{headers: {{x-llm-class: interactive}}}}
    max_concurrency: {slots["interactive"]}
    queue_timeout: {_duration(qt["interactive"], s)}   # {qt["interactive"]:g} s simulated
    max_queue: {max_queue["interactive"]}
  - name: batch
    max_concurrency: {slots["batch"]}
    queue_timeout: {_duration(qt["batch"], s)}   # {qt["batch"]:g} s simulated
    max_queue: {max_queue["batch"]}
"""


def envoy_breakers(cap: Capacity, opts: Options) -> dict[str, int]:
    """Backend-cluster circuit breakers for ``envoy-cb``: C at once, a pending queue of about
    ``--cb-pending-s`` seconds of backend throughput at C (like the sidecar's interactive queue)."""
    pending = max(1, round(cap.at_concurrency.throughput_rps * opts.cb_pending_s))
    return {
        "max_connections": cap.concurrency,
        "max_requests": cap.concurrency,
        "max_pending_requests": pending,
        "max_retries": 3,
    }


# --------------------------------------------------------------------------------------------
# Running one strategy at one load
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Window:
    """The measurement window, simulated seconds from the start of the arrivals. A request
    counts in it if its *final* outcome (last byte, last refusal, or giving up) falls inside."""

    start_s: float
    end_s: float

    @property
    def span_s(self) -> float:
        return self.end_s - self.start_s

    def holds(self, r: RequestRecord) -> bool:
        return self.start_s <= r.arrival_s + r.e2e_s < self.end_s


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
class RunSummary:
    """One strategy at one offered load, over the measurement window (simulated seconds)."""

    strategy: str
    load: float
    offered_rps: float
    window_s: tuple[float, float]
    overall: ClassStats
    per_class: dict[str, ClassStats]
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
        return out


# ---- counters, sampled at the window's edges ------------------------------------------------

_SIM_KEYS: Final = (
    "generation_tokens",
    "aborted_generation_tokens",
    "prefill_tokens_computed",
    "aborted_prefill_tokens",
    "finished_requests",
    "aborted_requests",
    "requests_added",
    "preemptions",
    "busy_s",
)
_ENVOY_STATS: Final = (
    "upstream_rq_total",
    "upstream_rq_pending_total",
    "upstream_rq_pending_overflow",
    "upstream_rq_cancelled",
    "upstream_rq_503",
)


async def _snapshot(
    session: aiohttp.ClientSession, strategy: Strategy, stack: Stack
) -> dict[str, float]:
    """The counters of the run, flat: ``sim.*``, ``sidecar.<bucket>/<outcome>``, ``envoy.*``."""
    out: dict[str, float] = {}
    timeout = aiohttp.ClientTimeout(total=10)
    async with session.get(f"{stack.backend_url}/sim/stats", timeout=timeout) as r:
        stats = await r.json()
    for key in _SIM_KEYS:
        out[f"sim.{key}"] = float(stats.get(key, 0.0))
    out["sim.lag_s_max"] = float(stats.get("lag_s_max", 0.0))
    out["sim.lag_s_mean"] = float(stats.get("lag_s_mean", 0.0))
    for gauge in ("num_requests_running", "num_requests_waiting"):
        out[f"gauge.{gauge}"] = float(stats.get(gauge, 0.0))
    if strategy == "sidecar":
        from prometheus_client.parser import text_string_to_metric_families

        async with session.get(stack.metrics_url, timeout=timeout) as r:
            text = await r.text()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "llm_extproc_requests_total":
                    key = f"sidecar.{s.labels.get('bucket')}/{s.labels.get('outcome')}"
                    out[key] = out.get(key, 0.0) + s.value
    elif strategy == "envoy-cb":
        pattern = "^cluster\\.backend\\.(" + "|".join(_ENVOY_STATS) + ")$"
        url = f"http://127.0.0.1:{stack.admin_port}/stats"
        async with session.get(url, params={"filter": pattern}, timeout=timeout) as r:
            text = await r.text()
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if name.startswith("cluster.backend."):
                out["envoy." + name.removeprefix("cluster.backend.")] = float(value)
    return out


async def _drive(
    cfg: LoadConfig, strategy: Strategy, stack: Stack, window: Window
) -> tuple[LoadResult, list[dict[str, float]]]:
    """The load-generator run, with the counters snapshotted at its start and at the window's
    start and end."""
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:
        snaps = [await _snapshot(session, strategy, stack)]
        t0 = loop.time()
        load = asyncio.create_task(run_load(cfg))
        for edge in (window.start_s, window.end_s):
            await asyncio.sleep(max(0.0, t0 + edge / cfg.speedup - loop.time()))
            snaps.append(await _snapshot(session, strategy, stack))
        result = await load
    return result, snaps


def _backend_argv(opts: Options) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bench.vllm_sim",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--profile",
        opts.profile,
        "--speedup",
        f"{opts.speedup:g}",
    ]


def _stack(strategy: Strategy, cap: Capacity, opts: Options, log_dir: Path) -> Stack:
    log_dir.mkdir(parents=True, exist_ok=True)
    common: dict[str, Any] = {"backend_argv": _backend_argv(opts), "log_dir": log_dir}
    if strategy == "direct":
        return Stack(**common, start_sidecar=False, start_envoy=False)
    if strategy == "envoy-cb":
        return Stack(
            **common,
            start_sidecar=False,
            ext_proc=False,
            backend_circuit_breakers=envoy_breakers(cap, opts),
        )
    policy = log_dir / "policy.yaml"
    policy.write_text(sidecar_policy(cap, opts))
    return Stack(**common, policy_path=policy)


def run_one(
    strategy: Strategy, load: float, cap: Capacity, opts: Options, log_dir: Path
) -> tuple[RunSummary, LoadResult]:
    """Fresh simulator (+ Envoy, + sidecar), one load-generator run, counters, teardown.

    Arrivals run 1 s past the window so the load is steady up to its end; then everything still
    open is cut (it resolves after the window and does not count)."""
    rate = load * cap.capacity_rps
    classes = opts.classes(rate)
    window = Window(start_s=opts.warmup_s, end_s=opts.duration_s)
    t0 = time.monotonic()
    with _stack(strategy, cap, opts, log_dir) as stack:
        cfg = LoadConfig(
            url=stack.backend_url if strategy == "direct" else stack.url,
            classes=classes,
            duration_s=opts.duration_s + 1.0,
            max_requests=opts.max_requests,
            speedup=opts.speedup,
            seed=opts.seed,
            max_retries=opts.max_retries,
            traces_dir=opts.traces_dir,
            max_run_s=opts.duration_s + 1.0,
        )
        result, snaps = asyncio.run(_drive(cfg, strategy, stack, window))
    wall = time.monotonic() - t0
    return summarize_run(strategy, load, rate, result, snaps, window, opts, wall), result


def summarize_run(
    strategy: Strategy,
    load: float,
    rate: float,
    result: LoadResult,
    snaps: Sequence[Mapping[str, float]],
    window: Window,
    opts: Options,
    wall_s: float,
) -> RunSummary:
    """Window statistics of one run. ``snaps``: counters at the start, at the window's start and
    at its end. Wasted work is taken from the start of the run to the end of the window: a
    request's tokens count as aborted only when it ends, so over a window that starts while
    requests are running the ratio could pass 100 %."""
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
    admission = {**delta("sidecar.", before), **delta("envoy.", before)}
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
    return RunSummary(
        strategy=strategy,
        load=load,
        offered_rps=rate,
        window_s=(window.start_s, window.end_s),
        overall=class_stats(recs, window),
        per_class={c: class_stats([r for r in recs if r.cls == c], window) for c in CLASSES},
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
    )


# --------------------------------------------------------------------------------------------
# Live saturation check
# --------------------------------------------------------------------------------------------


async def _live_saturation(url: str, mix: Sequence[PlannedRequest], opts: Options) -> float:
    """Keep ``max_num_seqs`` non-streamed requests in flight for ``live_capacity_s`` simulated
    seconds; completions per simulated second over the second half (the first is warm-up)."""
    s = opts.speedup
    horizon = opts.live_capacity_s / s
    specs = {c.name: replace(c, stream=False) for c in opts.classes(1.0)}
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    done: list[float] = []
    queue: Iterator[PlannedRequest] = itertools.cycle(mix)

    async def worker(session: aiohttp.ClientSession) -> None:
        while loop.time() - t0 < horizon:
            pr = next(queue)
            body = request_payload(specs[pr.cls], pr, "sim")
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                await resp.read()
                if resp.status == 200:
                    done.append(loop.time() - t0)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        workers = [asyncio.create_task(worker(session)) for _ in range(opts.engine.max_num_seqs)]
        await asyncio.sleep(horizon)
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    half = horizon / 2
    return sum(1 for t in done if half <= t < horizon) / (half * s)


def live_capacity(cap: Capacity, opts: Options, log_dir: Path) -> Capacity:
    mix = workload_mix(opts)
    log_dir.mkdir(parents=True, exist_ok=True)
    with Stack(
        backend_argv=_backend_argv(opts),
        log_dir=log_dir,
        start_sidecar=False,
        start_envoy=False,
    ) as stack:
        rps = asyncio.run(_live_saturation(stack.backend_url, mix, opts))
        with urllib.request.urlopen(f"{stack.backend_url}/sim/stats", timeout=5) as r:
            stats = json.loads(r.read())
    note = (
        f"{opts.live_capacity_s:g} s at speedup {opts.speedup:g}, second half; "
        f"simulator lag max {stats.get('lag_s_max', 0.0):.2f} s"
    )
    out = replace(cap, live_rps=rps, live_note=note)
    print(
        f"  live check: {rps:.2f} req/s ({rps / cap.capacity_rps:.0%} of the model; {note})",
        flush=True,
    )
    return out


# --------------------------------------------------------------------------------------------
# Targets, table, plots
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetCheck:
    """One target at one load. ``primary``: the target as stated (goodput in req/s, TTFT from
    the original arrival); the others are the same target on a second reading, for context."""

    name: str
    load: float
    value: float | None
    threshold: float | None
    passed: bool
    detail: str
    primary: bool = True


def _goodput_rps(r: RunSummary) -> float:
    return r.overall.goodput_rps


def _goodput_tps(r: RunSummary) -> float:
    return r.overall.goodput_tokens_per_s


def check_targets(rows: Sequence[RunSummary]) -> list[TargetCheck]:
    """Issue 3's targets for the sidecar: goodput vs direct and envoy-cb at 2x and 4x; p99 TTFT
    and wasted work at every load that was run. Goodput is judged in req/s (primary) and in
    output tokens/s; TTFT from the original arrival (primary) and over first attempts."""
    by = {(r.strategy, r.load): r for r in rows}
    checks: list[TargetCheck] = []
    for load in sorted({r.load for r in rows}):
        side = by.get(("sidecar", load))
        if side is None:
            continue
        direct = by.get(("direct", load))
        cb = by.get(("envoy-cb", load))
        readings: tuple[tuple[str, bool, Callable[[RunSummary], float]], ...] = (
            ("req/s", True, _goodput_rps),
            ("tok/s", False, _goodput_tps),
        )
        for unit, primary, get in readings:
            mine = get(side)
            if load >= 2.0 and direct is not None:
                need = GOODPUT_VS_DIRECT * get(direct)
                checks.append(
                    TargetCheck(
                        name=f"goodput >= 1.25x direct ({unit})",
                        load=load,
                        value=mine,
                        threshold=need,
                        passed=mine >= need,
                        detail=f"{mine:.2f} vs 1.25 x {get(direct):.2f} = {need:.2f} {unit}",
                        primary=primary,
                    )
                )
            if load >= 2.0 and cb is not None:
                checks.append(
                    TargetCheck(
                        name=f"goodput > envoy-cb ({unit})",
                        load=load,
                        value=mine,
                        threshold=get(cb),
                        passed=mine > get(cb),
                        detail=f"{mine:.2f} vs {get(cb):.2f} {unit}",
                        primary=primary,
                    )
                )
        for what, primary, ttft in (
            ("from arrival", True, side.ttft_p99_s),
            ("first attempts", False, side.ttft_p99_first_attempt_s),
        ):
            checks.append(
                TargetCheck(
                    name=f"interactive p99 TTFT < 2 s ({what})",
                    load=load,
                    value=ttft,
                    threshold=TTFT_TARGET_S,
                    passed=ttft is not None and ttft < TTFT_TARGET_S,
                    detail=f"{_f(ttft)} s",
                    primary=primary,
                )
            )
        waste = side.wasted_frac
        checks.append(
            TargetCheck(
                name="wasted work < 5%",
                load=load,
                value=waste,
                threshold=WASTE_TARGET,
                passed=waste is not None and waste < WASTE_TARGET,
                detail=f"{_pct(waste)} of generated tokens",
            )
        )
    return checks


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_table(rows: Sequence[RunSummary]) -> str:
    head = (
        f"{'load':>5} {'strategy':<9}{'offer/s':>8}{'good/s':>8}{'xdirect':>8}{'tok/s':>7}"
        f"{'ttft99i':>8}{'1st99i':>7}{'e2e99i':>7}{'e2e99b':>7}"
        f"{'good':>6}{'late':>6}{'429':>6}{'5xx':>6}{'tmo':>6}{'oth':>5}{'waste':>7}{'lag':>6}"
    )
    w0, w1 = rows[0].window_s if rows else (0.0, 0.0)
    lines = [
        f"per strategy and offered load, over the window [{w0:g} s, {w1:g} s) (simulated "
        "seconds; requests counted when their final outcome falls in the window):",
        head,
    ]
    last_load = None
    for r in rows:
        if last_load is not None and r.load != last_load:
            lines.append("")
        last_load = r.load
        o = r.overall.outcomes
        share = {k: f"{100 * v:.0f}%" for k, v in o.items()}
        oth = o["4xx"] + o["other"]
        lag = max(r.loadgen_lag_s_max, r.sim_lag_s_max or 0.0)
        e2e = {c: s.e2e_p99_s for c, s in r.per_class.items()}
        lines.append(
            f"{r.load:>4g}x {r.strategy:<9}{r.offered_rps:>8.2f}{r.goodput_rps:>8.2f}"
            f"{_f(r.ratio_to_direct):>8}{r.overall.goodput_tokens_per_s:>7.0f}"
            f"{_f(r.ttft_p99_s):>8}{_f(r.ttft_p99_first_attempt_s):>7}"
            f"{_f(e2e.get('interactive'), 1):>7}{_f(e2e.get('batch'), 1):>7}"
            f"{share['good']:>6}{share['late']:>6}{share['429']:>6}{share['5xx']:>6}"
            f"{share['timeout']:>6}{100 * oth:>4.0f}%{_pct(r.wasted_frac):>7}"
            f"{lag:>5.2f}{'' if r.harness_ok else '!'}"
        )
    lines.append(
        "good/s: complete 200s within the client timeout per second; xdirect: good/s over "
        "direct's; tok/s: their output tokens per second;\nttft99i: interactive p99 TTFT from "
        "the original arrival (retries included); 1st99i: the same over requests answered at "
        "their first attempt;\ne2e99i/b: p99 end to end of answered requests per class; shares "
        "of final outcomes: good, late (200 after the client's timeout), 429, 5xx, tmo (the "
        "client gave up), oth (4xx, connection errors);\nwaste: tokens generated for requests "
        "aborted by their client / all generated (simulator counters, from the start of the run "
        "to the end of the window); lag: "
        "worst simulator / load-generator lag, ! = above --max-lag-s"
    )
    return "\n".join(lines)


def format_admission(rows: Sequence[RunSummary]) -> str:
    """Attempt-level counters: who refused what."""
    lines = [
        "admission events over the window (attempts, retries included; attempts = those of the "
        "requests resolved in the window):"
    ]
    for r in rows:
        a = r.admission
        if r.strategy == "sidecar":

            def get(outcome: str, a: Mapping[str, float] = a) -> int:
                return int(sum(v for k, v in a.items() if k.endswith("/" + outcome)))

            text = (
                f"admitted {get('admitted')}, 429 queue_full {get('rejected_queue_full')}, "
                f"429 queue_timeout {get('evicted_timeout')}, left while queued "
                f"{get('cancelled_while_queued')}, 413 {get('rejected_too_large')}"
            )
        elif r.strategy == "envoy-cb":
            text = (
                f"to backend {int(a.get('upstream_rq_total', 0))}, queued in Envoy "
                f"{int(a.get('upstream_rq_pending_total', 0))}, 503 overflow "
                f"{int(a.get('upstream_rq_pending_overflow', 0))}, left while queued "
                f"{int(a.get('upstream_rq_cancelled', 0))}"
            )
        else:
            text = "no admission control (simulator FCFS queue)"
        lines.append(f"{r.load:>4g}x {r.strategy:<9} attempts {r.overall.attempts:>6}: {text}")
    return "\n".join(lines)


def format_targets(checks: Sequence[TargetCheck]) -> str:
    lines = ["targets (sidecar; indented: the same target read another way, for context):"]
    lines.extend(
        f"{'  ' if c.primary else '      '}{'PASS' if c.passed else 'MISS'}  {c.load:>4g}x  "
        f"{c.name:<44} {c.detail}"
        for c in checks
    )
    return "\n".join(lines)


def plot(
    rows: Sequence[RunSummary],
    results: Mapping[tuple[str, float], LoadResult],
    cap: Capacity,
    opts: Options,
    out_dir: Path,
) -> list[Path]:
    """goodput.png and latency_cdf.png (requests resolved in the measurement window)."""
    window = Window(start_s=opts.warmup_s, end_s=opts.duration_s)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    colors = {"direct": "tab:red", "envoy-cb": "tab:orange", "sidecar": "tab:blue"}
    strategies = [s for s in STRATEGIES if any(r.strategy == s for r in rows)]
    loads = sorted({r.load for r in rows})
    paths: list[Path] = []

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for s in strategies:
        rs = sorted((r for r in rows if r.strategy == s), key=lambda r: r.load)
        x = [r.offered_rps for r in rs]
        axes[0].plot(x, [r.goodput_rps for r in rs], "o-", color=colors[s], label=s)
        axes[1].plot(
            x, [r.overall.goodput_tokens_per_s for r in rs], "o-", color=colors[s], label=s
        )
        axes[2].plot(x, [r.ttft_p99_s or math.nan for r in rs], "o-", color=colors[s], label=s)
    for ax in axes[:2]:
        ax.axvline(cap.capacity_rps, color="grey", ls=":", lw=1)
    axes[0].axhline(cap.capacity_rps, color="grey", ls=":", lw=1, label="capacity")
    axes[0].axhline(
        cap.at_concurrency.throughput_rps,
        color="grey",
        ls="-.",
        lw=1,
        label=f"model at C={cap.concurrency}",
    )
    axes[0].set_ylabel("goodput, req/s (good = complete within timeout)")
    axes[1].set_ylabel("goodput, output tokens/s")
    axes[2].axhline(TTFT_TARGET_S, color="grey", ls="--", lw=1, label="2 s target")
    axes[2].set_yscale("log")
    axes[2].set_ylabel("interactive p99 TTFT, s (from arrival)")
    for ax in axes:
        ax.set_xlabel("offered load, req/s (simulated)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"{opts.profile} simulator, capacity {cap.capacity_rps:.2f} req/s, C={cap.concurrency}; "
        f"loads {', '.join(f'{x:g}x' for x in loads)}"
    )
    fig.tight_layout()
    path = out_dir / "goodput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)

    panels = [
        ("interactive", "ttft", "interactive TTFT", opts.interactive_timeout_s),
        ("interactive", "e2e", "interactive end to end", opts.interactive_timeout_s),
        ("batch", "e2e", "batch end to end", opts.batch_timeout_s),
    ]
    fig, axes = plt.subplots(
        len(panels), len(loads), figsize=(4 * len(loads), 3.2 * len(panels)), squeeze=False
    )
    for row, (cls, metric, title, timeout) in enumerate(panels):
        for col, load in enumerate(loads):
            ax = axes[row][col]
            for s in strategies:
                res = results.get((s, load))
                if res is None:
                    continue
                recs = [r for r in res.records if r.cls == cls and window.holds(r)]
                vals = sorted(
                    v
                    for r in recs
                    if r.outcome == "ok"
                    and (v := r.ttft_s if metric == "ttft" else r.e2e_s) is not None
                )
                if not recs:
                    continue
                ys = [(i + 1) / len(recs) for i in range(len(vals))]
                ax.step(vals, ys, where="post", color=colors[s], label=s)
            ax.axvline(timeout, color="grey", ls="--", lw=1)
            if metric == "ttft":
                ax.axvline(TTFT_TARGET_S, color="grey", ls=":", lw=1)
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            ax.set_title(f"{title}, {load:g}x", fontsize=9)
            if col == 0:
                ax.set_ylabel("share answered (200) within t")
            if row == len(panels) - 1:
                ax.set_xlabel("t, simulated s")
            if row == 0 and col == 0:
                ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "latency_cdf.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(path)
    return paths


# --------------------------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------------------------


def _record_dict(r: RequestRecord) -> dict[str, Any]:
    return {
        "cls": r.cls,
        "arrival_s": round(r.arrival_s, 4),
        "outcome": r.outcome,
        "status": r.status,
        "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 4),
        "e2e_s": round(r.e2e_s, 4),
        "attempts": r.attempts,
        "good": r.good,
        "output_tokens": r.output_tokens,
    }


def compare(opts: Options, *, plots: bool = True, command: str | None = None) -> dict[str, Any]:
    """Run every strategy at every load; write JSON and plots; return the JSON document.

    Process logs, Envoy configs and policies of each run stay in ``<out>/logs/<strategy>-<load>``.
    """
    started = time.monotonic()
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    logs = opts.out_dir / "logs"
    print(
        f"bench.compare: {opts.profile} simulator at speedup {opts.speedup:g}, "
        f"{opts.duration_s:g} s of arrivals, measured over [{opts.warmup_s:g} s, "
        f"{opts.duration_s:g} s), loads {', '.join(f'{x:g}x' for x in opts.loads)}, "
        f"{opts.arrivals} arrivals, {opts.interactive_share:.0%} interactive, "
        f"client timeouts {opts.interactive_timeout_s:g}/{opts.batch_timeout_s:g} s, "
        f"{opts.max_retries} retries",
        flush=True,
    )
    cap = determine_capacity(opts)
    if opts.live_capacity_s > 0:
        cap = live_capacity(cap, opts, logs / "live-capacity")
    policy = sidecar_policy(cap, opts)
    breakers = envoy_breakers(cap, opts)
    print(f"envoy-cb breakers on the backend cluster: {breakers}")
    print("sidecar policy:\n" + "\n".join("  " + line for line in policy.splitlines()), flush=True)

    rows: list[RunSummary] = []
    results: dict[tuple[str, float], LoadResult] = {}
    for load in opts.loads:
        for strategy in opts.strategies:
            print(
                f"-- {strategy} at {load:g}x ({load * cap.capacity_rps:.2f} req/s) ...",
                end=" ",
                flush=True,
            )
            summary, result = run_one(strategy, load, cap, opts, logs / f"{strategy}-{load:g}x")
            rows.append(summary)
            results[(strategy, load)] = result
            print(
                f"good {summary.goodput_rps:.2f} req/s, waste {_pct(summary.wasted_frac)}, "
                f"{summary.wall_s:.0f} s wall"
                + ("" if summary.harness_ok else "  [harness lagged]"),
                flush=True,
            )
    direct = {r.load: r.goodput_rps for r in rows if r.strategy == "direct"}
    rows = [
        replace(r, ratio_to_direct=r.goodput_rps / direct[r.load]) if direct.get(r.load) else r
        for r in rows
    ]
    checks = check_targets(rows)
    elapsed = time.monotonic() - started
    doc: dict[str, Any] = {
        "command": command,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()},
        "capacity": asdict(cap),
        "sidecar_policy": policy,
        "envoy_cb_breakers": breakers,
        "runs": [r.to_dict() for r in rows],
        "targets": [asdict(c) for c in checks],
        "wall_s": elapsed,
    }
    (opts.out_dir / "compare.json").write_text(json.dumps(doc, indent=2) + "\n")
    (opts.out_dir / "records.json").write_text(
        json.dumps(
            {
                f"{s}@{load:g}x": [_record_dict(r) for r in res.records]
                for (s, load), res in results.items()
            }
        )
        + "\n"
    )
    written = [opts.out_dir / "compare.json", opts.out_dir / "records.json"]
    if plots:
        written += plot(rows, results, cap, opts, opts.out_dir)
    print()
    print(format_table(rows))
    print()
    print(format_admission(rows))
    print()
    print(format_targets(checks))
    bad = [r for r in rows if not r.harness_ok]
    if bad:
        print(
            f"\nWARNING: {len(bad)} run(s) lagged more than {opts.max_lag_s:g} s (simulator or "
            "load generator): this host could not keep up with the speedup there; lower "
            "--speedup for trustworthy latencies."
        )
    print(f"\nwrote {', '.join(str(p) for p in written)}; {elapsed:.0f} s wall in all")
    return doc


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _loads(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x.rstrip("x")) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad load list {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("loads must be positive")
    return values


def _strategies(text: str) -> tuple[Strategy, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    for n in names:
        if n not in STRATEGIES:
            raise argparse.ArgumentTypeError(f"unknown strategy {n!r} (known: {STRATEGIES})")
    return names  # type: ignore[return-value]


def parse_args(argv: Sequence[str] | None = None) -> tuple[Options, bool]:
    d = Options()
    p = argparse.ArgumentParser(
        prog="python -m bench.compare",
        description="Admission strategies side by side (direct, envoy-cb, sidecar) on the same "
        "workload and simulator; times are simulated seconds.",
    )
    p.add_argument("--profile", choices=sorted(PROFILES), default=d.profile)
    p.add_argument("--speedup", type=float, default=d.speedup)
    p.add_argument("--duration", type=float, default=d.duration_s, help="arrivals, simulated s")
    p.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="not measured: the window is [warmup, duration); default: (max retries + 1) x "
        "the interactive timeout, the longest an interactive request takes to end",
    )
    p.add_argument("--loads", type=_loads, default=d.loads, help="e.g. 0.5,1,2,4 (x capacity)")
    p.add_argument("--strategies", type=_strategies, default=d.strategies)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--arrivals", choices=("poisson", "trace"), default=d.arrivals)
    p.add_argument("--interactive-share", type=float, default=d.interactive_share)
    p.add_argument("--interactive-timeout", type=float, default=d.interactive_timeout_s)
    p.add_argument("--batch-timeout", type=float, default=d.batch_timeout_s)
    p.add_argument("--max-retries", type=int, default=d.max_retries, help="SDK default 2")
    p.add_argument("--interactive-queue-timeout", type=float, default=d.interactive_queue_timeout_s)
    p.add_argument(
        "--batch-queue-frac",
        type=float,
        default=d.batch_queue_timeout_frac,
        help="batch queue deadline as a fraction of the batch client timeout",
    )
    p.add_argument(
        "--queue-bound",
        choices=("deadline", "drain"),
        default=d.queue_bound,
        help="sidecar max_queue: large (the deadline decides) or what drains within the deadline",
    )
    p.add_argument(
        "--cb-pending-s",
        type=float,
        default=d.cb_pending_s,
        help="envoy-cb max_pending_requests = this many seconds of throughput at C",
    )
    p.add_argument("--concurrency", type=int, default=None, help="override the derived C")
    p.add_argument("--model-requests", type=int, default=d.model_requests)
    p.add_argument(
        "--live-capacity-s",
        type=float,
        default=d.live_capacity_s,
        help="live saturation check length, simulated s (0: skip)",
    )
    p.add_argument("--max-lag-s", type=float, default=d.max_lag_s)
    p.add_argument("--traces-dir", default=None)
    p.add_argument("--out", type=Path, default=d.out_dir)
    p.add_argument("--no-plots", action="store_true")
    a = p.parse_args(argv)
    if a.warmup is None:
        a.warmup = (a.max_retries + 1) * a.interactive_timeout
    if not 0 <= a.warmup < a.duration:
        p.error("need 0 <= --warmup < --duration")
    opts = Options(
        profile=a.profile,
        speedup=a.speedup,
        duration_s=a.duration,
        warmup_s=a.warmup,
        loads=a.loads,
        strategies=a.strategies,
        seed=a.seed,
        arrivals=a.arrivals,
        interactive_share=a.interactive_share,
        interactive_timeout_s=a.interactive_timeout,
        batch_timeout_s=a.batch_timeout,
        max_retries=a.max_retries,
        interactive_queue_timeout_s=a.interactive_queue_timeout,
        batch_queue_timeout_frac=a.batch_queue_frac,
        queue_bound=a.queue_bound,
        cb_pending_s=a.cb_pending_s,
        concurrency=a.concurrency,
        model_requests=a.model_requests,
        live_capacity_s=a.live_capacity_s,
        max_lag_s=a.max_lag_s,
        traces_dir=a.traces_dir,
        out_dir=a.out,
    )
    return opts, not a.no_plots


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    opts, plots = parse_args(argv)
    args = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["python -m bench.compare", *args])
    # SIGTERM unwinds like Ctrl-C, so every Stack's __exit__ stops its processes.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        compare(opts, plots=plots, command=command)
    except KeyboardInterrupt:
        print("\ninterrupted; all processes stopped.", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
