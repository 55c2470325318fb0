"""deploy/autoscaling/: the KEDA ScaledObject, the HPA and prometheus-adapter's rules, checked
without a cluster. Every PromQL query in them is read out of the YAML (prometheus-adapter's
templates expanded as the adapter expands them), must select only metrics a live sidecar
exports, with real label values (tests/deploy/test_observability.py's ``exported`` and
checks), and must parse with promtool (``promtool check rules`` on a rule file made of them).
promtool's evaluator then runs the ScaledObject's triggers and the adapter's metric on two
histories, the backend at zero replicas (as tests/e2e/test_scale_from_zero.py pins it: requests
counted, nothing queued) and under load, and KEDA's arithmetic on the results gives the
replicas docs/autoscaling.md says. The names agree with deploy/istio/ and with
deploy/prometheus/rules.yaml's scrape job.
"""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config.policy import OverloadPolicy
from extproc.pool.control.overload import OverloadMonitor
from testing.stack import REPO
from tests.deploy.test_observability import (
    assert_label_values,
    exported,
    metric_names,
    promtool,
    rules,
)

__all__ = ["exported"]  # the fixture, imported for the tests below

AUTOSCALING = REPO / "deploy" / "autoscaling"
ROUTES = REPO / "deploy" / "istio" / "examples" / "routes.yaml"


def manifest(name: str) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all((AUTOSCALING / name).read_text()) if d]
    return doc  # type: ignore[no-any-return]


def scaled_object() -> dict[str, Any]:
    return manifest("keda-scaledobject.yaml")


def triggers() -> dict[str, dict[str, Any]]:
    out = {t["name"]: t for t in scaled_object()["spec"]["triggers"]}
    assert all(t["type"] == "prometheus" for t in out.values())
    return out


def adapter_rules() -> list[dict[str, Any]]:
    config = yaml.safe_load(manifest("prometheus-adapter.yaml")["data"]["config.yaml"])
    return config["externalRules"]  # type: ignore[no-any-return]


def expand(rule: dict[str, Any], matchers: str = "") -> str:
    """The adapter's metricsQuery as it sends it: ``<<.Series>>`` the seriesQuery's metric,
    ``<<.LabelMatchers>>`` the HPA's metric selector (``matchers``), ``<<.GroupBy>>`` none."""
    m = re.match(r"[A-Za-z_:][\w:]*", rule["seriesQuery"])
    assert m, rule["seriesQuery"]
    query = str(rule["metricsQuery"])
    for template, value in (
        ("<<.Series>>", m.group(0)),
        ("<<.LabelMatchers>>", matchers),
        ("<<.GroupBy>>", ""),
    ):
        query = query.replace(template, value)
    assert "<<" not in query, query
    return query


def record_name(where: str) -> str:
    """A query's place as a recording rule's name."""
    return "autoscaling:" + re.sub(r"\W", "_", where)


def queries() -> dict[str, str]:
    """Every query of the manifests, by where it is."""
    out = {f"keda:{name}": t["metadata"]["query"] for name, t in triggers().items()}
    for rule in adapter_rules():
        name = rule["name"]["as"]
        out[f"adapter:{name}"] = expand(rule)
        out[f"adapter:{name}:selected"] = expand(rule, 'instance="a"')
    return out


def test_manifests_scale_the_backend_of_deploy_istio() -> None:
    so, hpa = scaled_object(), manifest("hpa.yaml")
    # The backend deploy/istio routes to: Service vllm in namespace llm.
    hosts = {
        d["destination"]["host"]
        for doc in yaml.safe_load_all(ROUTES.read_text())
        if doc and doc["kind"] == "VirtualService"
        for route in doc["spec"]["http"]
        for d in route.get("route", [])
    }
    assert hosts == {"vllm.llm.svc.cluster.local"}
    for doc in (so, hpa):
        assert doc["metadata"]["namespace"] == "llm"
        assert doc["spec"]["scaleTargetRef"]["name"] == "vllm"
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    # From zero: KEDA at 0, every trigger active above its activation threshold.
    assert so["spec"]["minReplicaCount"] == 0
    assert all("activationThreshold" in t["metadata"] for t in triggers().values())
    # The HPA's metrics are the adapter's, at the ScaledObject's target for the same demand.
    exposed = {r["name"]["as"] for r in adapter_rules()}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External" and metric["external"]["metric"]["name"] in exposed
    assert (
        metric["external"]["target"]["averageValue"]
        == triggers()["demand"]["metadata"]["threshold"]
    )
    assert all(r["resources"]["namespaced"] is False for r in adapter_rules())
    assert hpa["spec"]["maxReplicas"] == so["spec"]["maxReplicaCount"]
    # Every query selects the scrape job the alerts watch (rules.yaml's LLMExtprocDown).
    (down,) = [r for r in rules() if r.get("alert") == "LLMExtprocDown"]
    (job,) = re.findall(r'job="([^"]+)"', down["expr"])
    for where, query in queries().items():
        jobs = re.findall(r'\bjob="([^"]+)"', query)
        assert jobs and set(jobs) == {job}, where


def test_needs_capacity_rule_uses_the_sidecars_threshold() -> None:
    (rule,) = [r for r in rules() if r.get("record") == "llm_extproc:needs_capacity"]
    (rate,) = re.findall(r"eviction_rate\)\s*>=\s*bool\s*([\d.]+)", rule["expr"])
    assert float(rate) == OverloadMonitor(OverloadPolicy()).capacity_rate


