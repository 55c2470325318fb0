"""``python -m bench.compare --scenario noisy``: the noisy neighbour's schedule (tenants, seeds,
the no-flood reference), the per-tenant figures and targets on synthetic records, the fair
sidecar's policy, then one tiny end-to-end run of every strategy of the scenario (shape, not
figures: the real run's are in docs/benchmarks.md)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.compare.__main__ import main, parse_args
from bench.compare.capacity import Capacity, determine_capacity
from bench.compare.measure import RunSummary, Window
from bench.compare.noisy import check_noisy, held_strategy
from bench.compare.options import NOISY_STRATEGIES, Options
from bench.compare.report import format_targets
from bench.compare.scenarios import plan
from bench.compare.strategies import pool_policy
from bench.compare.tenants import TenantStats, jain_index, tenant_stats
from bench.load.summary import RequestRecord
from bench.load.workload import build_schedule
from extproc.config.policy import Order, policy_from_yaml
from tests.bench.test_compare import rec, summary

OPTS = Options(model_requests=1500, noisy_seeds=(3, 4))


@pytest.fixture(scope="module")
def cap() -> Capacity:
    return determine_capacity(OPTS, log=False)


def test_noisy_runs_and_their_schedules(cap: Capacity) -> None:
    runs = plan("noisy", cap, OPTS)
    assert [(r.key, r.label, r.seed, r.reference) for r in runs] == [
        ("noisy-s3", "flood s3", 3, False),
        ("noflood-s3", "no flood s3", 3, True),
        ("noisy-s4", "flood s4", 4, False),
        ("noflood-s4", "no flood s4", 4, True),
    ]
    unit = cap.class_capacity_rps["interactive"]
    flood, alone = runs[0], runs[1]
    assert flood.offered_rps == pytest.approx(5.8 * unit)
    assert alone.offered_rps == pytest.approx(0.8 * unit)
    (spec,) = flood.classes(OPTS)  # interactive only: streamed chat
    assert spec.name == "interactive" and spec.stream
    assert dict(spec.tenant_shares())["heavy"] == pytest.approx(5 / 5.8)
    d = 60.0

    def light(run_index: int) -> list[tuple[str | None, float, int]]:
        run = runs[run_index]
        sched = build_schedule(
            run.classes(OPTS), duration_s=d, max_requests=100_000, seed=run.seed or 0
        )
        return [(p.tenant, p.t_s, p.prompt_tokens) for p in sched if p.tenant != "heavy"]

    # The reference sends the light tenants' very requests, without the heavy tenant's.
    assert light(0) == light(1) and light(0) != light(2)
    assert {t for t, _, _ in light(0)} == {"light-1", "light-2", "light-3", "light-4"}
    # --scenario noisy alone runs the scenario's strategies; the fair sidecar is held.
    opts = parse_args(["--scenario", "noisy", "--noisy-seeds", "1,2"])
    assert opts.strategies == NOISY_STRATEGIES and opts.noisy_seeds == (1, 2)
    assert held_strategy(opts.strategies) == "sidecar-fair"
    assert parse_args(["--scenario", "noisy,steady"]).strategies == Options().strategies
    assert "noisy" not in parse_args(["--scenario", "all"]).scenarios


def test_fair_policy_is_the_pool_policy_with_tenants(cap: Capacity) -> None:
    urls = ["http://127.0.0.1:9/metrics"]
    off = policy_from_yaml(pool_policy(cap, OPTS, urls), "off")
    fair = policy_from_yaml(pool_policy(cap, OPTS, urls, fair=True), "fair")
    assert "x-tenant-id" in fair.trusted_headers
    assert all(b.order is Order.COST for b in off.buckets)
    assert all(b.order is Order.FAIR for b in fair.buckets)
    assert all(b.tenant is not None and b.tenant.header == "x-tenant-id" for b in fair.buckets)
    # Nothing else differs: the pool, the bands, shares and deadlines are the same.
    assert fair.pool == off.pool
    for a, b in zip(fair.buckets, off.buckets, strict=True):
        assert replace(a, order=b.order, tenant=b.tenant) == b


def _tenant(r: RequestRecord, tenant: str) -> RequestRecord:
    return replace(r, tenant=tenant)


def test_tenant_stats_and_jain() -> None:
    window = Window(start_s=10.0, end_s=20.0)
    records = [
        _tenant(rec("interactive", 11.0, ttft=0.5, tokens=(100, 40)), "a"),
        _tenant(rec("interactive", 11.0, ttft=2.5, tokens=(100, 40)), "a"),  # good, late TTFT
        _tenant(rec("interactive", 12.0, outcome="http_error"), "a"),  # refused: counts as sent
        _tenant(rec("interactive", 5.0), "a"),  # resolved before the window
        _tenant(rec("interactive", 12.0, ttft=0.1, tokens=(100, 20)), "b"),
        rec("interactive", 12.0),  # no tenant
    ]
    got = tenant_stats(records, window)
    assert got == {
        "a": TenantStats(
            tenant="a",
            resolved=3,
            slo_met=1,
            good=2,
            good_tokens_per_s=8.0,
            refused=1,
            ttft_p99_s=pytest.approx(2.5, abs=0.05),
        ),
        "b": TenantStats(
            tenant="b",
            resolved=1,
            slo_met=1,
            good=1,
            good_tokens_per_s=2.0,
            refused=0,
            ttft_p99_s=pytest.approx(0.1),
        ),
    }
    assert got["a"].attainment == pytest.approx(1 / 3) and got["b"].attainment == 1.0
    assert jain_index([0.9, 0.9, 0.9]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)  # one has everything: 1/n
    assert jain_index([]) is None and jain_index([0.0, 0.0]) is None


def _stats(tenant: str, attain: float, tokens: float) -> TenantStats:
    return TenantStats(
        tenant=tenant,
        resolved=100,
        slo_met=round(100 * attain),
        good=round(100 * attain),
        good_tokens_per_s=tokens,
        refused=0,
        ttft_p99_s=1.0,
    )


def _noisy(
    strategy: str, label: str, attain: dict[str, float], heavy_tokens: float = 900.0
) -> RunSummary:
    per = {k: _stats(k, v, 100.0) for k, v in attain.items()}
    if not label.startswith("no flood"):
        per["heavy"] = _stats("heavy", 0.3, heavy_tokens)
    return replace(summary(strategy, scenario="noisy"), label=label, per_tenant=per)


def test_noisy_targets_from_synthetic_summaries() -> None:
    alone = {"light-1": 1.0, "light-2": 1.0, "light-3": 0.98}
    rows = [
        _noisy("sidecar-fair", "flood s0", {"light-1": 0.97, "light-2": 0.99, "light-3": 0.95}),
        _noisy("sidecar", "flood s0", {"light-1": 0.2, "light-2": 0.1, "light-3": 0.3}, 900.0),
        _noisy("sidecar-fair", "no flood s0", alone),
        # Seed 1: one light tenant squeezed out, the heavy one got less than without fairness.
        _noisy("sidecar-fair", "flood s1", {"light-1": 0.97, "light-2": 0.5, "light-3": 0.95}),
        _noisy("sidecar", "flood s1", {"light-1": 0.2, "light-2": 0.1, "light-3": 0.3}, 2000.0),
        _noisy("sidecar-fair", "no flood s1", alone),
    ]
    got = {(c.label, c.name): c.passed for c in check_noisy(rows, "sidecar-fair")}
    assert got == {
        ("flood s0", "light tenants keep >= 95% of no-flood attainment"): True,
        ("flood s0", "total good tok/s >= 95% of fairness off"): True,
        ("flood s0", "Jain's index over light attainment >= 0.95"): True,
        ("flood s1", "light tenants keep >= 95% of no-flood attainment"): False,  # 0.5
        ("flood s1", "total good tok/s >= 95% of fairness off"): False,  # 1200 vs 2300
        ("flood s1", "Jain's index over light attainment >= 0.95"): False,
    }
    tokens = [c.value for c in check_noisy(rows, "sidecar-fair") if c.name.startswith("total")]
    assert tokens == [pytest.approx(1.0), pytest.approx(1200 / 2300)]  # heavy + 3 x 100 each
    # The header names the strategy the noisy targets were read on.
    held = replace(rows[0], strategy="replicas-shared-fair")
    text = format_targets(
        check_noisy([held, rows[2]], "replicas-shared-fair"), "replicas-shared-fair"
    )
    assert text.splitlines()[0].startswith("targets (sidecar; noisy: replicas-shared-fair;")


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------


@pytest.mark.envoy
@pytest.mark.slow
def test_noisy_end_to_end_small(tmp_path: Path) -> None:
    rc = main(
        ["--scenario", "noisy", "--noisy-seeds", "0", "--heavy-load", "2", "--duration", "16",
         "--warmup", "4", "--speedup", "4", "--model-requests", "1500", "--live-capacity-s", "0",
         "--out", str(tmp_path)]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads((tmp_path / "compare.json").read_text())
    runs = {(r["label"], r["strategy"]): r for r in doc["runs"]}
    flood = {("flood s0", s) for s in NOISY_STRATEGIES}
    assert set(runs) == flood | {("no flood s0", "sidecar-fair")}
    tenants = {"heavy", "light-1", "light-2", "light-3", "light-4"}
    for (label, strategy), run in runs.items():
        per = run["per_tenant"]
        assert set(per) == (tenants if label == "flood s0" else tenants - {"heavy"}), strategy
        for name, t in per.items():
            assert t["resolved"] > 0 and 0 <= t["slo_met"] <= t["resolved"], (strategy, name)
            assert t["attainment"] == pytest.approx(t["slo_met"] / t["resolved"])
        # The heavy tenant sent most of the flood, as planned (2 against 4 x 0.2).
        if label == "flood s0":
            assert per["heavy"]["resolved"] > sum(per[f"light-{i}"]["resolved"] for i in (1, 2))
    # Every record says its tenant; the targets of the held strategy are there, each once.
    records = json.loads((tmp_path / "records.json").read_text())
    assert set(records) == {"noisy-s0/" + s for s in NOISY_STRATEGIES} | {"noflood-s0/sidecar-fair"}
    assert all(r["tenant"] in tenants for rs in records.values() for r in rs)
    assert sorted(t["name"] for t in doc["targets"]) == [
        "Jain's index over light attainment >= 0.95",
        "light tenants keep >= 95% of no-flood attainment",
        "total good tok/s >= 95% of fairness off",
    ]
