"""deploy/k8s: each overlay (`kubectl apply -k deploy/k8s/overlays/NAME`) makes well-formed
objects that fit together, without a cluster. Built here (tests/deploy/kustomize.py) and, where
kubectl is installed, by the real `kubectl kustomize` too, which must agree with that reading,
order its output so that it applies (the Namespace first), and pass the same checks. Checked:
every object against a small hand-written schema of its kind (tests/deploy/k8s_schemas.yaml, not
the official ones), each in the llm-extproc namespace (the gateway's EnvoyFilter aside), every
selector selecting the pods it is for, the Services' ports leading to container ports, a
disruption budget for the sidecar that never lets a voluntary eviction take its last pod, the
policy's pool as the overlay's replicas need it, the PodMonitor's job what the rules' "down"
alerts select, and the PrometheusRule carrying deploy/prometheus/rules.yaml's groups, generated
by deploy/k8s/render.py. Also: every alert links its section of docs/troubleshooting.md.
"""

from __future__ import annotations

import re
import urllib.parse
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from extproc.config.policy import Policy, policy_from_yaml
from testing.dockerfile import flag
from testing.stack import REPO
from tests.deploy.kustomize import K8S, OVERLAYS, build, key, kubectl_build, named

RULES = REPO / "deploy" / "prometheus" / "rules.yaml"
TROUBLESHOOTING = REPO / "docs" / "troubleshooting.md"
RUNBOOK_BASE = "https://github.com/llm-extproc/llm-extproc/blob/main/docs/troubleshooting.md"
SCHEMAS = yaml.safe_load((Path(__file__).parent / "k8s_schemas.yaml").read_text())
NAMESPACE = "llm-extproc"
SIDECAR = "llm-extproc"
ISTIO_GROUPS = ("networking.istio.io/", "security.istio.io/")
# Namespaces an overlay puts objects in without creating them: the Istio gateway's.
EXTERNAL_NAMESPACES = {"istio-system"}

Object = dict[str, Any]


def overlay(name: str) -> list[Object]:
    return build(K8S / "overlays" / name)


def schema_for(obj: Object) -> dict[str, Any]:
    """The hand-written schema of ``obj``'s apiVersion and kind, within the common envelope."""
    api, kind = obj.get("apiVersion"), obj.get("kind")
    ours = SCHEMAS["kinds"].get(f"{api}/{kind}")
    assert ours is not None, f"no schema for {api} {kind} in tests/deploy/k8s_schemas.yaml"
    envelope = {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata"],
        "propertyNames": {"enum": ["apiVersion", "kind", "metadata", *ours.get("properties", {})]},
        "properties": {"metadata": {"$ref": "#/$defs/metadata"}},
    }
    parts = [envelope, ours] + ([] if kind == "Namespace" else [{"$ref": "#/$defs/namespaced"}])
    return {"$defs": SCHEMAS["$defs"], "allOf": parts}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def pods_selected(objects: list[Object], selector: dict[str, str]) -> list[Object]:
    """The Deployments whose pods ``selector`` (matchLabels) selects."""
    return [
        d
        for d in objects
        if d["kind"] == "Deployment"
        and selects(selector, d["spec"]["template"]["metadata"]["labels"])
    ]


def the_pods_of(objects: list[Object], selector: dict[str, str], what: str) -> Object:
    selected = pods_selected(objects, selector)
    assert len(selected) == 1, f"{what}: selects {[key(d) for d in selected]}, not one Deployment"
    return selected[0]


def container_ports(deployment: Object) -> dict[str, int]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def policy_of(objects: list[Object]) -> Policy:
    config_map = named(objects, "ConfigMap", "llm-extproc-policy")
    return policy_from_yaml(config_map["data"]["policy.yaml"], "ConfigMap")


