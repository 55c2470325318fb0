"""deploy/prometheus/ and deploy/grafana/: the alerting and recording rules and the dashboard
are checked against the metric names and label values a live sidecar exports (with an adaptive
shared pool, so that the pool's gauges are there too); `promtool check
rules` / `promtool test rules` run too, and promtool parses every dashboard query, when promtool
is installed (`apt-get install prometheus`). CI (.ci/run) installs it and sets
LLM_EXTPROC_REQUIRE_TOOLS=1, which turns its absence into a failure instead of a skip.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from extproc.app import Sidecar
from extproc.config.policy import AdaptivePolicy, OverloadPolicy, policy_from_yaml
from extproc.ops.metrics import POOL_GAUGES
from extproc.outcome import Outcome
from extproc.pool.control.overload import OverloadMonitor, OverloadState
from extproc.pool.core.values import Entry
from extproc.pool.gate import Slot
from testing.stack import REPO
from testing.tools import optional_tool

DEPLOY = REPO / "deploy"


# A vLLM /metrics page whose histograms grow by 10 observations per scrape (COUNT), so the windowed
# quantiles exist from the second scrape on.
VLLM_PAGE = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.25
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} COUNT
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} COUNT
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{le="0.01",model_name="m"} COUNT
vllm:inter_token_latency_seconds_bucket{le="+Inf",model_name="m"} COUNT
# TYPE vllm:request_time_per_output_token_seconds histogram
vllm:request_time_per_output_token_seconds_bucket{le="0.01",model_name="m"} COUNT
vllm:request_time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} COUNT
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{le="0.3",model_name="m"} COUNT
vllm:request_queue_time_seconds_bucket{le="+Inf",model_name="m"} COUNT
"""

# An adaptive pool, so that every pool gauge can appear: two bands (one to protect), a token
# bound, vLLM's metrics from the page above.
POOL_POLICY = """
pool:
  max_concurrency: 8
  max_tokens_in_flight: 100000
  adaptive: {min: 1, max: 16, initial: 4, interval: 50ms, window: 5s}
backend: {metrics: ["http://127.0.0.1:PORT/metrics"]}
buckets:
  - {name: interactive, match: {headers: {x-llm-class: interactive}}, priority: 0,
     queue_timeout: 5s, max_queue: 10}
  - {name: batch, priority: 10, queue_timeout: 5s, max_queue: 10}
"""

# The pool's series carry no bucket label: the POOL_GAUGES and the pool's three counters. The
# shared_* gauges appear only in shared mode (Redis): tests/shared scrapes those.
POOL_SERIES = {f"llm_extproc_{name}" for name in POOL_GAUGES if not name.startswith("shared_")} | {
    "llm_extproc_overload_transitions_total",
    "llm_extproc_backend_scrape_errors_total",
    "llm_extproc_adaptive_limit_changes_total",
}


