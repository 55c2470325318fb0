"""What a comparison prints and draws: the table per strategy and load, the admission events,
the target checks, and the plots."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from bench.common.table import fmt, format_table
from bench.load.summary import LoadResult

from .capacity import Capacity
from .options import STRATEGIES, Options
from .summary import RunSummary, Window, pct
from .targets import TTFT_TARGET_S, TargetCheck

RUN_HEADERS: Final = (
    "load", "strategy", "offer/s", "good/s", "xdirect", "tok/s", "ttft99i", "1st99i", "e2e99i",
    "e2e99b", "good", "late", "429", "5xx", "tmo", "oth", "waste", "lag",
)  # fmt: skip
RUN_LEGEND: Final = (
    "good/s: complete 200s within the client timeout per second; xdirect: good/s over "
    "direct's; tok/s: their output tokens per second;\nttft99i: interactive p99 TTFT from "
    "the original arrival (retries included); 1st99i: the same over requests answered at "
    "their first attempt;\ne2e99i/b: p99 end to end of answered requests per class; shares "
    "of final outcomes: good, late (200 after the client's timeout), 429, 5xx, tmo (the "
    "client gave up), oth (4xx, connection errors);\nwaste: tokens generated for requests "
    "aborted by their client / all generated (simulator counters, from the start of the run "
    "to the end of the window); lag: worst simulator / load-generator lag, ! = above "
    "--max-lag-s"
)


def _run_row(r: RunSummary) -> list[str]:
    o = r.overall.outcomes
    lag = max(r.loadgen_lag_s_max, r.sim_lag_s_max or 0.0)
    e2e = {c: s.e2e_p99_s for c, s in r.per_class.items()}
    return [
        f"{r.load:g}x",
        r.strategy,
        f"{r.offered_rps:.2f}",
        f"{r.goodput_rps:.2f}",
        fmt(r.ratio_to_direct),
        f"{r.overall.goodput_tokens_per_s:.0f}",
        fmt(r.ttft_p99_s),
        fmt(r.ttft_p99_first_attempt_s),
        fmt(e2e.get("interactive"), 1),
        fmt(e2e.get("batch"), 1),
        *(f"{100 * o[k]:.0f}%" for k in ("good", "late", "429", "5xx", "timeout")),
        f"{100 * (o['4xx'] + o['other']):.0f}%",
        pct(r.wasted_frac),
        f"{lag:.2f}" + (" " if r.harness_ok else "!"),  # the blank keeps the decimals aligned
    ]


def format_runs(rows: Sequence[RunSummary]) -> str:
    """One row per strategy and load (a blank line between loads), then the legend."""
    w0, w1 = rows[0].window_s if rows else (0.0, 0.0)
    cells: list[list[str]] = []
    for i, r in enumerate(rows):
        if i and r.load != rows[i - 1].load:
            cells.append([""] * len(RUN_HEADERS))
        cells.append(_run_row(r))
    return "\n".join(
        [
            f"per strategy and offered load, over the window [{w0:g} s, {w1:g} s) (simulated "
            "seconds; requests counted when their final outcome falls in the window):",
            format_table(RUN_HEADERS, cells),
            RUN_LEGEND,
        ]
    )


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
