"""The Istio install (`kubectl apply -k deploy/k8s/overlays/istio`, as tests/deploy/kustomize.py
builds it; deploy/istio/ has its README and examples), checked without a cluster: the
EnvoyFilter patches are applied to a filter chain and a connection manager as Istio applies
them and compared with envoy/envoy.yaml; the
DestinationRule's limits with envoy.yaml's ext_proc cluster; the sidecar's manifests against
the EnvoyFilter and the policy schema; who may reach the sidecar (access.yaml: mutual TLS, the
gateway's identity only, a NetworkPolicy) against the gateway the EnvoyFilter selects; the
replicas' shared pool against the overlay's Redis, which only the sidecar may reach. The
example routes, translated as Istio would, make a config the real Envoy 1.40 accepts, and that
config serves through a real sidecar (a stand-in for Istio's cluster, without its TLS), whose
pool is leased from a real redis-server standing in for the overlay's. Two
facts deploy/istio/README.md rests on (how ext_proc is scoped to routes, and that route header
edits come after ext_proc) are pinned by running the real Envoy.
"""

from __future__ import annotations

import copy
import functools
import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis

from extproc.config.envoy import render
from extproc.config.envoy import routes as render_routes
from extproc.config.policy import Policy, policy_from_yaml
from extproc.pool.shared.scripts import Keys
from testing.dockerfile import flag
from testing.envoy import (
    EXT_PROC_FILTER,
    EXT_PROC_PER_ROUTE_TYPE,
    HEADER_MUTATION_FILTER,
    ROUTER_FILTER,
    added_clusters,
    apply_filter_patches,
    assert_valid,
    cluster_named,
    envoy_filter_patches,
    grpc_cluster,
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
)
from testing.harness import running_stack
from testing.redis import RedisServer
from testing.stack import REPO, Stack, free_port, running_envoy
from testing.wait import until
from tests.deploy.kustomize import K8S, build, named
from tests.deploy.test_render import HCM_SETTINGS as RENDERED_HCM

DEPLOY = REPO / "deploy"
ISTIO = DEPLOY / "istio"
ROUTES_EXAMPLE = ISTIO / "examples" / "routes.yaml"
GATEWAY_FILTER = K8S / "components" / "istio" / "envoyfilter-gateway.yaml"
ENVOY_FILTERS = [GATEWAY_FILTER, ISTIO / "examples" / "sidecar-inbound.yaml"]
BUFFER_FILTER = "envoy.filters.http.buffer"
ACCESS_KINDS = ("PeerAuthentication", "AuthorizationPolicy", "NetworkPolicy")
# What the gateway's connection manager patch carries: render-envoy's settings, less the
# stream idle timeout (the gateway keeps Envoy's default, which the policy needs: below).
HCM_SETTINGS = tuple(k for k in RENDERED_HCM if k != "stream_idle_timeout")


@functools.cache
def istio_overlay() -> list[dict[str, Any]]:
    """What `kubectl apply -k deploy/k8s/overlays/istio` applies (tests/deploy/kustomize.py;
    tests/deploy/test_k8s.py compares it with the real `kubectl kustomize`). Read, never
    changed, by the tests here."""
    return build(K8S / "overlays" / "istio")


def by_kind(*names: tuple[str, str]) -> dict[str, dict[str, Any]]:
    """The overlay's objects of these (kind, name) pairs, by kind."""
    return {kind: named(istio_overlay(), kind, name) for kind, name in names}


def extproc_manifests() -> dict[str, dict[str, Any]]:
    """The sidecar's own objects (base/ as the Istio component patches them)."""
    return by_kind(
        ("Namespace", "llm-extproc"),
        ("ServiceAccount", "llm-extproc"),
        ("ConfigMap", "llm-extproc-policy"),
        ("Deployment", "llm-extproc"),
        ("Service", "llm-extproc"),
        ("EnvoyFilter", "llm-extproc-inbound-streams"),
    )