async def fake_vllm() -> asyncio.Server:
    scrapes = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal scrapes
        await reader.readuntil(b"\r\n\r\n")
        scrapes += 1
        body = VLLM_PAGE.replace("COUNT", str(10 * scrapes)).encode()
        head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        writer.write(head.encode() + body)
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Sample names a real sidecar exports: from a live /metrics scrape, with each family's
    type (histograms as _bucket/_sum/_count, counters as _total), since labelled series appear
    only once something was counted. The sidecar runs an adaptive pool against a stand-in for
    vLLM's /metrics, and passes a little protected traffic through its gate, so that the pool
    gauges a policy without a pool (or before anything was measured) leaves out are there."""

    async def scrape() -> str:
        vllm = await fake_vllm()
        port = vllm.sockets[0].getsockname()[1]
        policy = policy_from_yaml(POOL_POLICY.replace("PORT", str(port)))
        sidecar = Sidecar(policy, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")
        await sidecar.start()
        try:
            assert sidecar.gate is not None and sidecar.control is not None
            loop = asyncio.get_running_loop()
            sidecar.control.tick(loop.time())  # the overload window's first totals
            for _ in range(25):  # enough decisions for an eviction rate
                slot = sidecar.gate.enter(Entry(bucket="interactive", timeout_s=5.0, cost=100))
                assert isinstance(slot, Slot)
                slot.release()
            sidecar.control.tick(loop.time())
            url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
            # Every gauge but the shared_* ones, which a sidecar without Redis never exports.
            wanted = {f"llm_extproc_{name}" for name in POOL_GAUGES} & POOL_SERIES
            deadline = loop.time() + 10
            while True:  # the windowed quantiles need a second scrape of the page
                text = await asyncio.to_thread(
                    lambda: urllib.request.urlopen(url, timeout=5).read().decode()
                )
                if all(f"\n{name} " in text for name in wanted) or loop.time() > deadline:
                    return text
                await asyncio.sleep(0.05)
        finally:
            await sidecar.stop(0)
            vllm.close()
            await vllm.wait_closed()

    names = set()
    for family in text_string_to_metric_families(asyncio.run(scrape())):
        suffixes = {
            "counter": ["_total"],
            "histogram": ["_bucket", "_sum", "_count"],
            "gauge": [""],
        }[family.type]
        names |= {family.name + s for s in suffixes}
        if family.name + suffixes[0] in POOL_SERIES:
            assert all("bucket" not in sample.labels for sample in family.samples), family.name
    assert "llm_extproc_requests_total" in names and "llm_extproc_queue_depth" in names
    # Every gauge of the pool's table, each only reported once it has a value, is there.
    assert POOL_SERIES <= names, POOL_SERIES - names
    return names


_NOT_METRICS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers that are not functions, keywords,
    label names (in {...}, by (...), ...), durations or strings."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"(?<![\w:.$])[A-Za-z_:][\w:]*", e):
        if e[m.end() :].lstrip().startswith("(") or m.group(0).lower() in _NOT_METRICS:
            continue
        names.add(m.group(0))
    return names


LABEL_VALUES = {
    "outcome": {str(o) for o in Outcome},
    "action": {"defaulted", "clamped"},
    "result": {"ok", "error"},
    "state": {str(s) for s in OverloadState},
    # AdaptiveLimit.reason (extproc/pool/control/adaptive.py).
    "reason": {
        "initial",
        "increase",
        "ttft",
        "itl",
        "vllm_queue",
        "kv",
        "stale",
        "fallback",
        "resumed",
    },
}


def assert_label_values(expr: str) -> None:
    for label, value in re.findall(r'\b(\w+)\s*=~?\s*"([^"]*)"', expr):
        if label in LABEL_VALUES:
            assert set(value.split("|")) <= LABEL_VALUES[label], f"{label}={value!r} in {expr}"


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "rules.yaml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def alert_threshold(name: str) -> float:
    (rule,) = [r for r in rules() if r.get("alert") == name]
    return float(re.split(r">=?", rule["expr"])[-1])


def test_rules_use_exported_metrics_and_real_label_values(exported: set[str]) -> None:
    recorded = {r["record"] for r in rules() if "record" in r}
    for rule in rules():
        names = metric_names(rule["expr"])
        assert names, rule
        unknown = names - exported - recorded - {"up"}
        assert not unknown, f"{rule.get('record') or rule.get('alert')}: {unknown}"
        assert_label_values(rule["expr"])
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert {
        "LLMExtprocEvictionsHigh",
        "LLMExtprocEvictionsCritical",
        "LLMExtprocDown",
        "LLMExtprocRoutePolicyErrors",
        "LLMExtprocPolicyReloadFailed",
        "LLMExtprocOverloaded",
        "LLMExtprocBackendNeedsCapacity",
        "LLMExtprocBackendMetricsDown",
    } <= alerts
    assert (
        alert_threshold("LLMExtprocEvictionsHigh"),
        alert_threshold("LLMExtprocEvictionsCritical"),
    ) == (0.05, 0.20)
    # The sidecar's own needs_capacity flag (extproc/pool/control/overload.py) is at 20% too.
    assert (
        alert_threshold("LLMExtprocBackendNeedsCapacity")
        == OverloadMonitor(OverloadPolicy()).capacity_rate
    )
    # The header's list of outcomes is complete.
    header = (DEPLOY / "prometheus" / "rules.yaml").read_text().split("groups:")[0]
    assert all(str(o) in header for o in Outcome)


def dashboard() -> dict[str, Any]:
    return json.loads((DEPLOY / "grafana" / "llm-extproc.json").read_text())  # type: ignore[no-any-return]


def dashboard_exprs() -> Iterator[tuple[dict[str, Any], str]]:
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            yield panel, target["expr"]


def test_dashboard_panels_query_exported_metrics(exported: set[str]) -> None:
    d = dashboard()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    m = re.fullmatch(r"label_values\((\w+), bucket\)", variables["bucket"]["query"]["query"])
    assert m and m.group(1) in exported
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for panel, expr in dashboard_exprs():
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        names = metric_names(expr)
        assert names and names <= exported, f"{panel['title']}: {names - exported}"
        # Per-bucket series follow the bucket selection; the pool's have no bucket label (a
        # filter on it would select nothing), and a query does not mix the two.
        if names <= POOL_SERIES:
            assert "bucket" not in expr, panel["title"]
        else:
            assert not names & POOL_SERIES, panel["title"]
            assert 'bucket=~"$bucket"' in expr, panel["title"]
        assert_label_values(expr)
    used = {n for _, expr in dashboard_exprs() for n in metric_names(expr)}
    assert {
        "llm_extproc_queue_depth",
        "llm_extproc_in_flight",
        "llm_extproc_capacity",
        "llm_extproc_queue_wait_seconds_bucket",
        "llm_extproc_requests_total",
        "llm_extproc_max_tokens_adjusted_total",
        "llm_extproc_pool_limit",
        "llm_extproc_pool_in_flight",
        "llm_extproc_pool_queued",
        "llm_extproc_pool_tokens_in_flight",
        "llm_extproc_pool_tokens_limit",
        "llm_extproc_overload_state",
        "llm_extproc_overload_factor",
        "llm_extproc_overload_eviction_rate",
        "llm_extproc_backend_waiting",
        "llm_extproc_backend_running",
        "llm_extproc_backend_kv_usage",
        "llm_extproc_backend_ttft_seconds",
        "llm_extproc_backend_itl_seconds",
        "llm_extproc_backend_tpot_seconds",
        "llm_extproc_backend_queue_time_seconds",
        "llm_extproc_adaptive_state",
        "llm_extproc_adaptive_limit_changes_total",
    } <= used
    # The eviction panels draw the alerts' thresholds.
    (eviction,) = [p for p in d["panels"] if p["title"] == "Eviction rate"]
    steps = eviction["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["value"] for s in steps[1:]] == [
        alert_threshold("LLMExtprocEvictionsHigh"),
        alert_threshold("LLMExtprocEvictionsCritical"),
    ]
    (protected,) = [p for p in d["panels"] if "protected eviction rate" in p["title"]]
    steps = protected["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["value"] for s in steps[1:]] == [alert_threshold("LLMExtprocBackendNeedsCapacity")]
    # The KV panel's line is the adaptive limit's default max_kv_usage.
    (kv,) = [p for p in d["panels"] if p["title"] == "Backend: KV cache usage"]
    steps = kv["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["value"] for s in steps[1:]] == [AdaptivePolicy().max_kv_usage]


def promtool() -> str:
    """promtool's path; without it the test skips (the names were checked above)."""
    found = shutil.which("promtool")
    how = "apt-get install prometheus, or a release from prometheus.io; the names were checked"
    return optional_tool("promtool", found, "promtool", how)


@pytest.mark.promtool
def test_promtool_checks_and_unit_tests_the_rules() -> None:
    tool = promtool()
    for args in (["check", "rules", "rules.yaml"], ["test", "rules", "rules.test.yaml"]):
        out = subprocess.run(
            [tool, *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=DEPLOY / "prometheus",
        )
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.promtool
def test_promtool_parses_the_dashboard_queries(tmp_path: Path) -> None:
    """Grafana's variables replaced by what they expand to, each query becomes a recording
    rule, and promtool's PromQL parser must accept them all."""
    tool = promtool()
    exprs = [
        expr.replace("$__rate_interval", "5m").replace("$bucket", ".*")
        for _, expr in dashboard_exprs()
    ]
    doc = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": e} for i, e in enumerate(exprs)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = subprocess.run(
        [tool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
