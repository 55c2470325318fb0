"""``python -m bench.compare`` end to end, small: the real simulator, the real Envoy (with and
without ext_proc) and the real sidecar, one overload level, a few simulated minutes at a high
speedup. Checks the shape and sanity of what it writes, not the figures (that is the full run's
job, see docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bench.compare.__main__ import main
from bench.compare.capacity import closed_loop, determine_capacity, workload_mix
from bench.compare.options import STRATEGIES, Options
from bench.compare.strategies import envoy_breakers, sidecar_policy, slot_split
from extproc.config.policy import policy_from_yaml
from testing.envoy import render_envoy_config


def test_capacity_model_and_derived_settings() -> None:
    opts = Options(model_requests=1500)
    mix = workload_mix(opts)
    assert len(mix) > 1400 and {r.cls for r in mix} == {"interactive", "batch"}
    low, high = closed_loop(opts.engine, mix, 16), closed_loop(opts.engine, mix, 128)
    assert 0 < low.throughput_rps < high.throughput_rps  # batching pays
    cap = determine_capacity(opts, log=False)
    assert cap.capacity_rps >= cap.at_concurrency.throughput_rps > 0
    assert cap.concurrency % 8 == 0 and 8 <= cap.concurrency <= opts.engine.max_num_seqs
    slots = slot_split(cap)
    assert sum(slots.values()) == cap.concurrency and min(slots.values()) >= 1
    # The generated policy is one the sidecar accepts, with the deadlines scaled to wall time.
    policy = policy_from_yaml(sidecar_policy(cap, opts), source="generated")
    by_name = {b.name: b for b in policy.buckets}
    assert by_name["interactive"].max_concurrency == slots["interactive"]
    assert by_name["interactive"].queue_timeout_s == pytest.approx(1.5 / opts.speedup)
    assert by_name["batch"].queue_timeout_s == pytest.approx(240.0 / opts.speedup)
    breakers = envoy_breakers(cap, opts)
    assert breakers["max_requests"] == breakers["max_connections"] == cap.concurrency


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


def test_compare_end_to_end_small(tmp_path: Path) -> None:
    rc = main(
        [
            "--loads", "2",
            "--duration", "28",
            "--warmup", "8",
            "--speedup", "4",
            "--model-requests", "1500",
            "--live-capacity-s", "8",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads((tmp_path / "compare.json").read_text())
    assert (tmp_path / "goodput.png").stat().st_size > 10_000
    assert (tmp_path / "latency_cdf.png").stat().st_size > 10_000
    records = json.loads((tmp_path / "records.json").read_text())
    assert set(records) == {f"{s}@2x" for s in STRATEGIES}

    cap = doc["capacity"]
    assert cap["capacity_rps"] > 0 and cap["live_rps"] is not None and cap["live_rps"] > 0
    runs = {r["strategy"]: r for r in doc["runs"]}
    assert set(runs) == set(STRATEGIES)
    for name, run in runs.items():
        assert run["load"] == 2.0 and run["offered_rps"] == pytest.approx(2 * cap["capacity_rps"])
        overall = run["overall"]
        assert overall["resolved"] > 20, name
        assert 0 < run["goodput_rps"] <= run["offered_rps"], name
        assert sum(overall["outcomes"].values()) == pytest.approx(1.0)
        assert run["wasted_frac"] is not None and 0.0 <= run["wasted_frac"] <= 1.0
        assert run["backend"]["generation_tokens"] > 0
        direct = runs["direct"]["goodput_rps"]
        assert run["ratio_to_direct"] == pytest.approx(run["goodput_rps"] / direct)
        assert run["per_class"]["interactive"]["ttft_p99_s"] is not None
    # The sidecar really ran: it admitted requests and, at twice the capacity, refused some.
    side = runs["sidecar"]["admission"]
    assert sum(v for k, v in side.items() if k.endswith("/admitted")) > 20
    assert runs["sidecar"]["overall"]["outcomes"]["429"] > 0
    # Envoy really limited the backend: requests went through it, and some overflowed.
    cb = runs["envoy-cb"]["admission"]
    assert cb["upstream_rq_total"] > 20 and cb["upstream_rq_pending_overflow"] > 0
    assert runs["envoy-cb"]["overall"]["outcomes"]["5xx"] > 0
    # Direct has no admission control: nothing is refused at the door.
    assert runs["direct"]["overall"]["outcomes"]["429"] == 0
    assert runs["direct"]["overall"]["outcomes"]["5xx"] == 0
    primary = {t["name"] for t in doc["targets"] if t["primary"]}
    assert primary == {
        "goodput >= 1.25x direct (req/s)",
        "goodput > envoy-cb (req/s)",
        "interactive p99 TTFT < 2 s (from arrival)",
        "wasted work < 5%",
    }