def access_manifests() -> dict[str, dict[str, Any]]:
    """Who may reach the sidecar: access.yaml and the NetworkPolicy as the component patches it."""
    return by_kind(*((kind, "llm-extproc") for kind in ACCESS_KINDS))


def pod_labels() -> dict[str, str]:
    return extproc_manifests()["Deployment"]["spec"]["template"]["metadata"]["labels"]  # type: ignore[no-any-return]


def configmap_policy() -> Policy:
    return policy_from_yaml(extproc_manifests()["ConfigMap"]["data"]["policy.yaml"], "ConfigMap")


def redis_manifests() -> dict[str, dict[str, Any]]:
    """The shared pool's Redis and who may reach it (components/shared-pool, istio)."""
    kinds = ("ServiceAccount", "Deployment", "Service", *ACCESS_KINDS)
    return by_kind(*((kind, "llm-extproc-redis") for kind in kinds))


def grpc_port() -> int:
    service = extproc_manifests()["Service"]
    return int(next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"))


def service_host() -> str:
    meta = extproc_manifests()["Service"]["metadata"]
    return f"{meta['name']}.{meta['namespace']}.svc.cluster.local"


def outbound_cluster() -> str:
    """The name Istio gives its cluster for the sidecar's Service port."""
    return f"outbound|{grpc_port()}||{service_host()}"


def destination_rule() -> dict[str, Any]:
    (dr,) = [d for d in istio_docs(GATEWAY_FILTER) if d["kind"] == "DestinationRule"]
    return dr


def stand_in_cluster(port: int) -> dict[str, Any]:
    """Istio's outbound cluster for the Service as Envoy would see it, minus discovery and
    mutual TLS: HTTP/2 (the port's app protocol is grpc), the DestinationRule's limits, one
    endpoint on 127.0.0.1:``port``."""
    pool = destination_rule()["spec"]["trafficPolicy"]["connectionPool"]
    cluster = grpc_cluster(
        outbound_cluster(),
        port,
        circuit_breakers={
            "max_connections": pool["tcp"]["maxConnections"],
            "max_pending_requests": pool["http"]["http1MaxPendingRequests"],
            "max_requests": pool["http"]["http2MaxRequests"],
        },
        connect_timeout=pool["tcp"]["connectTimeout"],
    )
    return cluster


def gateway_chain(path: Path) -> list[dict[str, Any]]:
    chain = [router_filter()]
    apply_filter_patches(envoy_filter_patches(path), chain)
    return chain


def hcm_patch() -> dict[str, Any]:
    """What the gateway EnvoyFilter MERGEs into the gateway's HTTP connection manager."""
    (p,) = [p for p in envoy_filter_patches(GATEWAY_FILTER) if p["applyTo"] == "NETWORK_FILTER"]
    assert p["patch"]["operation"] == "MERGE" and p["match"]["context"] == "GATEWAY"
    value = p["patch"]["value"]
    assert value["name"] == "envoy.filters.network.http_connection_manager"
    return {k: v for k, v in value["typed_config"].items() if k != "@type"}


def without_grpc_service(typed_config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in typed_config.items() if k != "grpc_service"}


@pytest.mark.parametrize("path", ENVOY_FILTERS, ids=lambda p: p.name)
def test_istio_filters_are_those_of_envoy_yaml(path: Path) -> None:
    """The same filters in the same order; ext_proc calls Istio's own (mutual TLS) cluster for
    the sidecar's Service instead of a cluster of its own."""
    shipped = shipped_envoy()
    chain = gateway_chain(path)
    assert [f["name"] for f in chain] == [
        HEADER_MUTATION_FILTER,
        BUFFER_FILTER,
        EXT_PROC_FILTER,
        ROUTER_FILTER,
    ]
    for f in chain[:2]:
        assert f["typed_config"] == http_filter_named(shipped, f["name"])["typed_config"], f["name"]
    ext_proc = chain[2]["typed_config"]
    assert without_grpc_service(ext_proc) == without_grpc_service(
        http_filter_named(shipped, EXT_PROC_FILTER)["typed_config"]
    )
    # Envoy sends envoy_grpc's cluster name as :authority unless told otherwise, and `|` is
    # not a character an authority may hold.
    assert ext_proc["grpc_service"] == {
        "envoy_grpc": {"cluster_name": outbound_cluster(), "authority": service_host()}
    }
    assert added_clusters(envoy_filter_patches(path)) == []


def test_istio_limits_and_transport_are_those_of_envoy_yaml() -> None:
    """The DestinationRule gives Istio's cluster the limits of envoy.yaml's llm_extproc cluster,
    over Istio's mutual TLS; the Service is one Istio makes an HTTP/2 EDS cluster for."""
    dr = destination_rule()
    assert dr["spec"]["host"] == service_host()
    policy = dr["spec"]["trafficPolicy"]
    assert policy["tls"] == {"mode": "ISTIO_MUTUAL"}
    ours = stand_in_cluster(50051)
    theirs = cluster_named(shipped_envoy(), "llm_extproc")
    for key in ("circuit_breakers", "connect_timeout", "typed_extension_protocol_options"):
        assert ours[key] == theirs[key], key
    manifests = extproc_manifests()
    service, deployment = manifests["Service"], manifests["Deployment"]
    # Not headless: for a headless Service Istio builds an ORIGINAL_DST cluster, which needs a
    # downstream connection's destination that ext_proc's calls do not have.
    assert service["spec"].get("clusterIP") != "None"
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc["appProtocol"] == "grpc"  # Istio speaks HTTP/2 to it
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[grpc["targetPort"]] == grpc["port"]
    assert flag(container["args"], "--listen") == f"0.0.0.0:{grpc['port']}"


def test_istio_gateway_connection_manager_settings_are_envoy_yamls() -> None:
    assert hcm_patch() == {k: hcm_config(shipped_envoy())[k] for k in HCM_SETTINGS}


def test_istio_configmap_policy_loads_and_fits_the_gateway_patches() -> None:
    """What `llm-extproc render-envoy` derives from the ConfigMap's policy is what the gateway
    patches and the DestinationRule carry."""
    policy = policy_from_yaml(extproc_manifests()["ConfigMap"]["data"]["policy.yaml"], "ConfigMap")
    rendered = render(policy)
    chain = gateway_chain(GATEWAY_FILTER)[:-1]
    assert [f["name"] for f in chain] == [f["name"] for f in rendered["http_filters"]]
    for ours, theirs in zip(chain, rendered["http_filters"], strict=True):
        assert without_grpc_service(ours["typed_config"]) == without_grpc_service(
            theirs["typed_config"]
        )
    rendered_cluster = rendered["clusters"][0]
    ours = stand_in_cluster(50051)
    for key in ("circuit_breakers", "connect_timeout"):
        assert ours[key] == rendered_cluster[key], key
    assert hcm_patch() == {k: rendered["http_connection_manager"][k] for k in HCM_SETTINGS}
    # The gateway keeps Envoy's default stream_idle_timeout (300 s), which is what the policy
    # needs: a queued request must not be cut off while it waits in silence.
    assert rendered["http_connection_manager"]["stream_idle_timeout"] == "300s"


def test_istio_sidecar_deployment() -> None:
    manifests = extproc_manifests()
    deployment, service = manifests["Deployment"], manifests["Service"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    # Several replicas share one pool through Redis; before Redis ever answers, each takes
    # limit // pool.shared.replicas, so that must be the number of replicas.
    policy = configmap_policy()
    assert policy.pool is not None and policy.pool.shared is not None
    assert deployment["spec"]["replicas"] > 1
    assert policy.pool.shared.replicas == deployment["spec"]["replicas"]
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
    # In the mesh, with an identity of its own.
    assert manifests["Namespace"]["metadata"]["labels"]["istio-injection"] == "enabled"
    assert pod["metadata"]["labels"]["sidecar.istio.io/inject"] == "true"
    assert pod["spec"]["serviceAccountName"] == manifests["ServiceAccount"]["metadata"]["name"]
    # Drain: preStop, then up to --grace (the CLI default) within the termination period,
    # with the istio-proxy still up for all of it.
    prestop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > prestop + 30
    proxy = json.loads(pod["metadata"]["annotations"]["proxy.istio.io/config"])
    assert seconds(proxy["terminationDrainDuration"]) >= prestop + 30
    # The calls to Redis go out through the istio-proxy: up before the sidecar starts.
    assert proxy["holdApplicationUntilProxyStarts"] is True
    for doc in manifests.values():
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == manifests["Namespace"]["metadata"]["name"]


def seconds(duration: str) -> float:
    assert duration.endswith("s"), duration
    return float(duration[:-1])


def test_istio_inbound_proxy_outlasts_the_longest_request() -> None:
    """The pod's istio-proxy holds each request's gRPC stream, silent, for the request's whole
    life: its stream idle timeout must outlast the LLM routes' timeout, here and in the
    example VirtualService."""
    ef = extproc_manifests()["EnvoyFilter"]
    assert ef["spec"]["workloadSelector"]["labels"].items() <= pod_labels().items()
    (p,) = ef["spec"]["configPatches"]
    assert p["applyTo"] == "NETWORK_FILTER" and p["patch"]["operation"] == "MERGE"
    assert p["match"]["context"] == "SIDECAR_INBOUND"
    assert p["match"]["listener"]["portNumber"] == grpc_port()
    idle = seconds(p["patch"]["value"]["typed_config"]["stream_idle_timeout"])
    routes = hcm_config(shipped_envoy())["route_config"]["virtual_hosts"][0]["routes"]
    routes += virtual_service_routes(ROUTES_EXAMPLE)
    timeouts = [seconds(r["route"]["timeout"]) for r in routes if "route" in r]
    assert idle > max(timeouts), (idle, timeouts)


def test_only_the_gateway_can_reach_the_grpc_port() -> None:
    """Mutual TLS required, the gateway's identity the only one allowed on the gRPC port, and
    below Istio a NetworkPolicy that admits only the gateway's pods to it (and Prometheus to
    the metrics ports). The gateway is the one envoyfilter-gateway.yaml selects."""
    access = access_manifests()
    labels, grpc = pod_labels(), grpc_port()
    (gateway,) = [d for d in istio_docs(GATEWAY_FILTER) if d["kind"] == "EnvoyFilter"]
    gateway_ns = gateway["metadata"]["namespace"]
    gateway_labels = gateway["spec"]["workloadSelector"]["labels"]
    for doc in access.values():
        assert doc["metadata"]["namespace"] == extproc_manifests()["Namespace"]["metadata"]["name"]

    peer = access["PeerAuthentication"]["spec"]
    assert peer["selector"]["matchLabels"].items() <= labels.items()
    assert peer["mtls"] == {"mode": "STRICT"}
    assert {int(p) for p in peer.get("portLevelMtls", {})} == {9464}  # never the gRPC port

    authz = access["AuthorizationPolicy"]["spec"]
    assert authz["selector"]["matchLabels"].items() <= labels.items()
    assert authz["action"] == "ALLOW"
    for rule in authz["rules"]:
        ports = {port for op in rule["to"] for port in op["operation"]["ports"]}
        assert ports, "a rule without ports allows every port"
        if str(grpc) in ports:
            assert ports == {str(grpc)}
            (source,) = rule["from"]
            assert source == {
                "source": {
                    "principals": [
                        f"cluster.local/ns/{gateway_ns}/sa/istio-ingressgateway-service-account"
                    ]
                }
            }
        else:
            assert ports == {"9464"}

    netpol = access["NetworkPolicy"]["spec"]
    assert netpol["podSelector"]["matchLabels"].items() <= labels.items()
    assert netpol["policyTypes"] == ["Ingress"]
    for rule in netpol["ingress"]:
        assert rule.get("from"), "a rule without `from` admits every pod"
        ports = {p["port"] for p in rule["ports"]}
        if grpc in ports:
            assert ports == {grpc}
            (peer_pods,) = rule["from"]
            assert peer_pods == {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": gateway_ns}},
                "podSelector": {"matchLabels": gateway_labels},
            }
        else:
            assert ports <= {9464, 15020}, ports  # the metrics and Istio's merged metrics


def redis_port() -> int:
    (port,) = redis_manifests()["Service"]["spec"]["ports"]
    return int(port["port"])


def test_istio_policy_leases_the_pool_from_the_redis_service() -> None:
    """The ConfigMap's pool.shared.redis is the Redis Service, on its port, which leads to
    the Redis container's port; one Redis, never two at once (two would be two pools), keeping
    nothing on disk; its pods and the sidecar's are told apart by their labels."""
    policy = configmap_policy()
    assert policy.pool is not None and policy.pool.shared is not None
    url = urllib.parse.urlsplit(policy.pool.shared.redis)
    r = redis_manifests()
    service, deployment = r["Service"], r["Deployment"]
    meta = service["metadata"]
    assert url.scheme == "redis"
    assert url.hostname == f"{meta['name']}.{meta['namespace']}.svc.cluster.local"
    (port,) = service["spec"]["ports"]
    assert url.port == port["port"]
    # Istio carries it as opaque TCP (a `redis` port name would ask for its Redis filter).
    assert port["name"].startswith("tcp-") and port["appProtocol"] == "tcp"
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = container["args"]
    assert args[0] == "redis-server"
    assert ports[port["targetPort"]] == int(flag(args, "--port") if "--port" in args else 6379)
    assert flag(args, "--save") == "" and flag(args, "--appendonly") == "no"
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert not service["spec"]["selector"].items() <= pod_labels().items()
    sidecar_selector = extproc_manifests()["Service"]["spec"]["selector"]
    assert not sidecar_selector.items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]
    namespace = extproc_manifests()["Namespace"]["metadata"]["name"]
    for doc in r.values():
        assert doc["metadata"]["namespace"] == namespace


def test_only_the_sidecar_can_reach_redis() -> None:
    """Redis has no password, and whoever reaches it can grant itself the pool: mutual TLS
    required, the sidecar's identity the only one allowed, and below Istio a NetworkPolicy that
    admits only the sidecar's pods, on the Redis port only."""
    r = redis_manifests()
    labels = r["Deployment"]["spec"]["template"]["metadata"]["labels"]
    sidecar = extproc_manifests()["Deployment"]
    namespace = sidecar["metadata"]["namespace"]
    service_account = sidecar["spec"]["template"]["spec"]["serviceAccountName"]
    port = redis_port()

    peer = r["PeerAuthentication"]["spec"]
    assert peer["selector"]["matchLabels"].items() <= labels.items()
    assert peer["mtls"] == {"mode": "STRICT"} and "portLevelMtls" not in peer

    authz = r["AuthorizationPolicy"]["spec"]
    assert authz["selector"]["matchLabels"].items() <= labels.items()
    assert authz["action"] == "ALLOW"
    (rule,) = authz["rules"]
    assert {p for op in rule["to"] for p in op["operation"]["ports"]} == {str(port)}
    assert rule["from"] == [
        {"source": {"principals": [f"cluster.local/ns/{namespace}/sa/{service_account}"]}}
    ]

    netpol = r["NetworkPolicy"]["spec"]
    assert netpol["podSelector"]["matchLabels"].items() <= labels.items()
    assert netpol["policyTypes"] == ["Ingress"]
    (ingress,) = netpol["ingress"]
    assert {p["port"] for p in ingress["ports"]} == {port}
    # A podSelector alone selects pods of the policy's own namespace: the sidecar's.
    (peer_pods,) = ingress["from"]
    assert set(peer_pods) == {"podSelector"}
    assert peer_pods["podSelector"]["matchLabels"].items() <= pod_labels().items()
    assert r["NetworkPolicy"]["metadata"]["namespace"] == namespace
    # The sidecar's own access rules do not select the Redis pods (nor the other way round).
    access = access_manifests()
    for kind in ("PeerAuthentication", "AuthorizationPolicy"):
        assert not access[kind]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert not access["NetworkPolicy"]["spec"]["podSelector"]["matchLabels"].items() <= (
        labels.items()
    )


@pytest.mark.envoy
def test_istio_gateway_with_example_routes_validates_in_envoy(tmp_path: Path) -> None:
    """The gateway EnvoyFilter's filters and cluster, plus the example routes with their
    HTTP_ROUTE merge patches applied, make a config the real Envoy accepts."""
    routes = example_routes()
    by_name = {r["name"]: r for r in routes}
    # The metadata names a bucket of the ConfigMap's policy; the routes after the priority
    # channel are render-envoy's (no catch-all), the allowlist skipping the buffer and ext_proc.
    policy = policy_from_yaml(extproc_manifests()["ConfigMap"]["data"]["policy.yaml"])
    bucket = by_name["llm-priority"]["metadata"]["filter_metadata"]["llm_extproc"]["bucket"]
    assert bucket in {b.name for b in policy.buckets}
    (vhost,) = hcm_config(shipped_envoy())["route_config"]["virtual_hosts"]
    door = [r for r in routes if r["name"] != "llm-priority"]
    kept = ("match", "typed_per_filter_config", "direct_response")
    assert [{k: v for k, v in r.items() if k in kept} for r in door] == [
        {k: v for k, v in r.items() if k in kept} for r in render_routes()
    ]
    # LLM routes echo the effective max_tokens, as envoy/envoy.yaml's virtual host does.
    for name in ("llm-priority", "llm-chat", "llm-completions"):
        assert by_name[name]["response_headers_to_add"] == vhost["response_headers_to_add"], name
    clusters = [stand_in_cluster(50051), static_cluster("backend", 8000)]
    assert_valid(gateway_bootstrap(routes, clusters, 10000), tmp_path)
    sidecar_chain = gateway_chain(ENVOY_FILTERS[1])
    assert_valid(minimal_bootstrap(sidecar_chain, clusters, routes), tmp_path)


def example_routes() -> list[dict[str, Any]]:
    """examples/routes.yaml's VirtualService routes, translated as Istio would, with the
    example's HTTP_ROUTE merge patches applied."""
    routes = virtual_service_routes(ROUTES_EXAMPLE)
    by_name = {r["name"]: r for r in routes}
    (route_filter,) = [d for d in istio_docs(ROUTES_EXAMPLE) if d["kind"] == "EnvoyFilter"]
    for p in route_filter["spec"]["configPatches"]:
        assert p["applyTo"] == "HTTP_ROUTE" and p["patch"]["operation"] == "MERGE"
        istio_merge(
            by_name[p["match"]["routeConfiguration"]["vhost"]["route"]["name"]], p["patch"]["value"]
        )
    return routes


def gateway_bootstrap(
    routes: list[dict[str, Any]], clusters: list[dict[str, Any]], port: int
) -> dict[str, Any]:
    """A gateway as the patches make it: the filter chain, and the connection manager with
    the MERGE applied (no admin listener)."""
    cfg = minimal_bootstrap(gateway_chain(GATEWAY_FILTER), clusters, routes, port)
    istio_merge(hcm_config(cfg), hcm_patch())
    return cfg


def shared_view(stack: Stack) -> dict[str, Any]:
    """The sidecar's shared pool as /debug/queues shows it."""
    url = stack.metrics_url.removesuffix("/metrics") + "/debug/queues"
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())["/pool"]["shared"]  # type: ignore[no-any-return]


