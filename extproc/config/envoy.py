"""Envoy settings derived from a policy, so the two cannot disagree (``llm-extproc render-envoy``).

What the policy decides for Envoy:
- ext_proc ``max_message_timeout``: the sidecar extends Envoy's message timeout to
  ``queue_timeout + 1s`` while a request waits; Envoy refuses larger overrides, so this must be
  at least the longest queue timeout (route overrides included) plus that margin.
- the ext_proc cluster's circuit breakers: every request the sidecar holds, queued or running,
  is one open gRPC stream; the default 1024 would fail requests. Set above the sum of all
  queues and slots, plus headroom for requests being parsed or refused.
- the listener's buffer limit: Envoy answers 413 itself (a plain-text body, before we see the
  request) for bodies above it, so it must fit the largest prompt the policy admits, with room
  for JSON escaping and images.
- HCM ``stream_idle_timeout``: a queued request sends no bytes; it must outlast the longest wait.
- header_mutation: the policy's trusted headers are stripped from client requests before
  ext_proc.

Everything is built as plain dicts and checked against Envoy's own typed messages (the xds-protos
stubs) before it is printed; none of this runs on the request path. (envoy-data-plane's
typed classes would do the same; the xds-protos messages we already depend on need no other
dependency.)
"""

from __future__ import annotations

import copy
import math
from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401 (@type)
from google.protobuf import json_format

from extproc.config.policy import Policy
from extproc.contract import MESSAGE_TIMEOUT_MARGIN_S, METADATA_NAMESPACE, PROCESSING_MODE

__all__ = [
    "LLM_ROUTE_TIMEOUT_S",
    "PROCESSING_MODE",
    "body_buffer_bytes",
    "extproc_streams",
    "render",
    "to_rds",
    "validate",
]

LLM_ROUTE_TIMEOUT_S = 600  # long generations; the sidecar's queue wait counts against it too
_STREAM_HEADROOM = 1024  # streams being parsed or answered, beyond queued + running
_MIN_BUFFER = 4 * 1024 * 1024
_MIN_IDLE_S = 300
# A character of prompt can take up to 6 bytes in JSON (\uXXXX), and a body carries more
# than the prompt (roles, parameters).
_BYTES_PER_PROMPT_CHAR = 6

EXT_PROC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
HEADER_MUTATION_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
)
HTTP_OPTIONS_TYPE = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def _seconds(s: float) -> str:
    return f"{math.ceil(s)}s"


def extproc_streams(policy: Policy) -> int:
    """How many ext_proc streams the policy can hold open at once: every queued or running
    request is one, plus headroom for requests being parsed or answered. Envoy's circuit
    breakers for the sidecar's cluster and the sidecar's own stream limit both use it."""
    return sum(b.max_queue + b.max_concurrency for b in policy.buckets) + _STREAM_HEADROOM


def body_buffer_bytes(policy: Policy) -> int:
    """The largest request body Envoy buffers (above it Envoy answers 413 itself): room for
    the largest prompt the policy admits, as JSON, rounded up to a power of two."""
    prompt_bytes = math.ceil(
        policy.limits.max_prompt_tokens * policy.tokens.chars_per_token * _BYTES_PER_PROMPT_CHAR
    )
    return max(_MIN_BUFFER, 1 << math.ceil(math.log2(prompt_bytes)))


def render(
    policy: Policy,
    *,
    extproc_address: str = "127.0.0.1",
    extproc_port: int = 50051,
    longest_route_queue_timeout_s: float = 0.0,
) -> dict[str, Any]:
    """The policy-dependent parts of an Envoy config, as dicts in Envoy's YAML shape."""
    longest_wait = max(policy.longest_queue_timeout_s, longest_route_queue_timeout_s)
    streams = extproc_streams(policy)
    buffer = body_buffer_bytes(policy)

    filters: list[dict[str, Any]] = []
    if policy.trusted_headers:
        filters.append(
            {
                "name": "envoy.filters.http.header_mutation",
                "typed_config": {
                    "@type": HEADER_MUTATION_TYPE,
                    "mutations": {
                        "request_mutations": [{"remove": h} for h in policy.trusted_headers]
                    },
                },
            }
        )
    filters.append(
        {
            "name": "envoy.filters.http.ext_proc",
            "typed_config": {
                "@type": EXT_PROC_TYPE,
                "grpc_service": {"envoy_grpc": {"cluster_name": "llm_extproc"}},
                "failure_mode_allow": False,
                "processing_mode": dict(PROCESSING_MODE),
                "message_timeout": "1s",
                "max_message_timeout": _seconds(longest_wait + MESSAGE_TIMEOUT_MARGIN_S),
                "allow_mode_override": True,
                "request_attributes": ["xds.route_metadata"],
                "metadata_options": {"receiving_namespaces": {"untyped": [METADATA_NAMESPACE]}},
            },
        }
    )
    cluster = {
        "name": "llm_extproc",
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": HTTP_OPTIONS_TYPE,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": "llm_extproc",
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {
                                        "address": extproc_address,
                                        "port_value": extproc_port,
                                    }
                                }
                            }
                        }
                    ]
                }
            ],
        },
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": 1024,
                    "max_pending_requests": streams,
                    "max_requests": streams,
                }
            ]
        },
    }
    return {
        "http_filters": filters,
        "clusters": [cluster],
        "listener": {"per_connection_buffer_limit_bytes": buffer},
        "http_connection_manager": {
            "stream_idle_timeout": _seconds(max(_MIN_IDLE_S, longest_wait + 60)),
        },
        "llm_routes": {"timeout": f"{LLM_ROUTE_TIMEOUT_S}s"},
    }


def validate(rendered: dict[str, Any]) -> None:
    """Parse every rendered message with Envoy's own protobuf types; raises on a mistake."""
    rendered = copy.deepcopy(rendered)  # ParseDict consumes "@type" keys
    for f in rendered["http_filters"]:
        config = {k: v for k, v in f["typed_config"].items() if k != "@type"}
        message = (
            ext_proc_pb2.ExternalProcessor()
            if f["typed_config"]["@type"] == EXT_PROC_TYPE
            else header_mutation_pb2.HeaderMutation()
        )
        json_format.ParseDict(config, message)
    for c in rendered["clusters"]:
        json_format.ParseDict(c, cluster_pb2.Cluster())


ROUTE_CONFIG_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"


def to_rds(bootstrap: dict[str, Any], routes_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a static bootstrap into one that loads its routes from a watched file (file-based
    RDS) and that file. Replace the file atomically (write a temp file in the same directory,
    then ``mv`` it over ``routes.yaml``); Envoy applies valid updates without a restart and
    keeps the last good routes when an update is rejected."""
    bootstrap = copy.deepcopy(bootstrap)
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    route_config = hcm.pop("route_config")
    hcm["rds"] = {
        "route_config_name": route_config["name"],
        "config_source": {
            "resource_api_version": "V3",
            "path_config_source": {
                "path": f"{routes_dir}/routes.yaml",
                "watched_directory": {"path": routes_dir},
            },
        },
    }
    # Keep the key order of the static config: rds where route_config was.
    ordered = {}
    for key, value in hcm.items():
        if key == "http_filters" and "rds" not in ordered:
            ordered["rds"] = hcm["rds"]
        if key != "rds":
            ordered[key] = value
    hcm.clear()
    hcm.update(ordered)
    # File-based xDS needs a node identity.
    bootstrap = {"node": {"id": "llm-extproc-envoy", "cluster": "llm"}, **bootstrap}
    return bootstrap, {"resources": [{"@type": ROUTE_CONFIG_TYPE, **route_config}]}
