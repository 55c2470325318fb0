"""The report layer: the figures of :mod:`.measure` as tables (per strategy and run, the
admission events, the scenarios' figures) and as PASS or
MISS against the targets the ``sidecar`` strategy (the adaptive pool) is held to.

The targets and their latest verdicts: docs/benchmarks.md, "Issue 20: where each target stands"
(the pool benchmark's own, after the first table). At loads <= 1x, "nobody refused who would
be served in time" means both: at most 1 % of the requests resolved in the window end refused
(a final 429 or 5xx, after the client's retries), and at least as many good answers as
``direct`` in the same window. Context lines (``primary=False``) read a target another way
(p99 TTFT from the original arrival, retries included); the other strategies' recovery and
settle figures are in the scenario table, not here.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from bench.common.table import fmt, format_table

from .measure import SLO_TTFT_S, RunSummary, Sample
from .options import SIDECAR_STRATEGIES

__all__ = [
    "TargetCheck",
    "check_targets",
    "format_admission",
    "format_runs",
    "format_scenarios",
    "format_targets",
    "pct",
]


def pct(x: float | None) -> str:
    """A share as a percentage with one decimal, ``-`` when there is none."""
    return "-" if x is None else f"{100 * x:.1f}%"


# --------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------

HELD: Final = "sidecar"
TTFT_TARGET_S: Final = SLO_TTFT_S
WASTE_TARGET: Final = 0.02
SLO_VS_OTHERS: Final = 1.5
REFUSED_AT_LOW_LOAD: Final = 0.01
SETTLE_S: Final = 30.0
IDLE_USE: Final = 0.9
SHIFT_RECOVERY_S: Final = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetCheck:
    """One target on one run of a scenario."""

    name: str
    scenario: str
    label: str  # "2x" or the scenario's name
    value: float | None
    threshold: float | None
    passed: bool
    detail: str
    primary: bool = True


def _best_other(
    others: Sequence[RunSummary], get: Callable[[RunSummary], float]
) -> tuple[float, str]:
    best = max(others, key=get)
    return get(best), best.strategy


class _Checks(list[TargetCheck]):
    """The checks of one run of the held strategy."""

    def __init__(self, side: RunSummary) -> None:
        super().__init__()
        self.side = side

    def add(
        self,
        name: str,
        value: float | None,
        threshold: float | None,
        passed: bool,
        detail: str,
        *,
        primary: bool = True,
    ) -> None:
        self.append(
            TargetCheck(
                name=name,
                scenario=self.side.scenario,
                label=self.side.label,
                value=value,
                threshold=threshold,
                passed=passed,
                detail=detail,
                primary=primary,
            )
        )


def _steady(side: RunSummary, rows: Sequence[RunSummary]) -> list[TargetCheck]:
    others = [r for r in rows if r.strategy != HELD]
    out = _Checks(side)
    check = out.add

    if side.load >= 2.0:
        readings: tuple[tuple[str, str, Callable[[RunSummary], float]], ...] = (
            ("good req/s", "req/s", lambda r: r.overall.goodput_rps),
            ("good tok/s", "tok/s", lambda r: r.overall.goodput_tokens_per_s),
        )
        if others:
            for name, unit, get in readings:
                best, who = _best_other(others, get)
                check(
                    f"{name} above every other",
                    get(side),
                    best,
                    get(side) > best,
                    f"{get(side):.2f} vs {best:.2f} {unit} ({who})",
                )
            best, who = _best_other(others, lambda r: r.slo_goodput_rps)
            need = SLO_VS_OTHERS * best
            check(
                "SLO goodput >= 1.5x every other",
                side.slo_goodput_rps,
                need,
                side.slo_goodput_rps >= need,
                f"{side.slo_goodput_rps:.2f} vs 1.5 x {best:.2f} ({who}) = {need:.2f} req/s",
            )
        first = side.ttft_p99_first_attempt_s
        check(
            "interactive p99 TTFT < 2 s (first attempts)",
            first,
            TTFT_TARGET_S,
            first is not None and first < TTFT_TARGET_S,
            f"{fmt(first)} s",
        )
        whole = side.ttft_p99_s
        check(
            "interactive p99 TTFT < 2 s (from arrival)",
            whole,
            TTFT_TARGET_S,
            whole is not None and whole < TTFT_TARGET_S,
            f"{fmt(whole)} s",
            primary=False,
        )
        waste = side.wasted_frac
        check(
            "wasted work < 2%",
            waste,
            WASTE_TARGET,
            waste is not None and waste < WASTE_TARGET,
            f"{pct(waste)} of generated tokens",
        )
    if side.load <= 1.0:
        direct = next((r for r in rows if r.strategy == "direct"), None)
        ok_refused = side.refused_frac <= REFUSED_AT_LOW_LOAD
        ok_good = direct is None or side.overall.good >= direct.overall.good
        vs = "" if direct is None else f", good {side.overall.good} vs direct {direct.overall.good}"
        check(
            "nobody refused who would be served in time",
            side.refused_frac,
            REFUSED_AT_LOW_LOAD,
            ok_refused and ok_good,
            f"refused {pct(side.refused_frac)} (<= 1%){vs}",
        )
    return list(out)


def check_targets(rows: Sequence[RunSummary]) -> list[TargetCheck]:
    """Every target whose runs are there (see the module docstring)."""
    groups: dict[tuple[str, str], list[RunSummary]] = {}
    for r in rows:
        groups.setdefault((r.scenario, r.label), []).append(r)
    checks: list[TargetCheck] = []
    for (scenario, _label), group in groups.items():
        side = next((r for r in group if r.strategy == HELD), None)
        if side is None:
            continue
        f = side.scenario_figures
        out = _Checks(side)
        check = out.add
        if scenario == "steady":
            checks.extend(_steady(side, group))
        elif scenario == "halve":
            settle = f.get("limit_settle_s")
            check(
                "pool limit settles within 30 s",
                settle,
                SETTLE_S,
                settle is not None and settle <= SETTLE_S,
                "no llm_extproc_pool_limit samples"
                if f.get("limit_final") is None
                else f"{fmt(settle, 1)} s after the change, {fmt(f.get('limit_before'), 0)} -> "
                f"{fmt(f.get('limit_final'), 0)}",
            )
            rec = f.get("recovery_s")
            check(
                "interactive p99 TTFT < 2 s again",
                rec,
                None,
                rec is not None,
                "never" if rec is None else f"{rec:.0f} s after the change",
            )
        elif scenario == "shift":
            use = f.get("idle_use")
            check(
                "batch uses >= 90% of idle capacity",
                use,
                IDLE_USE,
                use is not None and use >= IDLE_USE,
                f"{pct(use)} of batch's saturation tokens/s (engine busy "
                f"{pct(f.get('busy_frac'))})",
            )
            rec = f.get("recovery_s")
            check(
                "interactive p99 TTFT < 2 s within 10 s of burst",
                rec,
                SHIFT_RECOVERY_S,
                rec is not None and rec <= SHIFT_RECOVERY_S,
                "never" if rec is None else f"{rec:.0f} s after the burst began",
            )
        checks.extend(out)
    return checks


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


RUN_HEADERS: Final = (
    "run", "strategy", "offer/s", "good/s", "xdirect", "tok/s", "slo/s", "ttft99i", "1st99i",
    "e2e99i", "e2e99b", "good", "late", "429", "5xx", "tmo", "oth", "waste", "peak", "lag",
)  # fmt: skip
RUN_LEGEND: Final = (
    "run: the steady load (x capacity) or the scenario; good/s: complete 200s within the client "
    "timeout per second; xdirect: good/s over direct's; tok/s: their output tokens per second;\n"
    "slo/s: SLO goodput, good answers whose first token (interactive) came within 2 s of the "
    "original arrival, per second;\nttft99i: interactive p99 TTFT from "
    "the original arrival (retries included); 1st99i: the same over requests answered at "
    "their first attempt;\ne2e99i/b: p99 end to end of answered requests per class; shares "
    "of final outcomes: good, late (200 after the client's timeout), 429, 5xx, tmo (the "
    "client gave up), oth (4xx, connection errors);\nwaste: tokens generated for requests "
    "aborted by their client / all generated (simulator counters, from the start of the run "
    "to the end of the window); peak: the most requests running in the backend at once "
    "(polled every 0.5 s wall, whole run); lag: worst simulator / load-generator lag, ! = above "
    "1 s"
)


def _run_row(r: RunSummary) -> list[str]:
    o = r.overall.outcomes
    lag = max(r.loadgen_lag_s_max, r.sim_lag_s_max or 0.0)
    e2e = {c: s.e2e_p99_s for c, s in r.per_class.items()}
    return [
        r.label,  # the steady load, or the scenario's name (noisy: flood or not, the seed)
        r.strategy,
        f"{r.offered_rps:.2f}",
        f"{r.goodput_rps:.2f}",
        fmt(r.ratio_to_direct),
        f"{r.overall.goodput_tokens_per_s:.0f}",
        f"{r.slo_goodput_rps:.2f}",
        fmt(r.ttft_p99_s),
        fmt(r.ttft_p99_first_attempt_s),
        fmt(e2e.get("interactive"), 1),
        fmt(e2e.get("batch"), 1),
        *(f"{100 * o[k]:.0f}%" for k in ("good", "late", "429", "5xx", "timeout")),
        f"{100 * (o['4xx'] + o['other']):.0f}%",
        pct(r.wasted_frac),
        fmt(r.in_flight_peak, 0),
        f"{lag:.2f}" + (" " if r.harness_ok else "!"),  # the blank keeps the decimals aligned
    ]


def format_runs(rows: Sequence[RunSummary]) -> str:
    """One row per strategy and run (a blank line between runs), then the legend."""
    w0, w1 = rows[0].window_s if rows else (0.0, 0.0)
    cells: list[list[str]] = []
    for i, r in enumerate(rows):
        if i and (r.scenario, r.label) != (rows[i - 1].scenario, rows[i - 1].label):
            cells.append([""] * len(RUN_HEADERS))
        cells.append(_run_row(r))
    return "\n".join(
        [
            f"per strategy and run, over the window [{w0:g} s, {w1:g} s) (simulated seconds; "
            "requests counted when their final outcome falls in the window):",
            format_table(RUN_HEADERS, cells),
            RUN_LEGEND,
        ]
    )


def _admission_text(r: RunSummary) -> str:
    a = r.admission

    def n(key: str) -> int:
        return int(a.get(key, 0))

    if r.strategy in SIDECAR_STRATEGIES:
        # Every outcome the sidecar counted, summed over its buckets (and replicas), admitted
        # first.
        outcomes: dict[str, int] = {}
        for k, v in a.items():
            if "/" in k:
                outcome = k.split("/", 1)[1]
                outcomes[outcome] = outcomes.get(outcome, 0) + int(v)
        admitted = outcomes.pop("admitted", 0)
        rest = ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()) if v)
        relegated = {k.split(" ", 1)[1]: int(v) for k, v in a.items() if k.startswith("relegated ")}
        ends = ", ".join(f"{k} {v}" for k, v in sorted(relegated.items()) if v)
        return (
            f"admitted {admitted}"
            + (f", {rest}" if rest else "")
            + (f"; of them relegated: {ends}" if ends else "")
        )
    if r.strategy == "priority-gateway":
        return (
            f"admitted {n('admitted')} ({n('admitted_short')} short), 503 expired at dequeue "
            f"{n('expired')}, 503 queue full {n('rejected_full')}, left while queued "
            f"{n('cancelled_queued')}"
        )
    if r.strategy.startswith("envoy-"):
        text = (
            f"to backend {n('upstream_rq_total')}, queued in Envoy "
            f"{n('upstream_rq_pending_total')}, 503 overflow {n('upstream_rq_pending_overflow')}, "
            f"left while queued {n('upstream_rq_cancelled')}"
        )
        if r.strategy == "envoy-adaptive":
            text += f", 503 blocked by the filter {n('adaptive.rq_blocked')}"
        return text
    return "no admission control (simulator FCFS queue)"


def format_admission(rows: Sequence[RunSummary]) -> str:
    """Attempt-level counters: who refused what."""
    lines = [
        "admission events over the window (attempts, retries included; attempts = those of the "
        "requests resolved in the window):"
    ]
    lines.extend(
        f"{r.label:>6} {r.strategy:<16} attempts {r.overall.attempts:>6}: {_admission_text(r)}"
        for r in rows
    )
    return "\n".join(lines)


SCENARIO_HEADERS: Final = (
    "scenario", "strategy", "recover_s", "settle_s", "limit", "idle_use", "busy",
)  # fmt: skip


def format_scenarios(rows: Sequence[RunSummary]) -> str:
    """The time-varying scenarios' figures (see bench.compare.scenarios); empty without any."""
    cells = []
    for r in rows:
        if r.scenario in ("steady", "noisy"):  # noisy: its figures are per tenant (.noisy)
            continue
        f = r.scenario_figures
        limit = "-"
        if f.get("limit_final") is not None:
            limit = f"{fmt(f.get('limit_before'), 0)}->{fmt(f.get('limit_final'), 0)}"
        cells.append(
            [
                r.scenario,
                r.strategy,
                fmt(f.get("recovery_s"), 0, none="never" if "recovery_s" in f else "-"),
                fmt(f.get("limit_settle_s"), 0),
                limit,
                pct(f.get("idle_use")),
                pct(f.get("busy_frac")),
            ]
        )
    if not cells:
        return ""
    return "\n".join(
        [
            "scenarios (simulated seconds): recover_s: from the burst (shift), the change (halve) "
            "or the spike's end until interactive p99 TTFT in 10 s windows stays under 2 s; "
            "settle_s: until the limit stays within 20 % of its final value; limit: median "
            "before the change -> final; idle_use: batch's answered tokens per second while "
            "interactive is quiet, of batch's saturation tokens/s; busy: the engine's busy "
            "share then",
            format_table(SCENARIO_HEADERS, cells),
        ]
    )


