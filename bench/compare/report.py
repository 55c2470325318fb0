"""What a comparison prints and draws: the table per strategy and run, the admission events,
the replica strategies side by side, the scenarios' figures, the target checks, and the
plots."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from bench.common.table import fmt, format_table
from bench.load.summary import LoadResult

from .capacity import Capacity
from .options import KNOWN_STRATEGIES, REPLICA_STRATEGIES, SIDECAR_STRATEGIES, Options
from .strategies import replica_limits
from .summary import RunSummary, Window, pct
from .targets import TTFT_TARGET_S, TargetCheck
from .timeline import WINDOW_S, Sample, ttft_windows

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
    "--max-lag-s"
)


def _run_row(r: RunSummary) -> list[str]:
    o = r.overall.outcomes
    lag = max(r.loadgen_lag_s_max, r.sim_lag_s_max or 0.0)
    e2e = {c: s.e2e_p99_s for c, s in r.per_class.items()}
    return [
        r.label if r.scenario == "steady" else r.scenario,
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
        return f"admitted {admitted}" + (f", {rest}" if rest else "")
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


REPLICA_HEADERS: Final = (
    "run", "strategy", "limit", "good/s", "slo/s", "1st99i", "ttft99i", "peak", "peak/C",
    "mean", "held", "429", "5xx", "tmo", "waste", "lag",
)  # fmt: skip


def format_replicas(rows: Sequence[RunSummary], cap: Capacity, opts: Options) -> str:
    """The replica strategies side by side (empty without any): goodput, interactive p99 TTFT
    of first attempts, and the backend's peak of requests running against C."""
    limits = {
        s: f"{cap.concurrency} shared"
        if s == "replicas-shared"
        else "+".join(str(n) for n in replica_limits(s, cap, opts))
        for s in REPLICA_STRATEGIES
    }
    cells = []
    for r in rows:
        if r.strategy not in REPLICA_STRATEGIES:
            continue
        o = r.overall.outcomes
        f = r.in_flight
        peak = r.in_flight_peak
        lag = max(r.loadgen_lag_s_max, r.sim_lag_s_max or 0.0)
        cells.append(
            [
                r.label if r.scenario == "steady" else r.scenario,
                r.strategy,
                limits[r.strategy],
                f"{r.goodput_rps:.2f}",
                f"{r.slo_goodput_rps:.2f}",
                fmt(r.ttft_p99_first_attempt_s),
                fmt(r.ttft_p99_s),
                fmt(peak, 0),
                "-" if peak is None else f"{peak / cap.concurrency:.2f}",
                fmt(f.running_mean_window if f is not None else None, 1),
                fmt(f.held_peak if f is not None else None, 0),
                *(f"{100 * o[k]:.0f}%" for k in ("429", "5xx", "timeout")),
                pct(r.wasted_frac),
                f"{lag:.2f}" + (" " if r.harness_ok else "!"),
            ]
        )
    if not cells:
        return ""
    return "\n".join(
        [
            f"{opts.replicas} replicas (Envoy + sidecar each) in front of one simulator, requests "
            f"spread round robin over them; C = {cap.concurrency}:",
            format_table(REPLICA_HEADERS, cells),
            "limit: the replicas' pools; 1st99i: interactive p99 TTFT of requests answered at "
            "their first attempt (ttft99i: from the original arrival, retries included); peak: "
            "the most requests running in the backend at once (/sim/stats, polled every 0.5 s "
            "wall, whole run), peak/C: against the pool's limit; mean: running, over the "
            "window; held: the most running + waiting (the simulator's own queue) at one poll, "
            "everything the replicas let through; 429/5xx/tmo: shares of final outcomes",
        ]
    )


SCENARIO_HEADERS: Final = (
    "scenario", "strategy", "recover_s", "settle_s", "limit", "idle_use", "busy",
)  # fmt: skip


def format_scenarios(rows: Sequence[RunSummary]) -> str:
    """The time-varying scenarios' figures (see bench.compare.scenarios); empty without any."""
    cells = []
    for r in rows:
        if r.scenario == "steady":
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


def format_targets(checks: Sequence[TargetCheck]) -> str:
    lines = ["targets (sidecar; indented: the same target read another way, for context):"]
    lines.extend(
        f"{'  ' if c.primary else '      '}{'PASS' if c.passed else 'MISS'}  "
        f"{c.label if c.scenario == 'steady' else c.scenario:>6}  {c.name:<46} {c.detail}"
        for c in checks
    )
    return "\n".join(lines)


COLORS: Final = {
    "direct": "tab:red",
    "envoy-cb-default": "tab:brown",
    "envoy-cb": "tab:orange",
    "envoy-adaptive": "tab:purple",
    "priority-gateway": "tab:green",
    "sidecar-static": "tab:cyan",
    "sidecar": "tab:blue",
    "replicas-shared": "tab:olive",
    "replicas-full": "tab:pink",
    "replicas-split": "tab:gray",
}


