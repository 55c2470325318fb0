"""The comparison's pictures: goodput and latency against offered load (steady) and each
scenario over time (the outputs listed in :mod:`bench.compare`), from :mod:`.measure`'s figures and
the runs' records and samples. matplotlib is imported only when a plot is drawn."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from bench.load.summary import LoadResult

from .capacity import Capacity
from .measure import SLO_TTFT_S, WINDOW_S, RunSummary, Sample, Window, ttft_windows
from .options import KNOWN_STRATEGIES, Options

__all__ = ["COLORS", "plot"]

COLORS: Final = {
    "direct": "tab:red",
    "envoy-cb-default": "tab:brown",
    "envoy-cb": "tab:orange",
    "envoy-adaptive": "tab:purple",
    "priority-gateway": "tab:green",
    "sidecar-static": "tab:cyan",
    "sidecar": "tab:blue",
    "sidecar-fair": "navy",
    "replicas-shared": "tab:olive",
    "replicas-shared-fair": "darkolivegreen",
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
    timeline_<scenario>.png for each other scenario but the noisy neighbour (its figures are per
    tenant, in tables). ``results`` and ``samples`` are keyed by (run key, strategy)."""
    import matplotlib

    matplotlib.use("Agg")
    paths: list[Path] = []
    steady = [r for r in rows if r.scenario == "steady"]
    if steady:
        paths += _plot_steady(steady, results, cap, opts, out_dir)
    for scenario in dict.fromkeys(
        r.scenario for r in rows if r.scenario not in ("steady", "noisy")
    ):
        paths.append(
            _plot_timeline(
                scenario, [r for r in rows if r.scenario == scenario], results, samples, out_dir
            )
        )
    return paths


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
    axes[3].axhline(SLO_TTFT_S, color="grey", ls="--", lw=1, label="2 s target")
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
                ax.axvline(SLO_TTFT_S, color="grey", ls=":", lw=1)
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
    axes[0].axhline(SLO_TTFT_S, color="grey", ls="--", lw=1)
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