def test_queries_use_exported_metrics_and_real_label_values(exported: set[str]) -> None:
    for where, query in queries().items():
        names = metric_names(query)
        assert names and names <= exported, f"{where}: {names - exported}"
        assert_label_values(query)


def check_rules(tool: str, path: Path, exprs: dict[str, str]) -> None:
    doc = {
        "groups": [
            {
                "name": "autoscaling",
                "rules": [{"record": record, "expr": expr} for record, expr in exprs.items()],
            }
        ]
    }
    path.write_text(yaml.safe_dump(doc))
    run_promtool(tool, "check", "rules", path.name, cwd=path.parent)


def run_promtool(tool: str, *args: str, cwd: Path) -> None:
    out = subprocess.run([tool, *args], capture_output=True, text=True, timeout=60, cwd=cwd)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.promtool
def test_promtool_parses_every_query(tmp_path: Path) -> None:
    exprs = {record_name(where): q for where, q in queries().items()}
    check_rules(promtool(), tmp_path / "autoscaling-rules.yaml", exprs)


# Two histories, one sample a minute for 10 minutes, of two sidecar replicas (a, b):
# zero replicas: each sidecar counts 60 requests a minute (admitted, then Envoy's 503), and
# nothing is ever in flight or queued; under load: 32 in flight on each, 40 and 30 queued.
HISTORIES: dict[str, dict[str, dict[str, float]]] = {
    "zero": {
        "llm_extproc_pool_in_flight": {"a": 0, "b": 0},
        "llm_extproc_pool_queued": {"a": 0, "b": 0},
        "per_minute": {"a": 60, "b": 60},
    },
    "load": {
        "llm_extproc_pool_in_flight": {"a": 32, "b": 32},
        "llm_extproc_pool_queued": {"a": 40, "b": 30},
        "per_minute": {"a": 600, "b": 600},
    },
}


def input_series(history: dict[str, dict[str, float]]) -> list[dict[str, str]]:
    out = []
    for instance in ("a", "b"):
        labels = f'job="llm-extproc",instance="{instance}"'
        out.extend(
            {"series": f"{gauge}{{{labels}}}", "values": f"{history[gauge][instance]}x10"}
            for gauge in ("llm_extproc_pool_in_flight", "llm_extproc_pool_queued")
        )
        counted = f'llm_extproc_requests_total{{{labels},bucket="all",outcome="admitted"}}'
        out.append({"series": counted, "values": f"0+{history['per_minute'][instance]}x10"})
        # Refused before a bucket was chosen: not demand for the backend.
        refused = f'llm_extproc_requests_total{{{labels},bucket="none",outcome="rejected_invalid"}}'
        out.append({"series": refused, "values": "0+600x10"})
    return out


def keda_replicas(value: float, trigger: dict[str, Any], current: int) -> int:
    """What KEDA makes of one prometheus trigger (AverageValue): active above the activation
    threshold (0 -> 1), then ceil(value / threshold) replicas, at least 1 while active."""
    meta = trigger["metadata"]
    if value <= float(meta["activationThreshold"]):
        return current if current > 0 else 0
    return max(1, math.ceil(value / float(meta["threshold"])))


@pytest.mark.promtool
def test_promtool_evaluates_the_triggers_from_zero_and_under_load(tmp_path: Path) -> None:
    tool = promtool()
    exprs = {record_name(where): q for where, q in queries().items()}
    check_rules(tool, tmp_path / "autoscaling-rules.yaml", exprs)
    expected: dict[str, dict[str, float]] = {}
    for name, h in HISTORIES.items():
        demand = sum(h["llm_extproc_pool_in_flight"].values()) + sum(
            h["llm_extproc_pool_queued"].values()
        )
        arrivals = sum(h["per_minute"].values()) / 60  # per second, bucket "none" left out
        expected[name] = {
            "autoscaling:keda_demand": demand,
            "autoscaling:keda_arrivals": arrivals,
            "autoscaling:adapter_llm_extproc_demand": demand,
            # The selector keeps sidecar a only.
            "autoscaling:adapter_llm_extproc_demand_selected": h["llm_extproc_pool_in_flight"]["a"]
            + h["llm_extproc_pool_queued"]["a"],
        }
    assert set(expected["zero"]) == set(exprs)
    tests = {
        "rule_files": ["autoscaling-rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": input_series(HISTORIES[name]),
                "promql_expr_test": [
                    {
                        "expr": record,
                        "eval_time": "9m",
                        "exp_samples": [{"labels": record, "value": value}],
                    }
                    for record, value in values.items()
                ],
            }
            for name, values in expected.items()
        ],
    }
    (tmp_path / "autoscaling.test.yaml").write_text(yaml.safe_dump(tests))
    run_promtool(tool, "test", "rules", "autoscaling.test.yaml", cwd=tmp_path)
    # What KEDA does with those values (docs/autoscaling.md): at zero replicas only the
    # arrivals wake the Deployment, to one replica; under load the demand sizes it.
    t = triggers()
    zero, load = expected["zero"], expected["load"]
    assert keda_replicas(zero["autoscaling:keda_demand"], t["demand"], 0) == 0
    assert keda_replicas(zero["autoscaling:keda_arrivals"], t["arrivals"], 0) == 1
    assert keda_replicas(load["autoscaling:keda_arrivals"], t["arrivals"], 1) == 1
    replicas = keda_replicas(load["autoscaling:keda_demand"], t["demand"], 1)
    assert replicas == math.ceil(134 / 32) == 5
    assert replicas <= scaled_object()["spec"]["maxReplicaCount"]
