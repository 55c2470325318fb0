"""``python -m bench.compare``: the pure parts (capacity model, scenario schedules, SLO goodput,
recovery and settle times, targets) on synthetic data, the strategies' configurations checked
by the real Envoy, then two small end-to-end runs with the real simulator, Envoy (plain, with
the adaptive_concurrency filter, with ext_proc), the priority gateway and the sidecar, a few
simulated seconds at a high speedup. The end-to-end runs check shape and sanity, not figures
(that is the full run's job, see docs/benchmarks.md)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.compare.__main__ import main, parse_args
from bench.compare.baselines import (
    ADAPTIVE_CONCURRENCY_FILTER,
    adaptive_concurrency,
    envoy_breakers,
    envoy_default_breakers,
    gateway_thresholds,
)
from bench.compare.capacity import Capacity, closed_loop, determine_capacity, workload_mix
from bench.compare.deploy import policy_envoy_patch, with_http_filter
from bench.compare.measure import (
    ClassStats,
    RunSummary,
    Sample,
    Window,
    idle_capacity_use,
    limit_settle_s,
    meets_slo,
    recovery_s,
    slo_goodput_rps,
    ttft_windows,
)
from bench.compare.options import Options
from bench.compare.report import check_targets
from bench.compare.scenarios import plan
from bench.compare.strategies import pool_policy, sidecar_policy, slot_split
from bench.load.summary import Outcome, RequestRecord
from bench.load.workload import build_schedule
from extproc.config.envoy import extproc_streams
from extproc.config.policy import Order, policy_from_yaml
from extproc.contract import LLM_PATHS
from testing.envoy import envoy_validate, hcm_config, render_envoy_config

OPTS = Options(model_requests=1500)


@pytest.fixture(scope="module")
def cap() -> Capacity:
    return determine_capacity(OPTS, log=False)


def test_capacity_model_and_derived_settings(cap: Capacity) -> None:
    mix = workload_mix(OPTS)
    assert len(mix) > 1400 and {r.cls for r in mix} == {"interactive", "batch"}
    low, high = closed_loop(OPTS.engine, mix, 16), closed_loop(OPTS.engine, mix, 128)
    assert 0 < low.throughput_rps < high.throughput_rps  # batching pays
    assert 0 < low.tokens_per_s < high.tokens_per_s
    assert cap.capacity_rps >= cap.at_concurrency.throughput_rps > 0
    assert cap.concurrency % 8 == 0 and 8 <= cap.concurrency <= OPTS.engine.max_num_seqs
    assert (
        set(cap.class_capacity_rps)
        == set(cap.class_capacity_tokens_s)
        == {
            "interactive",
            "batch",
        }
    )
    assert all(v > 0 for v in cap.class_capacity_tokens_s.values())
    slots = slot_split(cap)
    assert sum(slots.values()) == cap.concurrency and min(slots.values()) >= 1
    # The generated policy is one the sidecar accepts, with the deadlines scaled to wall time.
    policy = policy_from_yaml(sidecar_policy(cap, OPTS), source="generated")
    by_name = {b.name: b for b in policy.buckets}
    assert by_name["interactive"].max_concurrency == slots["interactive"]
    assert by_name["interactive"].queue_timeout_s == pytest.approx(1.0 / OPTS.speedup, abs=1e-3)
    assert by_name["batch"].queue_timeout_s == pytest.approx(240.0 / OPTS.speedup)
    breakers = envoy_breakers(cap, OPTS)
    assert breakers["max_requests"] == breakers["max_connections"] == cap.concurrency
    default = envoy_default_breakers(cap, OPTS)
    assert default["max_requests"] == default["max_connections"] == 256
    assert default["max_pending_requests"] == breakers["max_pending_requests"]
    prompt, output = gateway_thresholds(OPTS)
    assert 0 < sum(r.prompt_tokens < prompt and r.output_tokens < output for r in mix) < len(mix)


def test_pool_policy_timers_scaled_slos_not(cap: Capacity) -> None:
    policy = policy_from_yaml(pool_policy(cap, OPTS, ["http://127.0.0.1:9/metrics"]), "generated")
    assert policy.pool is not None and policy.pool.adaptive is not None
    a = policy.pool.adaptive
    assert policy.pool.max_concurrency == cap.concurrency  # the static fallback only
    assert (a.min_limit, a.max_limit, a.initial) == (8, 256, 32)
    assert a.interval_s == pytest.approx(0.5 / OPTS.speedup, abs=1e-3)  # whole ms
    assert a.window_s == pytest.approx(10 / OPTS.speedup, abs=1e-3)
    assert a.slo_s == {"ttft": 1.0, "itl": 0.1}  # the simulator's histograms: simulated s
    assert policy.backend.metrics == ("http://127.0.0.1:9/metrics",)
    b = {x.name: x for x in policy.buckets}
    assert (b["interactive"].priority, b["interactive"].min_share) == (0, 0.5)
    assert [x.name for x in policy.buckets] == ["interactive-retry", "interactive", "batch"]
    retry = b["interactive-retry"]
    assert (retry.priority, retry.match.retried) == (1, True)  # behind first attempts
    assert retry.match.headers == b["interactive"].match.headers
    assert all(x.order is Order.COST for x in policy.buckets)
    assert (b["batch"].priority, b["batch"].max_share) == (10, 0.9)
    assert b["batch"].min_share == 0.0  # by default, no guaranteed share
    assert b["batch"].queue_timeout_s == pytest.approx(240 / OPTS.speedup, abs=1e-3)
    assert all(x.relegate_to is None for x in policy.buckets)  # by default, 429 at the deadline
    opts = parse_args(["--batch-min-share", "0.1", "--relegate"])
    shared = policy_from_yaml(pool_policy(cap, opts, ["http://127.0.0.1:9/metrics"]), "generated")
    assert {x.name: x.min_share for x in shared.buckets}["batch"] == 0.1
    assert {x.name: x.relegate_to for x in shared.buckets}["interactive"] == "interactive-retry"
    assert "queue_time" not in a.slo_s  # by default, time to first token only
    for choice, ttft, queue in (("queue_time", None, 0.3), ("both", 1.0, 0.3)):
        opts = parse_args(["--admission-objective", choice, "--queue-time-ms", "300"])
        generated = policy_from_yaml(pool_policy(cap, opts, ["http://127.0.0.1:9/m"]), "generated")
        assert generated.pool is not None and generated.pool.adaptive is not None
        got = generated.pool.adaptive
        assert (got.slo_s.get("ttft"), got.slo_s.get("queue_time")) == (ttft, queue)
        assert got.quantiles["queue_time"] == 0.9


def _envoy(**kwargs: Any) -> dict[str, Any]:
    cfg = yaml.safe_load(
        render_envoy_config(listener_port=1, backend_port=2, extproc_port=3, admin_port=4, **kwargs)
    )
    assert isinstance(cfg, dict)
    return cfg


def test_envoy_cb_config_has_no_ext_proc() -> None:
    text = render_envoy_config(
        listener_port=1,
        backend_port=2,
        extproc_port=3,
        admin_port=4,
        ext_proc=False,
        backend_circuit_breakers={"max_requests": 8, "max_pending_requests": 2},
    )
    assert "ext_proc" not in text  # no filter, no per-route setting
    cfg = yaml.safe_load(text)
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    assert set(clusters) == {"backend"}
    assert clusters["backend"]["circuit_breakers"] == {
        "thresholds": [{"max_requests": 8, "max_pending_requests": 2}]
    }
    # The default stays what the other tests rely on.
    default = render_envoy_config(listener_port=1, backend_port=2, extproc_port=3, admin_port=4)
    assert "envoy.filters.http.ext_proc" in default and "max_requests: 100000" in default


def test_envoy_configs_load_in_the_real_envoy(cap: Capacity, tmp_path: Path) -> None:
    # envoy-adaptive: the filter goes just before the router, and Envoy 1.40 accepts it.
    cfg = _envoy(ext_proc=False)
    with_http_filter(adaptive_concurrency(4.0))(cfg)
    chain = [f["name"] for f in hcm_config(cfg)["http_filters"]]
    assert chain[-2:] == [ADAPTIVE_CONCURRENCY_FILTER, "envoy.filters.http.router"]
    gradient = hcm_config(cfg)["http_filters"][-2]["typed_config"]["gradient_controller_config"]
    assert gradient["sample_aggregate_percentile"] == {"value": 90}
    assert gradient["concurrency_limit_params"]["concurrency_update_interval"] == "0.025000s"
    assert gradient["min_rtt_calc_params"]["interval"] == "15.000000s"
    assert gradient["concurrency_limit_params"]["min_concurrency_limit"] == 25
    out = envoy_validate(cfg, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    # sidecar at speedup 1: a 240 s batch deadline is above envoy.yaml's 121 s
    # max_message_timeout; the patch gives Envoy what render(policy) derives.
    slow = replace(OPTS, speedup=1.0)
    for text in (sidecar_policy(cap, slow), pool_policy(cap, slow, ["http://127.0.0.1:9/m"])):
        cfg = _envoy()
        assert "121s" in json.dumps(cfg)
        policy_envoy_patch(text)(cfg)
        hcm = hcm_config(cfg)
        (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
        assert ext_proc["typed_config"]["max_message_timeout"] == "241s"
        assert hcm["stream_idle_timeout"] == "300s"
        routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
        # The priority channel and every LLM API, then the allowlist; the catch-all has none.
        llm = 1 + len(LLM_PATHS)
        timeouts = [r["route"]["timeout"] for r in routes if "route" in r]
        assert timeouts == ["600s"] * llm + ["60s", "60s"]
        (sidecar,) = [c for c in cfg["static_resources"]["clusters"] if c["name"] == "llm_extproc"]
        streams = sidecar["circuit_breakers"]["thresholds"][0]["max_requests"]
        assert streams == extproc_streams(policy_from_yaml(text))  # one per request it holds
        out = envoy_validate(cfg, tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------------------------------------
# Scenarios
# ---------------------------------------------------------------------------------------------


def _rate_at(pieces: tuple[tuple[float, float], ...], t: float) -> float:
    return [r for s, r in pieces if s <= t][-1]


def test_scenario_schedules(cap: Capacity) -> None:
    opts = replace(OPTS, loads=(1.0, 2.0))
    steady = plan("steady", cap, opts)
    assert [(r.key, r.label) for r in steady] == [("steady-1x", "1x"), ("steady-2x", "2x")]
    assert steady[1].offered_rps == pytest.approx(2 * cap.capacity_rps)
    assert not steady[1].speed_changes

    (shift,) = plan("shift", cap, opts)
    d = opts.duration_s
    i, b = shift.rates["interactive"], shift.rates["batch"]
    assert (_rate_at(i, 10), _rate_at(b, 10)) == (0.0, 2 * cap.class_capacity_rps["batch"])
    assert (_rate_at(i, 0.5 * d), _rate_at(b, 0.5 * d)) == (
        2 * cap.class_capacity_rps["interactive"],
        0.0,
    )
    assert _rate_at(i, 0.9 * d) + _rate_at(b, 0.9 * d) == pytest.approx(cap.capacity_rps)
    assert shift.marks["recover_from_s"] == 0.45 * d and shift.marks["both_s"] == 0.65 * d
    sched = build_schedule(shift.classes(opts), duration_s=d, max_requests=100_000)
    assert not [p for p in sched if p.cls == "interactive" and p.t_s < 0.45 * d]
    assert not [p for p in sched if p.cls == "batch" and 0.45 * d <= p.t_s < 0.65 * d]
    flood = sum(1 for p in sched if p.cls == "batch" and p.t_s < 0.45 * d) / (0.45 * d)
    assert flood == pytest.approx(2 * cap.class_capacity_rps["batch"], rel=0.1)

    (halve,) = plan("halve", cap, opts)
    assert halve.speed_changes == ((0.4 * d, 0.5),) and halve.marks["recover_from_s"] == 0.4 * d
    assert halve.offered_rps == pytest.approx(cap.capacity_rps)

    (spike,) = plan("spike", cap, opts)
    assert (spike.marks["spike_s"], spike.marks["spike_end_s"]) == (0.4 * d, 0.4 * d + 30)
    total = sum(_rate_at(p, 0.4 * d + 1) for p in spike.rates.values())
    assert total == pytest.approx(4 * cap.capacity_rps)
    assert sum(_rate_at(p, 0.4 * d + 31) for p in spike.rates.values()) == pytest.approx(
        cap.capacity_rps
    )
    # Short runs keep the shape: the spike is at most 0.15 of the run.
    (short,) = plan("spike", cap, replace(opts, duration_s=40.0, warmup_s=5.0))
    assert short.marks["spike_end_s"] - short.marks["spike_s"] == pytest.approx(6.0)


def test_cli_scenarios_and_quick() -> None:
    opts = parse_args(["--scenario", "shift,halve", "--quick"])
    assert opts.scenarios == ("shift", "halve")
    assert (opts.duration_s, opts.warmup_s, opts.live_capacity_s) == (100.0, 45.0, 0.0)
    assert parse_args(["--scenario", "all"]).scenarios == ("steady", "shift", "halve", "spike")
    opts = parse_args(["--duration", "50", "--warmup", "10"])
    assert opts.duration_s == 50
    with pytest.raises(SystemExit):
        parse_args(["--scenario", "nope"])


# ---------------------------------------------------------------------------------------------
# Figures from synthetic records and samples
# ---------------------------------------------------------------------------------------------


def rec(
    cls: str,
    arrival: float,
    *,
    ttft: float | None = 0.5,
    e2e: float = 1.0,
    good: bool = True,
    outcome: Outcome = "ok",
    tokens: tuple[int, int] = (100, 10),
) -> RequestRecord:
    return RequestRecord(
        index=0,
        cls=cls,
        arrival_s=arrival,
        prompt_tokens=tokens[0],
        max_tokens=tokens[1],
        outcome=outcome,
        status=200 if outcome == "ok" else 429,
        ttft_s=ttft if cls == "interactive" and outcome == "ok" else None,
        e2e_s=e2e,
        output_tokens=tokens[1] if outcome == "ok" else 0,
        attempts=1,
        gave_up=False,
        good=good and outcome == "ok",
    )


def test_slo_goodput() -> None:
    window = Window(start_s=10.0, end_s=20.0)
    records = [
        rec("interactive", 11.0, ttft=1.9),  # counts
        rec("interactive", 11.0, ttft=2.5),  # good, but its first token came too late
        rec("interactive", 12.0, ttft=0.1, good=False),  # a 200 after the client's timeout
        rec("interactive", 12.0, outcome="http_error"),
        rec("batch", 13.0, e2e=200.0),  # resolves after the window
        rec("batch", 13.0, e2e=2.0),  # counts
        rec("batch", 5.0, e2e=1.0),  # before the window
    ]
    assert [meets_slo(r) for r in records] == [True, False, False, False, True, True, True]
    assert slo_goodput_rps(records, window) == pytest.approx(2 / 10)


def test_ttft_windows_and_recovery() -> None:
    # Slow (5 s TTFT) until t = 30, fast after; 2 answers a second.
    records = [
        rec("interactive", t / 2, ttft=5.0 if t / 2 < 30 else 0.3) for t in range(0, 2 * 80)
    ] + [rec("batch", 1.0, ttft=None)]
    wins = ttft_windows(records, start_s=0.0, end_s=80.0)
    assert [w.start_s for w in wins][:3] == [0.0, 1.0, 2.0] and wins[-1].start_s == 70.0
    assert wins[0].answers == 20 and wins[0].p99_s == pytest.approx(5.0)
    assert recovery_s(records, since_s=20.0, until_s=80.0) == pytest.approx(10.0)
    assert recovery_s(records, since_s=40.0, until_s=80.0) == 0.0  # never missed
    assert recovery_s(records, since_s=0.0, until_s=25.0) is None  # still slow at the end
    assert recovery_s(records, since_s=0.0, until_s=5.0) is None  # no window fits
    # A window with too few answers does not count as recovered.
    sparse = [rec("interactive", float(t), ttft=0.1) for t in range(0, 60, 3)]
    assert recovery_s(sparse, since_s=0.0, until_s=60.0) is None


def sample(t: float, *, limit: float | None, finished: float = 0.0, busy: float = 0.0) -> Sample:
    return Sample(
        t_s=t,
        running=0.0,
        waiting=0.0,
        finished=finished,
        busy_s=busy,
        speed_factor=1.0,
        limit=limit,
    )


def test_limit_settle_and_idle_use() -> None:
    # 100 until the change at 50, then down by 5 every 2 s to 40 (reached at t = 74), then
    # wobbling +-3 around 40.
    limits = [
        (t, 100.0 if t < 50 else max(40.0, 100.0 - 5 * (t - 50) / 2)) for t in range(0, 150, 2)
    ]
    samples = [
        sample(t, limit=v + (3 if t > 80 and t % 4 == 0 else 0), busy=0.9 * t) for t, v in limits
    ]
    settle, final = limit_settle_s(samples, since_s=50.0)
    assert final == pytest.approx(40.0, abs=3)
    assert settle is not None and 18 <= settle <= 24  # within 20 % of ~40 from about 72 s on
    assert limit_settle_s([sample(t, limit=None) for t in range(20)], since_s=0.0) == (None, None)
    # Batch tokens answered in [10, 30): 20 answers of 1000 tokens over 20 s = 1000 tokens/s.
    records = [rec("batch", 8.0 + i, e2e=2.0, tokens=(990, 10)) for i in range(20)]
    records += [rec("batch", 29.0, e2e=5.0), rec("interactive", 15.0, tokens=(5000, 5))]
    use, busy = idle_capacity_use(
        records, samples, cls="batch", from_s=10.0, to_s=30.0, capacity_tokens_s=1250.0
    )
    assert use == pytest.approx(0.8) and busy == pytest.approx(0.9)


def _stats(good: int, rps: float, tps: float, ttft: float | None) -> ClassStats:
    return ClassStats(
        resolved=good,
        good=good,
        goodput_rps=rps,
        goodput_tokens_per_s=tps,
        ttft_p50_s=ttft,
        ttft_p99_s=ttft,
        ttft_p99_first_attempt_s=ttft,
        e2e_p50_s=1.0,
        e2e_p99_s=1.0,
        outcomes={"good": 1.0, "late": 0.0, "429": 0.0, "5xx": 0.0, "4xx": 0.0, "timeout": 0.0,
                  "other": 0.0},
        attempts=good,
    )  # fmt: skip


def summary(
    strategy: str,
    *,
    scenario: str = "steady",
    load: float = 2.0,
    rps: float = 5.0,
    tps: float = 500.0,
    slo: float = 3.0,
    ttft: float | None = 1.0,
    waste: float = 0.0,
    refused: float = 0.0,
    figures: dict[str, float | None] | None = None,
) -> RunSummary:
    stats = _stats(round(rps * 100), rps, tps, ttft)
    return RunSummary(
        strategy=strategy,
        scenario=scenario,
        label=f"{load:g}x" if scenario == "steady" else scenario,
        load=load,
        offered_rps=10.0,
        window_s=(90.0, 200.0),
        overall=stats,
        per_class={"interactive": stats, "batch": stats},
        slo_goodput_rps=slo,
        refused_frac=refused,
        ratio_to_direct=None,
        wasted_frac=waste,
        wasted_prefill_frac=0.0,
        late_tokens_frac=0.0,
        backend={},
        admission={},
        sim_lag_s_max=0.0,
        sim_lag_s_mean=0.0,
        loadgen_lag_s_max=0.0,
        harness_ok=True,
        wall_s=1.0,
        scenario_figures=figures or {},
    )


def test_targets_from_synthetic_summaries() -> None:
    rows = [
        summary("sidecar", rps=9.0, tps=1500, slo=6.0, ttft=1.5, waste=0.01),
        summary("envoy-cb", rps=8.0, tps=1600, slo=3.9, ttft=3.0),
        summary("direct", rps=4.0, tps=100, slo=1.0, ttft=9.0, waste=0.4),
        summary("sidecar", load=1.0, rps=9.0, refused=0.02),
        summary("direct", load=1.0, rps=8.0),
        summary("sidecar", load=0.5, rps=5.0, refused=0.0),
        summary("direct", load=0.5, rps=5.5),
        summary(
            "sidecar",
            scenario="halve",
            figures={
                "limit_settle_s": 24.0,
                "limit_final": 40.0,
                "limit_before": 90.0,
                "recovery_s": None,
            },
        ),
        summary("sidecar", scenario="shift", figures={"idle_use": 0.93, "recovery_s": 12.0}),
        summary("direct", scenario="spike", figures={"recovery_s": 3.0}),  # no sidecar: nothing
    ]
    got = {(c.label, c.name): c.passed for c in check_targets(rows)}
    assert got == {
        ("2x", "good req/s above every other"): True,
        ("2x", "good tok/s above every other"): False,  # envoy-cb's 1600
        ("2x", "SLO goodput >= 1.5x every other"): True,  # 6.0 >= 1.5 x 3.9
        ("2x", "interactive p99 TTFT < 2 s (first attempts)"): True,
        ("2x", "interactive p99 TTFT < 2 s (from arrival)"): True,
        ("2x", "wasted work < 2%"): True,
        ("1x", "nobody refused who would be served in time"): False,  # 2 % refused
        ("0.5x", "nobody refused who would be served in time"): False,  # fewer good than direct
        ("halve", "pool limit settles within 30 s"): True,
        ("halve", "interactive p99 TTFT < 2 s again"): False,
        ("shift", "batch uses >= 90% of idle capacity"): True,
        ("shift", "interactive p99 TTFT < 2 s within 10 s of burst"): False,
    }
    primary = [c for c in check_targets(rows) if c.label == "2x" and not c.primary]
    assert [c.name for c in primary] == ["interactive p99 TTFT < 2 s (from arrival)"]


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------

SMOKE = ["--duration", "24", "--warmup", "8", "--speedup", "5", "--model-requests", "1500"]
SMOKE_STRATEGIES = ("direct", "priority-gateway", "envoy-adaptive", "sidecar-static", "sidecar")


def test_compare_end_to_end_small(tmp_path: Path) -> None:
    rc = main(
        [*SMOKE, "--loads", "2", "--live-capacity-s", "8", "--out", str(tmp_path),
         "--strategies", ",".join(SMOKE_STRATEGIES)]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads((tmp_path / "compare.json").read_text())
    records = json.loads((tmp_path / "records.json").read_text())
    assert set(records) == {f"steady-2x/{s}" for s in SMOKE_STRATEGIES}
    cap = doc["capacity"]
    assert cap["capacity_rps"] > 0 and cap["live_rps"] is not None and cap["live_rps"] > 0
    runs = {r["strategy"]: r for r in doc["runs"]}
    assert set(runs) == set(SMOKE_STRATEGIES)
    for name, run in runs.items():
        assert (run["scenario"], run["label"]) == ("steady", "2x")
        assert run["offered_rps"] == pytest.approx(2 * cap["capacity_rps"])
        overall = run["overall"]
        assert overall["resolved"] > 20, name
        assert 0 < run["goodput_rps"] <= run["offered_rps"], name
        assert 0 <= run["slo_goodput_rps"] <= run["goodput_rps"], name
        assert sum(overall["outcomes"].values()) == pytest.approx(1.0)
        assert run["wasted_frac"] is not None and 0.0 <= run["wasted_frac"] <= 1.0
        assert run["backend"]["generation_tokens"] > 0
        assert run["ratio_to_direct"] == pytest.approx(
            run["goodput_rps"] / runs["direct"]["goodput_rps"]
        )
    # Each admission layer really ran: the gateway admitted requests and answered some 503 at
    # dequeue, Envoy's adaptive filter saw every request, the sidecars admitted requests.
    gw = runs["priority-gateway"]["admission"]
    assert gw["admitted"] > 20 and gw["admitted_short"] > 0 and gw["expired"] > 0
    adaptive = runs["envoy-adaptive"]["admission"]
    assert adaptive["upstream_rq_total"] > 0
    assert adaptive["upstream_rq_total"] + adaptive["adaptive.rq_blocked"] > 20
    for name in ("sidecar-static", "sidecar"):
        admitted = sum(v for k, v in runs[name]["admission"].items() if k.endswith("/admitted"))
        assert admitted > 20, name
    assert runs["direct"]["refused_frac"] == 0
    timelines = json.loads((tmp_path / "timelines.json").read_text())
    assert all(len(v) >= 10 for v in timelines.values())
    assert all(s["limit"] is None for s in timelines["steady-2x/direct"])
    assert any(s["limit"] for s in timelines["steady-2x/envoy-adaptive"])
    assert any(s["limit"] for s in timelines["steady-2x/sidecar"])  # llm_extproc_pool_limit
    assert {t["name"] for t in doc["targets"] if t["primary"]} == {
        "good req/s above every other",
        "good tok/s above every other",
        "SLO goodput >= 1.5x every other",
        "interactive p99 TTFT < 2 s (first attempts)",
        "wasted work < 2%",
    }


def test_compare_halve_small(tmp_path: Path) -> None:
    rc = main(
        [*SMOKE, "--duration", "40", "--scenario", "halve", "--strategies", "sidecar",
         "--live-capacity-s", "0", "--out", str(tmp_path)]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads((tmp_path / "compare.json").read_text())
    (run,) = doc["runs"]
    assert (run["scenario"], run["label"]) == ("halve", "halve")
    assert {"recovery_s", "limit_settle_s", "limit_final", "limit_before"} <= set(
        run["scenario_figures"]
    )
    (samples,) = json.loads((tmp_path / "timelines.json").read_text()).values()
    change = 0.4 * 40
    # The backend slowed down at the change, on the load's clock, and stayed slow.
    assert {s["speed_factor"] for s in samples if s["t_s"] < change - 1} == {1.0}
    assert {s["speed_factor"] for s in samples if s["t_s"] > change + 1} == {0.5}
    assert all(s["limit"] is not None and not math.isnan(s["limit"]) for s in samples[1:])
    assert {t["name"] for t in doc["targets"]} == {
        "pool limit settles within 30 s",
        "interactive p99 TTFT < 2 s again",
    }
