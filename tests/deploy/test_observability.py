"""deploy/prometheus/ and deploy/grafana/: the alerting and recording rules and the dashboard
are checked against the metric names and label values a live sidecar exports; `promtool check
rules` / `promtool test rules` run too, and promtool parses every dashboard query, when promtool
is installed (`apt-get install prometheus`). CI (.ci/run) installs it and sets
LLM_EXTPROC_REQUIRE_TOOLS=1, which turns its absence into a failure instead of a skip.
"""

from __future__ import annotations

import asyncio
import json
import os
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

from extproc.app import Sidecar, default_policy
from extproc.outcome import Outcome
from testing.stack import REPO

DEPLOY = REPO / "deploy"


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Sample names a real sidecar exports: from a live /metrics scrape, with each family's
    type (histograms as _bucket/_sum/_count, counters as _total), since labelled series appear
    only once something was counted."""

    async def scrape() -> str:
        sidecar = Sidecar(default_policy(), listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")
        await sidecar.start()
        try:
            url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
            return await asyncio.to_thread(
                lambda: urllib.request.urlopen(url, timeout=5).read().decode()
            )
        finally:
            await sidecar.stop(0)

    names = set()
    for family in text_string_to_metric_families(asyncio.run(scrape())):
        suffixes = {
            "counter": ["_total"],
            "histogram": ["_bucket", "_sum", "_count"],
            "gauge": [""],
        }[family.type]
        names |= {family.name + s for s in suffixes}
    assert "llm_extproc_requests_total" in names and "llm_extproc_queue_depth" in names
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
    return float(rule["expr"].rsplit(">", 1)[1])


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
    } <= alerts
    assert (
        alert_threshold("LLMExtprocEvictionsHigh"),
        alert_threshold("LLMExtprocEvictionsCritical"),
    ) == (0.05, 0.20)
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
    } <= used
    # The eviction panel draws the alerts' thresholds.
    (eviction,) = [p for p in d["panels"] if p["title"] == "Eviction rate"]
    steps = eviction["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["value"] for s in steps[1:]] == [
        alert_threshold("LLMExtprocEvictionsHigh"),
        alert_threshold("LLMExtprocEvictionsCritical"),
    ]


def promtool() -> str | None:
    found = shutil.which("promtool")
    if found is None and os.environ.get("LLM_EXTPROC_REQUIRE_TOOLS"):
        pytest.fail("LLM_EXTPROC_REQUIRE_TOOLS is set but promtool is not on PATH")
    return found


def test_promtool_checks_and_unit_tests_the_rules() -> None:
    tool = promtool()
    if tool is None:
        pytest.skip("promtool not installed (apt-get install prometheus); names were checked")
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


def test_promtool_parses_the_dashboard_queries(tmp_path: Path) -> None:
    """Grafana's variables replaced by what they expand to, each query becomes a recording
    rule, and promtool's PromQL parser must accept them all."""
    tool = promtool()
    if tool is None:
        pytest.skip("promtool not installed (apt-get install prometheus); names were checked")
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