@pytest.mark.envoy
@pytest.mark.redis
def test_istio_gateway_serves_through_the_sidecar_on_the_real_envoy(tmp_path: Path) -> None:
    """The gateway's patches and the example routes on the real Envoy, with a stand-in for
    Istio's cluster (same name, limits and HTTP/2; plain text instead of Istio's mutual TLS)
    pointing at a real sidecar with the ConfigMap's policy, its Redis a real redis-server: an
    LLM request is admitted (on a lease from that Redis) and clamped, a 3 MiB body passes and a
    4 MiB one gets the stable 413, a slow one gets 408 after the shipped request_timeout is cut
    to 2 s."""
    policy = extproc_manifests()["ConfigMap"]["data"]["policy.yaml"]
    pool = configmap_policy().pool
    assert pool is not None and pool.shared is not None
    shared = pool.shared
    assert policy.count(shared.redis) == 1
    port = free_port()
    with (
        RedisServer(tmp_path) as redis_server,
        running_stack(
            tmp_path, policy.replace(shared.redis, redis_server.url), start_envoy=False
        ) as stack,
    ):
        routes = example_routes()
        clusters = [
            stand_in_cluster(stack.extproc_port),
            static_cluster("backend", stack.backend_port),
        ]
        cfg = gateway_bootstrap(routes, clusters, port)
        hcm_config(cfg)["request_timeout"] = "2s"
        with running_envoy(cfg, tmp_path, port):
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999}
            req = urllib.request.Request(
                url,
                data=json.dumps(body).encode(),
                headers={"content-type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=10) as r:
                assert r.status == 200 and r.headers["x-llm-max-tokens"] == "1024"
                echo = json.loads(r.read())["echo"]
            assert echo["headers"]["x-llm-bucket"] == "batch"
            assert json.loads(echo["body"])["max_tokens"] == 1024
            # Admitted on a lease (in shared mode the local limit is the leases held, none at
            # start), with Redis answering all along; the replica is registered in Redis.
            view = until(
                lambda: v if (v := shared_view(stack))["replicas"] == 1 else None,
                "the replica registered in Redis",
            )
            assert view["state"] == "shared" and view["degraded_transitions"] == 0, view
            assert view["pool_limit"] == 64 and view["last_error"] is None, view
            client = redis.Redis.from_url(redis_server.url)
            try:
                assert client.zscore(Keys.for_prefix(shared.key_prefix).replicas, view["replica"])
            finally:
                client.close()
            # The buffer filter's max_request_bytes (4 MiB) is the limit on these routes, even
            # with the listener at Envoy's default buffer limit of 1 MiB (as here; Istio's
            # EDGE profile: 32 KiB).
            assert (
                "per_connection_buffer_limit_bytes" not in cfg["static_resources"]["listeners"][0]
            )

            def with_padding(n: int) -> urllib.request.Request:
                return urllib.request.Request(
                    url,
                    data=json.dumps({**body, "padding": "p" * n}).encode(),
                    headers={"content-type": "application/json"},
                )

            with urllib.request.urlopen(with_padding(3 * 1024 * 1024), timeout=10) as r:
                assert r.status == 200
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(with_padding(4 * 1024 * 1024), timeout=10)
            assert refused.value.code == 413
            assert json.loads(refused.value.read())["error"]["code"] == "body_too_large"
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                    b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{"
                )
                answer = b""
                while chunk := s.recv(65536):
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == (
                "request_timeout"
            )


@pytest.mark.envoy
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
    dead = stand_in_cluster(free_port())  # nothing listens there

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


@pytest.mark.envoy
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
