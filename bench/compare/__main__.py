"""``python -m bench.compare``: the whole comparison (see :mod:`bench.compare`) and its CLI."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from types import FrameType
from typing import Any

from bench.load.summary import LoadResult, RequestRecord
from bench.sim.profiles import PROFILES

from .capacity import determine_capacity, live_capacity
from .options import STRATEGIES, Options, Strategy
from .report import format_admission, format_runs, format_targets, plot
from .run import run_one
from .strategies import envoy_breakers, sidecar_policy
from .summary import RunSummary, pct
from .targets import check_targets


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
                f"good {summary.goodput_rps:.2f} req/s, waste {pct(summary.wasted_frac)}, "
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
    print(format_runs(rows))
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