def plot(
    rows: Sequence[RunSummary],
    results: Mapping[tuple[str, str], LoadResult],
    samples: Mapping[tuple[str, str], Sequence[Sample]],
    cap: Capacity,
    opts: Options,
    out_dir: Path,
) -> list[Path]:
    """goodput.png and latency_cdf.png for the steady runs (requests resolved in the window),
    timeline_<scenario>.png for each other scenario. ``results`` and ``samples`` are keyed by
    (run key, strategy)."""
    import matplotlib

    matplotlib.use("Agg")
    paths: list[Path] = []
    steady = [r for r in rows if r.scenario == "steady"]
    if steady:
        paths += _plot_steady(steady, results, cap, opts, out_dir)
    for scenario in dict.fromkeys(r.scenario for r in rows if r.scenario != "steady"):
        paths.append(
            _plot_timeline(
                scenario, [r for r in rows if r.scenario == scenario], results, samples, out_dir
            )
        )
    return paths


def _key(r: RunSummary) -> str:
    return f"steady-{r.label}" if r.scenario == "steady" else r.scenario


def _plot_steady(
    rows: Sequence[RunSummary],
    results: Mapping[tuple[str, str], LoadResult],
    cap: Capacity,
    opts: Options,
    out_dir: Path,
) -> list[Path]:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    window = Window(start_s=opts.warmup_s, end_s=opts.duration_s)
    strategies = [s for s in KNOWN_STRATEGIES if any(r.strategy == s for r in rows)]
    labels = list(dict.fromkeys(r.label for r in sorted(rows, key=lambda r: r.load)))
    paths: list[Path] = []

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    for s in strategies:
        rs = sorted((r for r in rows if r.strategy == s), key=lambda r: r.load)
        x = [r.offered_rps for r in rs]
        c = COLORS[s]
        axes[0].plot(x, [r.goodput_rps for r in rs], "o-", color=c, label=s)
        axes[1].plot(x, [r.overall.goodput_tokens_per_s for r in rs], "o-", color=c, label=s)
        axes[2].plot(x, [r.slo_goodput_rps for r in rs], "o-", color=c, label=s)
        axes[3].plot(x, [r.ttft_p99_s or math.nan for r in rs], "o-", color=c, label=s)
    for ax in axes[:3]:
        ax.axvline(cap.capacity_rps, color="grey", ls=":", lw=1)
    axes[0].axhline(cap.capacity_rps, color="grey", ls=":", lw=1, label="capacity")
    axes[0].set_ylabel("goodput, req/s (good = complete within timeout)")
    axes[1].set_ylabel("goodput, output tokens/s")
    axes[2].set_ylabel("SLO goodput, req/s (interactive TTFT <= 2 s)")
    axes[3].axhline(TTFT_TARGET_S, color="grey", ls="--", lw=1, label="2 s target")
    axes[3].set_yscale("log")
    axes[3].set_ylabel("interactive p99 TTFT, s (from arrival)")
    for ax in axes:
        ax.set_xlabel("offered load, req/s (simulated)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"{opts.profile} simulator, {opts.mix} mix, capacity {cap.capacity_rps:.2f} req/s, "
        f"C={cap.concurrency}; loads {', '.join(labels)}"
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
        len(panels), len(labels), figsize=(4 * len(labels), 3.2 * len(panels)), squeeze=False
    )
    for row, (cls, metric, title, timeout) in enumerate(panels):
        for col, label in enumerate(labels):
            ax = axes[row][col]
            for s in strategies:
                res = results.get((f"steady-{label}", s))
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
                ax.step(vals, ys, where="post", color=COLORS[s], label=s)
            ax.axvline(timeout, color="grey", ls="--", lw=1)
            if metric == "ttft":
                ax.axvline(TTFT_TARGET_S, color="grey", ls=":", lw=1)
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            ax.set_title(f"{title}, {label}", fontsize=9)
            if col == 0:
                ax.set_ylabel("share answered (200) within t")
            if row == len(panels) - 1:
                ax.set_xlabel("t, simulated s")
            if row == 0 and col == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "latency_cdf.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(path)
    return paths


def _plot_timeline(
    scenario: str,
    rows: Sequence[RunSummary],
    results: Mapping[tuple[str, str], LoadResult],
    samples: Mapping[tuple[str, str], Sequence[Sample]],
    out_dir: Path,
) -> Path:
    """Per strategy over time: interactive p99 TTFT in 10 s windows (by arrival), requests
    running in the backend, and the limit where the strategy has one."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    for r in rows:
        c = COLORS.get(r.strategy, "black")
        res = results.get((scenario, r.strategy))
        if res is not None:
            wins = ttft_windows(res.records, start_s=0.0, end_s=max(r.window_s[1], WINDOW_S))
            axes[0].plot(
                [w.start_s + WINDOW_S / 2 for w in wins],
                [w.p99_s if w.p99_s is not None else math.nan for w in wins],
                color=c,
                label=r.strategy,
            )
        ss = samples.get((scenario, r.strategy), ())
        axes[1].plot([x.t_s for x in ss], [x.running for x in ss], color=c, label=r.strategy)
        lim = [(x.t_s, x.limit) for x in ss if x.limit is not None]
        if lim:
            axes[2].plot([t for t, _ in lim], [v for _, v in lim], color=c, label=r.strategy)
    axes[0].axhline(TTFT_TARGET_S, color="grey", ls="--", lw=1)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("interactive p99 TTFT, s\n(10 s windows, by arrival)")
    axes[1].set_ylabel("running in the backend")
    axes[2].set_ylabel("limit (pool / adaptive)")
    axes[2].set_xlabel("t, simulated s from the start of the arrivals")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"scenario {scenario}")
    fig.tight_layout()
    path = out_dir / f"timeline_{scenario}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