ENGINE_HEADERS: Final = (
    "run", "strategy", "ttft50i", "ttft99i", "e2e50i", "e2e99i", "running", "waiting", "limit",
)  # fmt: skip


def _spread(values: Sequence[float]) -> str:
    return f"{statistics.fmean(values):.1f} [{min(values):g}-{max(values):g}]" if values else "-"


def format_engine(
    rows: Sequence[RunSummary], timelines: Mapping[tuple[str, str], Sequence[Sample]]
) -> str:
    """``--backend vllm-cpu``, in place of the targets (steady runs only)."""
    cells = []
    for r in rows:
        i, (w0, w1) = r.per_class["interactive"], r.window_s
        ss = [x for x in timelines.get((f"steady-{r.label}", r.strategy), ()) if w0 <= x.t_s < w1]
        cells.append(
            [
                r.label,
                r.strategy,
                *(fmt(x) for x in (i.ttft_p50_s, i.ttft_p99_s, i.e2e_p50_s, i.e2e_p99_s)),
                _spread([x.running for x in ss]),
                _spread([x.waiting for x in ss]),
                _spread([x.limit for x in ss if x.limit is not None]),
            ]
        )
    return (
        "the real engine, no targets: interactive TTFT and end to end at p50 and p99 (s, from "
        "the original arrival); vLLM's own batch (running) and queue (waiting), and the "
        "sidecar's pool limit: mean [min-max] of the samples in the window\n"
        + format_table(ENGINE_HEADERS, cells)
    )


def format_targets(checks: Sequence[TargetCheck], noisy_held: str = "sidecar-fair") -> str:
    """The checks, one a line, under a header that names the strategies they were read on
    (``noisy_held``: the noisy neighbour's, :func:`.noisy.held_strategy`)."""
    lines = [
        f"targets (sidecar; noisy: {noisy_held}; indented: the same target read another way, "
        "for context):"
    ]
    lines.extend(
        f"{'  ' if c.primary else '      '}{'PASS' if c.passed else 'MISS'}  "
        f"{c.label:>6}  {c.name:<46} {c.detail}"
        for c in checks
    )
    return "\n".join(lines)
