"""``bench.compare``'s replica strategies (three gateways in front of one simulator): their
policies, the load spread over the gateways, the backend's in-flight polls and how they are
reported, on synthetic data; then one small end-to-end run with the real simulator, three
Envoys and sidecars and a real redis-server (shape and the shared pool's limit, not figures)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web

from bench.compare.__main__ import _configs, main, parse_args
from bench.compare.capacity import Capacity, ClosedLoopPoint
from bench.compare.deploy import policy_envoy_patch
from bench.compare.measure import (
    ClassStats,
    InFlight,
    InFlightPoint,
    RunSummary,
    Window,
    combine_replicas,
    in_flight_figures,
    in_flight_point,
    sample_of,
)
from bench.compare.options import REPLICA_STRATEGIES, STRATEGIES, Options
from bench.compare.report import format_runs
from bench.compare.run import merge_results, round_robin, run_round_robin
from bench.compare.strategies import REDIS_PLACEHOLDER, pool_policy, replica_pool_policy
from bench.load.runner import LoadConfig
from bench.load.summary import LoadResult, RequestRecord
from bench.load.workload import PlannedRequest, build_schedule
from extproc.config.policy import Policy, policy_from_yaml
from testing.stack import free_port

OPTS = Options(speedup=4.0)
REDIS_URL = "redis://127.0.0.1:6390/0"


def point(c: int) -> ClosedLoopPoint:
    return ClosedLoopPoint(
        concurrency=c,
        throughput_rps=10.0,
        tokens_per_s=1000.0,
        class_rps={"interactive": 8.0, "batch": 2.0},
        in_flight={"interactive": 0.6 * c, "batch": 0.4 * c},
        ttft_p99_s={"interactive": 0.5, "batch": None},
        e2e_p99_s={"interactive": 5.0, "batch": 20.0},
    )


def capacity(c: int = 56) -> Capacity:
    return Capacity(
        profile="a100",
        capacity_rps=12.0,
        saturation=point(256),
        concurrency=c,
        at_concurrency=point(c),
        concurrency_rule="synthetic",
        sweep=(point(c),),
    )


def parsed(text: str) -> Policy:
    return policy_from_yaml(text.replace(REDIS_PLACEHOLDER, REDIS_URL), source="generated")


# ---------------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------------


def test_replica_policy_is_the_sidecar_pool_without_adaptive() -> None:
    """The replicas' policy is the ``sidecar`` pool's (``sidecar-fair``'s for
    ``replicas-shared-fair``) but for the limit, fail_fast, the metrics and the sharing."""
    cap = capacity(56)
    for fair in (False, True):
        adaptive = parsed(pool_policy(cap, OPTS, ["http://127.0.0.1:9/metrics"], fair=fair))
        policy = parsed(replica_pool_policy(cap, OPTS, fair=fair))
        assert adaptive.pool is not None and policy.trusted_headers == adaptive.trusted_headers
        pool = policy.pool
        assert pool is not None and pool.adaptive is None
        assert pool.max_concurrency == 56  # the pool's, all replicas together
        assert pool.fail_fast is False  # shared mode turns it off
        assert pool.overload == adaptive.pool.overload  # the same scaled steps
        assert policy.buckets == adaptive.buckets  # names, bands, shares, deadlines, queues
        assert policy.limits == adaptive.limits and policy.tokens == adaptive.tokens
        assert policy.backend.metrics == () and pool.shared is not None


def test_shared_policy_lease_scaled_timeout_not() -> None:
    cap = capacity(56)
    text = replica_pool_policy(cap, OPTS)
    assert f'redis: "{REDIS_PLACEHOLDER}"' in text  # testing.gateways fills it in
    pool = parsed(text).pool
    assert pool is not None and pool.shared is not None
    shared = pool.shared
    assert shared.redis == REDIS_URL and shared.key_prefix == "bench-compare"
    assert shared.lease_s == pytest.approx(10.0 / OPTS.speedup)
    assert shared.timeout_s == pytest.approx(0.25)  # a network deadline: not scaled
    assert shared.replicas == 3
    # At a high speedup the lease stays within what the policy allows, the timeout under it.
    fast = parsed(replica_pool_policy(cap, replace(OPTS, speedup=40.0)))
    assert fast.pool is not None and fast.pool.shared is not None
    assert fast.pool.shared.lease_s == pytest.approx(0.5)
    assert fast.pool.shared.timeout_s == pytest.approx(0.125)


def test_replica_envoy_patch_from_a_shared_policy() -> None:
    text = replica_pool_policy(capacity(56), OPTS)
    patch = policy_envoy_patch(text.replace(REDIS_PLACEHOLDER, REDIS_URL))
    assert callable(patch)


def test_cli_replica_strategies_not_in_the_default() -> None:
    opts = parse_args([])
    assert opts.strategies == STRATEGIES
    assert not set(REPLICA_STRATEGIES) & set(opts.strategies)
    opts = parse_args(["--strategies", ",".join(REPLICA_STRATEGIES), "--loads", "2"])
    assert opts.strategies == REPLICA_STRATEGIES and opts.loads == (2.0,)
    assert opts.replicas == 3
    assert parse_args(["--replicas", "2"]).replicas == 2
    for bad in (["--replicas", "0"], ["--strategies", "replicas-two"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_configs_show_the_replica_policies() -> None:
    cap = capacity(56)
    opts = replace(OPTS, strategies=REPLICA_STRATEGIES)
    config = _configs(cap, opts)
    assert set(config) == {
        "replicas-shared policy (each of 3)",
        "replicas-shared-fair policy (each of 3)",
    }
    assert "max_concurrency: 56" in config["replicas-shared policy (each of 3)"]


# ---------------------------------------------------------------------------------------------
# The load spread over the gateways
# ---------------------------------------------------------------------------------------------


def planned(i: int, t: float, cls: str = "interactive") -> PlannedRequest:
    return PlannedRequest(index=i, t_s=t, cls=cls, prompt_tokens=10, output_tokens=5)


def test_round_robin_in_arrival_order() -> None:
    schedule = [planned(i, 0.5 * i) for i in range(7)]
    parts = round_robin(list(reversed(schedule)), 3)
    assert [[p.index for p in part] for part in parts] == [[0, 3, 6], [1, 4], [2, 5]]
    assert all(part == sorted(part, key=lambda p: p.t_s) for part in parts)
    assert round_robin(schedule, 1) == [schedule]
    assert round_robin([], 3) == [[], [], []]
    with pytest.raises(ValueError):
        round_robin(schedule, 0)


def record(i: int, cls: str, *, arrival: float, good: bool = True) -> RequestRecord:
    return RequestRecord(
        index=i,
        cls=cls,
        arrival_s=arrival,
        prompt_tokens=10,
        max_tokens=5,
        outcome="ok",
        status=200,
        ttft_s=0.2 if cls == "interactive" else None,
        e2e_s=1.0,
        output_tokens=5,
        attempts=1,
        gave_up=False,
        good=good,
    )


def _cfg() -> LoadConfig:
    return LoadConfig(url="http://unused", classes=OPTS.classes(2.0), duration_s=10.0, speedup=4.0)


def test_merge_results() -> None:
    a = [record(0, "interactive", arrival=0.1), record(2, "batch", arrival=2.0, good=False)]
    b = [record(1, "interactive", arrival=1.0), record(3, "interactive", arrival=3.0)]
    merged = merge_results(
        [
            LoadResult(loadgen_lag_s_max=0.3, records=tuple(b)),
            LoadResult(loadgen_lag_s_max=0.1, records=tuple(a)),
        ]
    )
    assert [r.index for r in merged.records] == [0, 1, 2, 3]
    assert merged.loadgen_lag_s_max == 0.3
    with pytest.raises(ValueError):
        merge_results([])


def test_run_round_robin_sends_to_every_gateway() -> None:
    """Three in-process HTTP servers answer like the simulator (non-streamed and streamed);
    every request of the schedule reaches one of them: request i the (i mod 3)-th."""
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def app(k: int) -> web.Application:
        async def chat(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            seen[k].append(int(body["messages"][0]["content"].split("]")[0].lstrip("[")))
            if not body.get("stream"):
                return web.json_response({"usage": {"completion_tokens": body["max_tokens"]}})
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            return resp

        a = web.Application()
        a.router.add_post("/v1/chat/completions", chat)
        return a

    async def go() -> tuple[LoadResult, list[PlannedRequest]]:
        runners = [web.AppRunner(app(k)) for k in range(3)]
        urls = []
        try:
            for runner in runners:
                await runner.setup()
                port = free_port()
                await web.TCPSite(runner, "127.0.0.1", port).start()
                urls.append(f"http://127.0.0.1:{port}")
            cfg = replace(_cfg(), duration_s=3.0, speedup=20.0, max_run_s=10.0)
            schedule = list(
                build_schedule(
                    cfg.classes, duration_s=cfg.duration_s, max_requests=cfg.max_requests
                )
            )
            return await run_round_robin(cfg, urls), schedule
        finally:
            for runner in runners:
                await runner.cleanup()

    res, schedule = asyncio.run(go())
    assert len(schedule) >= 6
    assert [r.index for r in res.records] == [p.index for p in schedule]
    assert all(r.outcome == "ok" for r in res.records)
    by_arrival = [p.index for p in sorted(schedule, key=lambda p: (p.t_s, p.index))]
    for k in range(3):
        assert sorted(seen[k]) == sorted(by_arrival[k::3]), k


# ---------------------------------------------------------------------------------------------
# The backend's requests in flight
# ---------------------------------------------------------------------------------------------


def test_in_flight_point_sums_the_simulators() -> None:
    stats = [
        {"num_requests_running": 40, "num_requests_waiting": 3, "busy_s": 1.0},
        {"num_requests_running": 2.0},  # JSON numbers may come as floats; waiting missing
    ]
    assert in_flight_point(7.5, stats) == InFlightPoint(t_s=7.5, running=42, waiting=3)
    assert in_flight_point(0.0, [{}]) == InFlightPoint(t_s=0.0, running=0, waiting=0)


def test_in_flight_figures() -> None:
    window = Window(start_s=10.0, end_s=20.0)
    points = [
        InFlightPoint(t_s=t, running=r, waiting=w)
        for t, r, w in [(2.0, 90, 5), (10.0, 40, 0), (15.0, 60, 1), (19.9, 50, 0), (20.0, 70, 9)]
    ]
    assert in_flight_figures(points, window) == InFlight(
        samples=5,
        running_peak=90,  # the warm-up's counts: an overshoot is one wherever it happens
        running_peak_window=60,
        running_mean_window=50.0,
        waiting_peak=9,
        held_peak=95,  # 90 + 5 at t = 2
    )
    outside = in_flight_figures(points[:1], window)
    assert outside is not None and outside.running_peak_window is None
    assert in_flight_figures([], window) is None


def test_replica_counters_combined_and_the_limit() -> None:
    a = {"sidecar.batch/admitted": 5.0, "pool_limit": 56.0, "shared_pool_limit": 56.0}
    b = {"sidecar.batch/admitted": 7.0, "pool_limit": 56.0, "shared_pool_limit": 56.0}
    both = combine_replicas([a, b])
    assert both == {"sidecar.batch/admitted": 12.0, "pool_limit": 112.0, "shared_pool_limit": 56.0}
    assert sample_of(1.0, both).limit == 56.0  # a shared pool: its limit, once
    assert sample_of(1.0, {"pool_limit": 56.0}).limit == 56.0
    assert sample_of(1.0, {"envoy.adaptive.concurrency_limit": 30.0}).limit == 30.0
    assert sample_of(1.0, {}).limit is None


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def _stats(ttft: float) -> ClassStats:
    return ClassStats(
        resolved=100,
        good=90,
        goodput_rps=9.0,
        goodput_tokens_per_s=900.0,
        ttft_p50_s=0.5,
        ttft_p99_s=ttft + 1,
        ttft_p99_first_attempt_s=ttft,
        e2e_p50_s=1.0,
        e2e_p99_s=2.0,
        outcomes={"good": 0.9, "late": 0.0, "429": 0.1, "5xx": 0.0, "4xx": 0.0, "timeout": 0.0,
                  "other": 0.0},
        attempts=110,
    )  # fmt: skip


def run_summary(strategy: str, peak: int | None) -> RunSummary:
    stats = _stats(1.5)
    return RunSummary(
        strategy=strategy,
        scenario="steady",
        label="2x",
        load=2.0,
        offered_rps=24.0,
        window_s=(10.0, 30.0),
        overall=stats,
        per_class={"interactive": stats, "batch": stats},
        slo_goodput_rps=7.0,
        refused_frac=0.1,
        ratio_to_direct=None,
        wasted_frac=0.01,
        wasted_prefill_frac=0.0,
        late_tokens_frac=0.0,
        backend={},
        admission={},
        sim_lag_s_max=0.1,
        sim_lag_s_mean=0.0,
        loadgen_lag_s_max=0.0,
        harness_ok=True,
        wall_s=1.0,
        scenario_figures={},
        in_flight=None
        if peak is None
        else InFlight(
            samples=60,
            running_peak=peak,
            running_peak_window=peak,
            running_mean_window=peak / 2,
            waiting_peak=0,
            held_peak=peak,
        ),
    )


def test_the_peak_column() -> None:
    rows = [
        run_summary("sidecar", 50),
        run_summary("replicas-shared", 150),
        run_summary("replicas-shared-fair", None),
    ]
    runs = format_runs(rows)
    assert "peak" in runs.splitlines()[1]
    assert json.dumps(rows[1].to_dict())  # JSON-able, with the figures
    assert rows[1].to_dict()["in_flight_peak"] == 150
    assert rows[1].to_dict()["in_flight"]["running_mean_window"] == 75.0


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------

# A client abort frees the slot when Envoy resets the stream; the simulator drops the request a
# moment later (tests/shared/test_e2e_shared.py).
ABORT_SLACK = 4


def test_replicas_end_to_end_small(tmp_path: Path) -> None:
    """replicas-shared at 2x for a few simulated seconds, C = 24: the sidecars admitted
    requests, the backend held no more than C (plus the slack of aborts) behind the shared
    pool, and everything is reported."""
    rc = main(
        ["--duration", "24", "--warmup", "8", "--speedup", "5", "--model-requests", "500",
         "--concurrency", "24", "--loads", "2", "--live-capacity-s", "0",
         "--out", str(tmp_path), "--strategies", "replicas-shared"]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads((tmp_path / "compare.json").read_text())
    c = doc["capacity"]["concurrency"]
    runs = {r["strategy"]: r for r in doc["runs"]}
    assert set(runs) == {"replicas-shared"}
    for name, run in runs.items():
        assert run["overall"]["resolved"] > 20, name
        assert run["goodput_rps"] > 0, name
        admitted = sum(v for k, v in run["admission"].items() if k.endswith("/admitted"))
        assert admitted > 20, name
        assert run["in_flight"]["samples"] >= 8, name  # every 0.5 s of about 5 s
        assert run["in_flight_peak"] > 0, name
    assert runs["replicas-shared"]["in_flight"]["held_peak"] <= c + ABORT_SLACK
    for i in range(3):
        log_dir = tmp_path / "logs" / "steady-2x" / "replicas-shared" / f"gateway-{i}"
        assert (log_dir / "sidecar.log").exists()
    policy = (tmp_path / "logs" / "steady-2x" / "replicas-shared" / "policy.yaml").read_text()
    assert "redis://127.0.0.1:" in policy and REDIS_PLACEHOLDER not in policy
