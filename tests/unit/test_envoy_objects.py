"""The Envoy object builders: what each gives parses as Envoy's own typed message, and the
settings left unset are left out (Envoy's defaults apply)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401 (@type)
from google.protobuf import json_format
from google.protobuf.message import Message

import extproc.config.envoy  # noqa: F401 (registers the filters' @types)
from extproc.config.envoy_objects import (
    BUFFER_FILTER,
    EXT_PROC_FILTER,
    address,
    buffer_filter,
    direct_response_route,
    disabled_on_route,
    ext_proc_filter,
    grpc_cluster,
    header_mutation_filter,
    http_listener,
    router_filter,
    static_cluster,
)
from extproc.contract import PROCESSING_MODE

FILTERS = [
    header_mutation_filter(["x-llm-tier"]),
    buffer_filter(),
    ext_proc_filter(
        "llm_extproc",
        PROCESSING_MODE,
        request_attributes=["xds.route_metadata"],
        receiving_namespaces=["llm_extproc"],
    ),
    router_filter(),
]
ROUTES = [
    direct_response_route("/v1/chat/completions", "{}"),
    direct_response_route("/v1/models", "[]", status=201, without_ext_proc=True),
    {
        "match": {"prefix": "/"},
        "route": {"cluster": "backend"},
        "typed_per_filter_config": disabled_on_route(EXT_PROC_FILTER, BUFFER_FILTER),
    },
]


@pytest.mark.parametrize(
    ("built", "message"),
    [
        (grpc_cluster("llm_extproc", 50051), cluster_pb2.Cluster),
        (
            grpc_cluster("c", 1, host="10.0.0.1", circuit_breakers={"max_requests": 9}),
            cluster_pb2.Cluster,
        ),
        (static_cluster("backend", 8000), cluster_pb2.Cluster),
        (http_listener("llm", 10000, routes=ROUTES, http_filters=FILTERS), listener_pb2.Listener),
        (
            http_listener(
                "llm",
                10000,
                routes=ROUTES,
                http_filters=FILTERS,
                response_headers_to_add=[{"header": {"key": "a", "value": "b"}}],
                stream_idle_timeout="600s",
                request_timeout="0s",
                buffer_limit_bytes=1 << 22,
            ),
            listener_pb2.Listener,
        ),
        *[(route, route_components_pb2.Route) for route in ROUTES],
    ],
)
def test_what_a_builder_gives_is_an_envoy_message(
    built: dict[str, Any], message: type[Message]
) -> None:
    json_format.ParseDict(copy.deepcopy(built), message())


def test_unset_settings_are_left_out() -> None:
    assert address(5) == {"socket_address": {"address": "127.0.0.1", "port_value": 5}}
    plain = static_cluster("backend", 8000)
    assert list(plain) == ["name", "type", "connect_timeout", "load_assignment"]
    assert list(grpc_cluster("c", 1)) == [
        "name",
        "type",
        "connect_timeout",
        "typed_extension_protocol_options",
        "load_assignment",
    ]
    ext_proc = ext_proc_filter("c", PROCESSING_MODE)["typed_config"]
    assert "request_attributes" not in ext_proc and "metadata_options" not in ext_proc
    listener = http_listener("l", 1, routes=[], http_filters=[router_filter()])
    assert list(listener) == ["name", "address", "filter_chains"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert list(hcm) == ["@type", "stat_prefix", "route_config", "http_filters"]


def test_each_builder_gives_a_new_object() -> None:
    """Shared objects would be printed as YAML anchors and aliases, and a change to one
    config would change another."""
    route = direct_response_route("/", "{}")
    a = http_listener("a", 1, routes=[route], http_filters=[router_filter()])
    b = http_listener("b", 2, routes=[route], http_filters=[router_filter()])
    routes_of = [
        x["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0][
            "routes"
        ][0]
        for x in (a, b)
    ]
    assert routes_of[0] == routes_of[1] == route
    assert routes_of[0] is not routes_of[1] and routes_of[0] is not route
    assert ext_proc_filter("c", PROCESSING_MODE)["typed_config"]["processing_mode"] is not (
        PROCESSING_MODE
    )