def string_keys(value: Any) -> bool:
    """Every map key in ``value`` is a string (YAML's `9464:` is an integer, which kustomize
    refuses: write `"9464":`)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and string_keys(v) for k, v in value.items())
    if isinstance(value, list):
        return all(string_keys(v) for v in value)
    return True


def rules() -> dict[str, Any]:
    return yaml.safe_load(RULES.read_text())  # type: ignore[no-any-return]


def check_overlay(name: str, objects: list[Object]) -> None:
    """Everything the module docstring lists, on one overlay's objects (in any order)."""
    keys = [key(o) for o in objects]
    assert len(set(keys)) == len(keys), f"{name}: an object twice"
    for obj in objects:
        jsonschema.validate(obj, schema_for(obj))
        assert string_keys(obj), f"{key(obj)}: a map key that is not a string (kustomize fails)"

    # One namespace, the gateway's EnvoyFilter aside (it must sit beside the gateway it patches).
    for obj in objects:
        ns = obj["metadata"].get("namespace")
        if obj["kind"] == "Namespace":
            assert obj["metadata"]["name"] == NAMESPACE
        elif ns != NAMESPACE:
            assert (obj["kind"], ns) == ("EnvoyFilter", "istio-system"), key(obj)
            contexts = {p["match"]["context"] for p in obj["spec"]["configPatches"]}
            assert contexts == {"GATEWAY"}, key(obj)

    # Deployments: the selector is the pods', the service account and ConfigMaps exist, and
    # the policy flag names a key of the mounted ConfigMap.
    deployments = [o for o in objects if o["kind"] == "Deployment"]
    for d in deployments:
        pod = d["spec"]["template"]
        assert selects(d["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
        assert pods_selected(objects, d["spec"]["selector"]["matchLabels"]) == [d], key(d)
        named(objects, "ServiceAccount", pod["spec"]["serviceAccountName"])
        for volume in pod["spec"].get("volumes", []):
            if "configMap" in volume:
                named(objects, "ConfigMap", volume["configMap"]["name"])
    sidecar = named(objects, "Deployment", SIDECAR)
    pod = sidecar["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    (mount,) = container["volumeMounts"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    policy_file = flag(container["args"], "--policy")
    assert policy_file.startswith(mount["mountPath"] + "/")
    config_map = named(objects, "ConfigMap", volume["configMap"]["name"])
    assert policy_file.removeprefix(mount["mountPath"] + "/") in config_map["data"]
    assert flag(container["args"], "--listen") == f"0.0.0.0:{container_ports(sidecar)['grpc']}"

    # Services lead to container ports of the one Deployment they select.
    for service in (o for o in objects if o["kind"] == "Service"):
        target = the_pods_of(objects, service["spec"]["selector"], str(key(service)))
        ports = container_ports(target)
        for port in service["spec"]["ports"]:
            wanted = port["targetPort"]
            assert wanted in ports or wanted in ports.values(), (key(service), port)
    assert named(objects, "Service", SIDECAR)["spec"].get("clusterIP") != "None"

    # A disruption budget for the sidecar: a voluntary eviction never takes its last pod.
    (pdb,) = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    assert the_pods_of(objects, pdb["spec"]["selector"]["matchLabels"], "PDB") is sidecar
    replicas = sidecar["spec"]["replicas"]
    if "minAvailable" in pdb["spec"]:
        assert 1 <= pdb["spec"]["minAvailable"] <= replicas
    else:
        assert 1 <= pdb["spec"]["maxUnavailable"] < replicas
    # A rollout starts the new pod before the old one stops.
    assert sidecar["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}

    # Who may connect: each policy selects one Deployment's pods, on ports they listen on (or
    # Istio's agent's, 15020, beside the sidecar in the mesh).
    for obj in objects:
        if obj["kind"] == "NetworkPolicy":
            target = the_pods_of(objects, obj["spec"]["podSelector"]["matchLabels"], str(key(obj)))
            listened = set(container_ports(target).values()) | {15020}
            for rule in obj["spec"]["ingress"]:
                assert {p["port"] for p in rule["ports"]} <= listened, key(obj)
        elif obj["kind"] in ("PeerAuthentication", "AuthorizationPolicy"):
            the_pods_of(objects, obj["spec"]["selector"]["matchLabels"], str(key(obj)))
        elif obj["kind"] == "EnvoyFilter" and obj["metadata"]["namespace"] == NAMESPACE:
            selector = obj["spec"]["workloadSelector"]["labels"]
            assert the_pods_of(objects, selector, str(key(obj))) is sidecar

    # The policy: a pool of its own for one replica; shared through the overlay's Redis,
    # counting the Deployment's replicas, for several.
    policy = policy_of(objects)
    assert policy.pool is not None
    if replicas == 1:
        assert policy.pool.shared is None
    else:
        shared = policy.pool.shared
        assert shared is not None and shared.replicas == replicas
        url = urllib.parse.urlsplit(shared.redis)
        redis = named(objects, "Service", "llm-extproc-redis")
        assert url.hostname == f"llm-extproc-redis.{NAMESPACE}.svc.cluster.local"
        assert url.port in {p["port"] for p in redis["spec"]["ports"]}
        assert named(objects, "Deployment", "llm-extproc-redis")["spec"]["replicas"] == 1

    # Monitoring: the PodMonitor scrapes the sidecar's metrics port as the job the "down"
    # alerts select; the PrometheusRule is rules.yaml.
    monitor = named(objects, "PodMonitor", SIDECAR)
    assert the_pods_of(objects, monitor["spec"]["selector"]["matchLabels"], "PodMonitor") is sidecar
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert container_ports(sidecar)[endpoint["port"]] == 9464
    job = pod["metadata"]["labels"][monitor["spec"]["jobLabel"]]
    for rule in (r for g in rules()["groups"] for r in g["rules"] if "up{" in r["expr"]):
        assert f'up{{job="{job}"}}' in rule["expr"], rule["alert"]
    assert named(objects, "PrometheusRule", SIDECAR)["spec"] == rules()


@pytest.mark.parametrize("name", OVERLAYS)
def test_overlay_objects_are_well_formed_and_fit_together(name: str) -> None:
    check_overlay(name, overlay(name))


def api_groups(objects: list[Object]) -> set[str]:
    return {o["apiVersion"] for o in objects}


def test_what_each_overlay_adds() -> None:
    """plain: one replica, no Redis, nothing of Istio's; shared: three replicas and their
    Redis; istio: shared, in the mesh, with the gateway's patch."""
    plain, shared, istio = (overlay(n) for n in OVERLAYS)
    assert not any(g.startswith(ISTIO_GROUPS) for g in api_groups(plain) | api_groups(shared))
    assert named(plain, "Deployment", SIDECAR)["spec"]["replicas"] == 1
    assert not [o for o in plain if "redis" in o["metadata"]["name"]]
    assert named(shared, "Deployment", SIDECAR)["spec"]["replicas"] == 3
    assert {key(o) for o in shared} < {key(o) for o in istio}
    assert named(istio, "Namespace", NAMESPACE)["metadata"]["labels"] == {
        "istio-injection": "enabled"
    }
    for name in (SIDECAR, "llm-extproc-redis"):
        labels = named(istio, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert labels["sidecar.istio.io/inject"] == "true", name
    # Outside the mesh the base's NetworkPolicy admits labelled clients; in it, the gateway.
    for objects, peer in (
        (plain, {"llm-extproc/client": "true"}),
        (istio, {"istio": "ingressgateway"}),
    ):
        grpc_rule = named(objects, "NetworkPolicy", SIDECAR)["spec"]["ingress"][0]
        assert [p["port"] for p in grpc_rule["ports"]] == [50051]
        assert [f["podSelector"]["matchLabels"] for f in grpc_rule["from"]] == [peer]


def test_shared_policy_is_the_base_policy_with_a_shared_pool() -> None:
    """The two policy files differ in pool.shared only, so an edit to one reaches the other."""
    base = yaml.safe_load((K8S / "base" / "policy.yaml").read_text())
    shared = yaml.safe_load((K8S / "components" / "shared-pool" / "policy.yaml").read_text())
    assert "shared" in shared["pool"] and "shared" not in base["pool"]
    del shared["pool"]["shared"]
    assert shared == base


def test_prometheus_rule_is_rendered_from_rules_yaml() -> None:
    from importlib import util

    spec = util.spec_from_file_location("k8s_render", K8S / "render.py")
    assert spec is not None and spec.loader is not None
    render = util.module_from_spec(spec)
    spec.loader.exec_module(render)
    output = K8S / "components" / "monitoring" / "prometheusrule.yaml"
    assert output.read_text() == render.render_text(), "run python deploy/k8s/render.py"
    assert yaml.safe_load(output.read_text())["spec"] == rules()


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as
    hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_alert_links_its_troubleshooting_section() -> None:
    """Each alert's runbook_url is docs/troubleshooting.md at the heading named after it."""
    alerts = [r for g in rules()["groups"] for r in g["rules"] if "alert" in r]
    assert alerts
    for alert in alerts:
        url = alert["annotations"].get("runbook_url")
        assert url == f"{RUNBOOK_BASE}#{alert['alert'].lower()}", alert["alert"]
    assert TROUBLESHOOTING.exists(), "docs/troubleshooting.md: the alerts' runbook is missing"
    headings = re.findall(r"^#{1,6} +(.+?) *#*$", TROUBLESHOOTING.read_text(), re.MULTILINE)
    anchors = {github_anchor(h) for h in headings}
    missing = [a["alert"] for a in alerts if a["alert"].lower() not in anchors]
    assert not missing, f"docs/troubleshooting.md has no heading for {missing}"


@pytest.mark.kubectl
@pytest.mark.parametrize("name", OVERLAYS)
def test_kubectl_kustomize_renders_each_overlay_in_apply_order(name: str) -> None:
    """The real `kubectl kustomize` makes what tests/deploy/kustomize.py reads, in an order
    `kubectl apply -k` can apply in one go: the Namespace first, every object after the
    Namespace it lives in (the gateway's exists already), and each Deployment after the
    ServiceAccount and ConfigMap its pods use. The same checks hold for its output."""
    objects = kubectl_build(K8S / "overlays" / name)
    assert sorted(objects, key=key) == sorted(overlay(name), key=key)
    check_overlay(name, objects)
    assert objects[0]["kind"] == "Namespace"
    seen: set[tuple[str, str, str]] = set()
    for obj in objects:
        ns = obj["metadata"].get("namespace")
        if ns is not None and ns not in EXTERNAL_NAMESPACES:
            assert ("Namespace", "", ns) in seen, key(obj)
        if obj["kind"] == "Deployment":
            pod = obj["spec"]["template"]["spec"]
            assert ("ServiceAccount", ns, pod["serviceAccountName"]) in seen, key(obj)
            for volume in pod.get("volumes", []):
                if "configMap" in volume:
                    assert ("ConfigMap", ns, volume["configMap"]["name"]) in seen, key(obj)
        seen.add(key(obj))
