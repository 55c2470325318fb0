"""Envoy config objects as plain dicts in Envoy's v3 YAML shape: the one set of builders.

``extproc.config.envoy.render`` builds the policy-dependent parts of the shipped config from
these; ``testing.envoy``, the tests and the benchmarks build their own configs (the overhead
benchmark's many-listener Envoy, the Istio stand-ins) from the same ones, so a setting of the
shipped ext_proc filter or cluster is written once. Each builder returns a new dict with its
keys in a fixed order, so ``yaml.safe_dump(..., sort_keys=False)`` prints the same bytes for the
same arguments (``envoy/envoy.yaml`` holds what ``render`` gives: tests/deploy/test_render.py).
A setting left at None (or empty) is left out, and Envoy's own default applies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = [
    "BUFFER_FILTER",
    "BUFFER_PER_ROUTE_TYPE",
    "BUFFER_TYPE",
    "DEFAULT_BODY_BYTES",
    "EXT_PROC_FILTER",
    "EXT_PROC_PER_ROUTE_TYPE",
    "EXT_PROC_TYPE",
    "HCM_FILTER",
    "HCM_TYPE",
    "HEADER_MUTATION_FILTER",
    "HEADER_MUTATION_TYPE",
    "HTTP_OPTIONS_TYPE",
    "ROUTER_FILTER",
    "ROUTER_TYPE",
    "ROUTE_CONFIG_TYPE",
    "address",
    "buffer_filter",
    "direct_response_route",
    "disabled_on_route",
    "echo_request_header",
    "ext_proc_filter",
    "grpc_cluster",
    "header_mutation_filter",
    "http_listener",
    "router_filter",
    "static_cluster",
]

_EXTENSIONS = "type.googleapis.com/envoy.extensions."
EXT_PROC_TYPE: Final = _EXTENSIONS + "filters.http.ext_proc.v3.ExternalProcessor"
EXT_PROC_PER_ROUTE_TYPE: Final = _EXTENSIONS + "filters.http.ext_proc.v3.ExtProcPerRoute"
BUFFER_TYPE: Final = _EXTENSIONS + "filters.http.buffer.v3.Buffer"
BUFFER_PER_ROUTE_TYPE: Final = _EXTENSIONS + "filters.http.buffer.v3.BufferPerRoute"
HEADER_MUTATION_TYPE: Final = _EXTENSIONS + "filters.http.header_mutation.v3.HeaderMutation"
ROUTER_TYPE: Final = _EXTENSIONS + "filters.http.router.v3.Router"
HCM_TYPE: Final = _EXTENSIONS + "filters.network.http_connection_manager.v3.HttpConnectionManager"
HTTP_OPTIONS_TYPE: Final = _EXTENSIONS + "upstreams.http.v3.HttpProtocolOptions"
ROUTE_CONFIG_TYPE: Final = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"

EXT_PROC_FILTER: Final = "envoy.filters.http.ext_proc"
BUFFER_FILTER: Final = "envoy.filters.http.buffer"
HEADER_MUTATION_FILTER: Final = "envoy.filters.http.header_mutation"
ROUTER_FILTER: Final = "envoy.filters.http.router"
HCM_FILTER: Final = "envoy.filters.network.http_connection_manager"

# The per-route config type of each HTTP filter a route can turn off.
_PER_ROUTE_TYPES: Final = {
    EXT_PROC_FILTER: EXT_PROC_PER_ROUTE_TYPE,
    BUFFER_FILTER: BUFFER_PER_ROUTE_TYPE,
}
# The smallest request body the buffer filter (and the listener) holds.
DEFAULT_BODY_BYTES: Final = 4 * 1024 * 1024


def address(port: int, host: str = "127.0.0.1") -> dict[str, Any]:
    """An Envoy ``Address`` (a TCP socket address)."""
    return {"socket_address": {"address": host, "port_value": port}}


def _cluster(
    name: str,
    port: int,
    *,
    host: str,
    connect_timeout: str,
    http2: bool,
    circuit_breakers: Mapping[str, int] | None,
) -> dict[str, Any]:
    cluster: dict[str, Any] = {"name": name, "type": "STATIC", "connect_timeout": connect_timeout}
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": HTTP_OPTIONS_TYPE,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    cluster["load_assignment"] = {
        "cluster_name": name,
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address(port, host)}}]}],
    }
    if circuit_breakers is not None:
        cluster["circuit_breakers"] = {"thresholds": [dict(circuit_breakers)]}
    return cluster


def grpc_cluster(
    name: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    circuit_breakers: Mapping[str, int] | None = None,
    connect_timeout: str = "1s",
) -> dict[str, Any]:
    """A STATIC cluster of one endpoint spoken to over HTTP/2 (h2c), as a gRPC service such as
    an ext_proc server needs. ``circuit_breakers`` sets the default-priority thresholds, e.g.
    ``{"max_requests": 100000}`` (each stream an ext_proc server holds counts as one request;
    Envoy's default limits are 1024)."""
    return _cluster(
        name,
        port,
        host=host,
        connect_timeout=connect_timeout,
        http2=True,
        circuit_breakers=circuit_breakers,
    )


def static_cluster(
    name: str, port: int, *, host: str = "127.0.0.1", connect_timeout: str = "1s"
) -> dict[str, Any]:
    """A STATIC cluster of one endpoint, spoken to over HTTP/1.1."""
    return _cluster(
        name, port, host=host, connect_timeout=connect_timeout, http2=False, circuit_breakers=None
    )


def ext_proc_filter(
    cluster: str,
    processing_mode: Mapping[str, str],
    *,
    failure_mode_allow: bool = False,
    message_timeout: str = "1s",
    max_message_timeout: str = "600s",
    allow_mode_override: bool = True,
    request_attributes: Sequence[str] = (),
    receiving_namespaces: Sequence[str] = (),
) -> dict[str, Any]:
    """The ext_proc HTTP filter, talking to ``cluster`` over Envoy's own gRPC client.
    ``processing_mode`` is usually the shipped one, ``extproc.contract.PROCESSING_MODE``;
    ``max_message_timeout`` is the longest message timeout the server may ask for (``render``
    derives it from the policy). ``request_attributes`` are sent with the request headers,
    and the server's dynamic metadata is accepted in ``receiving_namespaces`` (untyped)."""
    config: dict[str, Any] = {
        "@type": EXT_PROC_TYPE,
        "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
        "failure_mode_allow": failure_mode_allow,
        "processing_mode": dict(processing_mode),
        "message_timeout": message_timeout,
        "max_message_timeout": max_message_timeout,
        "allow_mode_override": allow_mode_override,
    }
    if request_attributes:
        config["request_attributes"] = list(request_attributes)
    if receiving_namespaces:
        config["metadata_options"] = {"receiving_namespaces": {"untyped": [*receiving_namespaces]}}
    return {"name": EXT_PROC_FILTER, "typed_config": config}


def buffer_filter(max_request_bytes: int = DEFAULT_BODY_BYTES) -> dict[str, Any]:
    """The buffer HTTP filter: the whole request body is read before the next filter runs;
    a larger body gets Envoy's 413."""
    return {
        "name": BUFFER_FILTER,
        "typed_config": {"@type": BUFFER_TYPE, "max_request_bytes": max_request_bytes},
    }


def header_mutation_filter(remove: Sequence[str]) -> dict[str, Any]:
    """The header_mutation HTTP filter, removing the ``remove`` request headers."""
    return {
        "name": HEADER_MUTATION_FILTER,
        "typed_config": {
            "@type": HEADER_MUTATION_TYPE,
            "mutations": {"request_mutations": [{"remove": h} for h in remove]},
        },
    }


def router_filter() -> dict[str, Any]:
    """The router HTTP filter (always the last one)."""
    return {"name": ROUTER_FILTER, "typed_config": {"@type": ROUTER_TYPE}}


def disabled_on_route(*filters: str) -> dict[str, Any]:
    """A route's ``typed_per_filter_config`` that turns ``filters`` (the ext_proc and buffer
    filters) off for that route."""
    return {f: {"@type": _PER_ROUTE_TYPES[f], "disabled": True} for f in filters}


def echo_request_header(name: str) -> dict[str, Any]:
    """A ``response_headers_to_add`` entry that gives the client the value the request header
    ``name`` had when the request went upstream (``%REQ(name)%``: a header the sidecar set),
    in place of any the backend sent."""
    return {
        "header": {"key": name, "value": f"%REQ({name})%"},
        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
    }


def direct_response_route(
    path: str,
    body: str,
    *,
    status: int = 200,
    content_type: str = "application/json",
    without_ext_proc: bool = False,
) -> dict[str, Any]:
    """A route on the exact ``path`` that Envoy answers itself (``direct_response``) with
    ``body``: a backend with no process of its own. ``without_ext_proc`` disables the ext_proc
    filter on it."""
    route: dict[str, Any] = {
        "match": {"path": path},
        "direct_response": {"status": status, "body": {"inline_string": body}},
        "response_headers_to_add": [{"header": {"key": "content-type", "value": content_type}}],
    }
    if without_ext_proc:
        route["typed_per_filter_config"] = disabled_on_route(EXT_PROC_FILTER)
    return route


def http_listener(
    name: str,
    port: int,
    *,
    routes: Sequence[Mapping[str, Any]],
    http_filters: Sequence[Mapping[str, Any]],
    host: str = "127.0.0.1",
    response_headers_to_add: Sequence[Mapping[str, Any]] | None = None,
    stream_idle_timeout: str | None = None,
    request_timeout: str | None = None,
    buffer_limit_bytes: int | None = None,
) -> dict[str, Any]:
    """A listener on ``host:port`` with one HTTP connection manager (stats under
    ``http.<name>.``), one virtual host for every domain holding ``routes``, and
    ``http_filters`` in order (end with ``router_filter()``). ``response_headers_to_add`` is
    set on the virtual host; the timeouts on the connection manager."""
    vhost: dict[str, Any] = {"name": name, "domains": ["*"]}
    if response_headers_to_add:
        vhost["response_headers_to_add"] = [dict(h) for h in response_headers_to_add]
    vhost["routes"] = [dict(r) for r in routes]
    hcm: dict[str, Any] = {"@type": HCM_TYPE, "stat_prefix": name}
    if stream_idle_timeout is not None:
        hcm["stream_idle_timeout"] = stream_idle_timeout
    if request_timeout is not None:
        hcm["request_timeout"] = request_timeout
    hcm["route_config"] = {"name": name, "virtual_hosts": [vhost]}
    hcm["http_filters"] = [dict(f) for f in http_filters]
    listener: dict[str, Any] = {"name": name, "address": address(port, host)}
    if buffer_limit_bytes is not None:
        listener["per_connection_buffer_limit_bytes"] = buffer_limit_bytes
    listener["filter_chains"] = [{"filters": [{"name": HCM_FILTER, "typed_config": hcm}]}]
    return listener
