"""deploy/istio/, checked without a cluster: the EnvoyFilter patches are applied to a filter
chain as Istio applies them and compared with envoy/envoy.yaml; the sidecar's manifests are
checked against the EnvoyFilter and the policy schema; the example routes, translated as Istio
would, make a config the real Envoy 1.40 accepts. Two facts deploy/istio/README.md rests on
(how ext_proc is scoped to routes, and that route header edits come after ext_proc) are pinned
by running the real Envoy.
"""

from __future__ import annotations

import copy
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from extproc.config.policy import policy_from_yaml
from testing.dockerfile import flag
from testing.envoy import (
    EXT_PROC_FILTER,
    EXT_PROC_PER_ROUTE_TYPE,
    HEADER_MUTATION_FILTER,
    ROUTER_FILTER,
    added_clusters,
    apply_filter_patches,
    assert_policy_fits,
    assert_valid,
    cluster_named,
    endpoint_address,
    envoy_filter_patches,
    hcm_config,
    http_filter_named,
    istio_docs,
    istio_merge,
    minimal_bootstrap,
    minimal_listener,
    router_filter,
    shipped_envoy,
    static_cluster,
    virtual_service_routes,
    without_address,
)
from testing.stack import REPO, free_port, running_envoy

DEPLOY = REPO / "deploy"
ROUTES_EXAMPLE = DEPLOY / "istio" / "examples" / "routes.yaml"


def extproc_manifests() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in istio_docs(DEPLOY / "istio" / "extproc.yaml")}


ENVOY_FILTERS = [
    DEPLOY / "istio" / "envoyfilter-gateway.yaml",
    DEPLOY / "istio" / "examples" / "sidecar-inbound.yaml",
]


@pytest.mark.parametrize("path", ENVOY_FILTERS, ids=lambda p: p.name)
def test_istio_filters_and_cluster_are_those_of_envoy_yaml(path: Path) -> None:
    shipped = shipped_envoy()
    patches = envoy_filter_patches(path)
    chain = [router_filter()]
    apply_filter_patches(patches, chain)
    assert [f["name"] for f in chain] == [HEADER_MUTATION_FILTER, EXT_PROC_FILTER, ROUTER_FILTER]
    for f in chain[:2]:
        assert f["typed_config"] == http_filter_named(shipped, f["name"])["typed_config"], f["name"]
    (ours,) = added_clusters(patches)
    assert without_address(ours) == without_address(cluster_named(shipped, "llm_extproc"))
    assert ours["type"] == "STRICT_DNS"
    # It points at the sidecar's Service, on the port the container listens on.
    manifests = extproc_manifests()
    service, deployment = manifests["Service"], manifests["Deployment"]
    meta = service["metadata"]
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert endpoint_address(ours) == (
        f"{meta['name']}.{meta['namespace']}.svc.cluster.local",
        grpc["port"],
    )
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert flag(container["args"], "--listen") == f"0.0.0.0:{grpc['port']}"
    assert ours["name"] == chain[1]["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]


def test_istio_configmap_policy_loads_and_fits_the_envoyfilter() -> None:
    manifests = extproc_manifests()
    policy = policy_from_yaml(manifests["ConfigMap"]["data"]["policy.yaml"], "ConfigMap")
    patches = envoy_filter_patches(ENVOY_FILTERS[0])
    chain: list[dict[str, Any]] = []
    apply_filter_patches([p for p in patches if p["patch"]["operation"] == "INSERT_FIRST"], chain)
    chain += [p["patch"]["value"] for p in patches if p["patch"]["operation"] == "INSERT_BEFORE"]
    (ours,) = added_clusters(patches)
    assert_policy_fits(policy, chain, ours)


def test_istio_sidecar_deployment() -> None:
    manifests = extproc_manifests()
    deployment, service = manifests["Deployment"], manifests["Service"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert deployment["spec"]["replicas"] == 1  # admission state lives in one process
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["readinessProbe"]["grpc"]["port"] == 50051
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "grpc": 50051,
        "http-metrics": 9464,
    }
    assert container["resources"]["requests"] and container["resources"]["limits"]
    # The policy file is the ConfigMap's key, in the mounted folder.
    (mount,) = container["volumeMounts"]
    (volume,) = pod["spec"]["volumes"]
    assert volume["configMap"]["name"] == manifests["ConfigMap"]["metadata"]["name"]
    assert flag(container["args"], "--policy") == f"{mount['mountPath']}/policy.yaml"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    # Drain: preStop, then up to --grace (the CLI default) within the termination period.
    prestop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > prestop + 30
    for doc in manifests.values():
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == manifests["Namespace"]["metadata"]["name"]


def test_istio_gateway_with_example_routes_validates_in_envoy(tmp_path: Path) -> None:
    """The gateway EnvoyFilter's filters and cluster, plus the example routes with their
    HTTP_ROUTE merge patches applied, make a config the real Envoy accepts."""
    patches = envoy_filter_patches(ENVOY_FILTERS[0])
    chain = [router_filter()]
    apply_filter_patches(patches, chain)
    routes = virtual_service_routes(ROUTES_EXAMPLE)
    by_name = {r["name"]: r for r in routes}
    (route_filter,) = [d for d in istio_docs(ROUTES_EXAMPLE) if d["kind"] == "EnvoyFilter"]
    for p in route_filter["spec"]["configPatches"]:
        assert p["applyTo"] == "HTTP_ROUTE" and p["patch"]["operation"] == "MERGE"
        istio_merge(
            by_name[p["match"]["routeConfiguration"]["vhost"]["route"]["name"]], p["patch"]["value"]
        )
    # The metadata names a bucket of the ConfigMap's policy; the catch-all skips ext_proc.
    policy = policy_from_yaml(extproc_manifests()["ConfigMap"]["data"]["policy.yaml"])
    bucket = by_name["llm-priority"]["metadata"]["filter_metadata"]["llm_extproc"]["bucket"]
    assert bucket in {b.name for b in policy.buckets}
    assert by_name["llm-other"]["typed_per_filter_config"][EXT_PROC_FILTER]["disabled"] is True
    # LLM routes echo the effective max_tokens, as envoy/envoy.yaml's virtual host does.
    (vhost,) = hcm_config(shipped_envoy())["route_config"]["virtual_hosts"]
    for name in ("llm-priority", "llm-chat", "llm-completions"):
        assert by_name[name]["response_headers_to_add"] == vhost["response_headers_to_add"], name
    clusters = [*added_clusters(patches), static_cluster("backend", 8000)]
    assert_valid(minimal_bootstrap(chain, clusters, routes), tmp_path)
    sidecar_chain = [router_filter()]
    sidecar_patches = envoy_filter_patches(ENVOY_FILTERS[1])
    apply_filter_patches(sidecar_patches, sidecar_chain)
    clusters = [*added_clusters(sidecar_patches), static_cluster("backend", 8000)]
    assert_valid(minimal_bootstrap(sidecar_chain, clusters, routes), tmp_path)


def test_ext_proc_default_on_and_opt_in_modes_with_the_real_envoy(tmp_path: Path) -> None:
    """Pins what deploy/istio/README.md says about the two ways to scope ext_proc, on Envoy
    1.40, with the gateway EnvoyFilter's own filter config and the sidecar unreachable (so a
    route where ext_proc runs answers 500, fail-closed, and one where it does not answers 200):
    - default on: every route runs it, unless the route has ExtProcPerRoute `disabled: true`;
    - opt-in (`disabled: true` on the filter): only routes with an ExtProcPerRoute run it."""
    patches = envoy_filter_patches(ENVOY_FILTERS[0])
    (ext_proc,) = [
        p["patch"]["value"] for p in patches if p["patch"]["value"].get("name") == EXT_PROC_FILTER
    ]
    (ours,) = added_clusters(patches)
    dead = static_cluster(ours["name"], free_port())  # nothing listens there
    dead["typed_extension_protocol_options"] = ours["typed_extension_protocol_options"]

    def per_route(config: dict[str, Any]) -> dict[str, Any]:
        return {EXT_PROC_FILTER: {"@type": EXT_PROC_PER_ROUTE_TYPE, **config}}

    def direct(path: str, **extra: Any) -> dict[str, Any]:
        return {
            "match": {"path": path},
            "direct_response": {"status": 200, "body": {"inline_string": "ok"}},
            **extra,
        }

    default_port, opt_in_port = free_port(), free_port()
    opt_in_filter = {**copy.deepcopy(ext_proc), "disabled": True}
    cfg = {
        "static_resources": {
            "listeners": [
                minimal_listener(
                    [copy.deepcopy(ext_proc), router_filter()],
                    [
                        direct("/v1/chat/completions"),
                        direct("/v1/models", typed_per_filter_config=per_route({"disabled": True})),
                    ],
                    default_port,
                    "default_on",
                ),
                minimal_listener(
                    [opt_in_filter, router_filter()],
                    [
                        direct(
                            "/v1/chat/completions",
                            typed_per_filter_config=per_route({"overrides": {}}),
                        ),
                        direct("/v1/models"),
                    ],
                    opt_in_port,
                    "opt_in",
                ),
            ],
            "clusters": [dead],
        }
    }

    def status(port: int, p: str) -> int:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}{p}",
            data=b"{}",
            method="POST",
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)

    with running_envoy(cfg, tmp_path, default_port, opt_in_port):
        assert status(default_port, "/v1/chat/completions") == 500
        assert status(default_port, "/v1/models") == 200
        assert status(opt_in_port, "/v1/chat/completions") == 500
        assert status(opt_in_port, "/v1/models") == 200


def test_route_header_edits_are_invisible_to_filters_before_the_router(tmp_path: Path) -> None:
    """Why the trusted-header strip is a header_mutation *filter* and not a VirtualService
    `headers.request.remove` (an Envoy route's request_headers_to_remove/add): route header
    edits are applied by the router, after ext_proc has seen the request. Pinned on Envoy 1.40
    with a Lua filter in ext_proc's place that answers with the headers it sees."""
    port = free_port()
    lua = {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {
                "inline_string": (
                    "function envoy_on_request(h)\n"
                    "  local tier = h:headers():get('x-llm-tier') or 'absent'\n"
                    "  local added = h:headers():get('x-added') or 'absent'\n"
                    "  h:respond({[':status'] = '200'}, tier .. ' ' .. added)\n"
                    "end\n"
                )
            },
        },
    }
    route = {
        "match": {"prefix": "/"},
        "direct_response": {"status": 204},
        "request_headers_to_remove": ["x-llm-tier"],
        "request_headers_to_add": [{"header": {"key": "x-added", "value": "yes"}}],
    }
    cfg = minimal_bootstrap([lua, router_filter()], [], [route], port)
    with running_envoy(cfg, tmp_path, port):
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/", headers={"x-llm-tier": "priority"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.read() == b"priority absent"
