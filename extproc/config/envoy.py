"""Envoy settings derived from a policy, so the two cannot disagree (``llm-extproc render-envoy``).

What the policy decides for Envoy:
- ext_proc ``max_message_timeout``: the sidecar extends Envoy's message timeout to
  ``queue_timeout + 1s`` while a request waits; Envoy refuses larger overrides, so this must be
  at least the longest queue timeout (route overrides included) plus that margin.
- the ext_proc cluster's circuit breakers: every request the sidecar holds, queued or running,
  is one open gRPC stream; the default 1024 would fail requests. Set above the sum of all
  queues and slots, plus headroom for requests being parsed or refused.
- the listener's buffer limit: Envoy answers 413 itself (body_too_large, before we see the
  request) for bodies above it, so it must fit the largest prompt the policy admits, with room
  for JSON escaping and images.
- HCM ``stream_idle_timeout``: a queued request sends no bytes; it must outlast the longest wait.
- header_mutation: the policy's trusted headers are stripped from client requests before
  ext_proc.

The door (the same for every policy; ``extproc.request.endpoints``): the connection manager
normalises every path, ``routes`` sends each API vLLM computes for through the sidecar (the
ones it admits, and the ones it refuses), lets a short allowlist of cheap reads pass without
it, and answers anything else itself: 404 ``unknown_url``.

What the client sees (the same for every policy): the virtual host's
``response_headers_to_add`` echoes ``x-llm-max-tokens``, the effective max_tokens the sidecar
set on the upstream request, without a round trip on the response path; HCM
``always_set_request_id_in_response`` returns Envoy's ``x-request-id`` on every answer, the
sidecar's refusals included, and the sidecar logs it with each request it refuses
(``extproc.ops.logs``): the id a user reports is the one an operator finds
(tests/e2e/test_request_id.py).

What keeps a hostile client from holding the sidecar (every ext_proc stream is one place in
the circuit breakers above, and in the sidecar's own stream limit):
- the buffer filter, placed before ext_proc, holds the request until its whole body is in
  (``max_request_bytes`` = the buffer limit above). Only then does ext_proc open its stream and
  send request_headers, so a client that trickles its body holds Envoy's buffer, never an
  ext_proc stream (tests/e2e/test_slow_clients.py). It is disabled on the non-LLM routes, which
  stream their bodies upstream as before.
- HCM ``request_headers_timeout`` bounds a client that trickles its headers.
- HCM ``request_timeout`` bounds the body: 60 s for the whole request. Envoy's documentation
  says this timer runs until the request has been sent upstream, which would count the wait in
  the sidecar's queue too and force it above the longest queue_timeout; on Envoy 1.40 it stops
  once the request has been received from the client, so a request queued past it is not cut
  (both pinned by tests/e2e/test_envoy_answers.py). v3's buffer filter has no timeout of its
  own, and ``stream_idle_timeout`` resets on every byte, so neither bounds a trickle.

What Envoy answers itself (``local_reply_config``): the sidecar's answers (response code
details ``llm_extproc_*``) pass untouched; every other local reply gets an OpenAI-style JSON
body with a stable ``error.code`` chosen by status and detail (sidecar_unavailable,
sidecar_timeout, backend_unavailable, backend_timeout, body_too_large, request_timeout,
gateway_error). Envoy's detail strings are its own words and carry internals (addresses, reset
reasons): they go to the access log, never to the client.

Everything is built as plain dicts (by the builders of ``extproc.config.envoy_objects``, which
the tests and benchmarks use too) and checked against Envoy's own typed messages (the xds-protos
stubs) before it is printed; none of this runs on the request path. (envoy-data-plane's
typed classes would do the same; the xds-protos messages we already depend on need no other
dependency.)
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterable, Iterator
from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.access_loggers.filters.cel.v3 import cel_pb2  # noqa: F401 (@type)
from envoy.extensions.filters.http.buffer.v3 import buffer_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2,
)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401 (@type)
from google.protobuf import json_format
from google.protobuf.message import Message

from extproc.config.envoy_objects import (
    BUFFER_FILTER,
    BUFFER_PER_ROUTE_TYPE,
    BUFFER_TYPE,
    DEFAULT_BODY_BYTES,
    EXT_PROC_FILTER,
    EXT_PROC_PER_ROUTE_TYPE,
    EXT_PROC_TYPE,
    HEADER_MUTATION_TYPE,
    ROUTE_CONFIG_TYPE,
    buffer_filter,
    disabled_on_route,
    echo_request_header,
    ext_proc_filter,
    grpc_cluster,
    header_mutation_filter,
)
from extproc.config.local_replies import ENVOY_ANSWER_CODES, EnvoyAnswer, local_reply_config
from extproc.config.policy import Policy
from extproc.contract import (
    LLM_PATHS,
    MESSAGE_TIMEOUT_MARGIN_S,
    METADATA_NAMESPACE,
    PASS_THROUGH,
    PATH_NORMALISATION,
    PROCESSING_MODE,
    ROUTE_ATTRIBUTE,
)

__all__ = [
    "ENVOY_ANSWER_CODES",
    "EXT_PROC_FILTER",
    "EXT_PROC_TYPE",
    "LLM_ROUTE_TIMEOUT_S",
    "PROCESSING_MODE",
    "REQUEST_HEADERS_TIMEOUT_S",
    "REQUEST_TIMEOUT_S",
    "SIDECAR_CLUSTER",
    "EnvoyAnswer",
    "body_buffer_bytes",
    "extproc_streams",
    "local_reply_config",
    "render",
    "routes",
    "to_rds",
    "validate",
]

# The sidecar's cluster as the ext_proc filter names it.
SIDECAR_CLUSTER = "llm_extproc"
# Long generations. The route's timer starts when the router gets the request, after the
# sidecar let it go: the queue wait does not count against it
# (tests/e2e/test_pool_through_envoy.py).
LLM_ROUTE_TIMEOUT_S = 600
_STREAM_HEADROOM = 1024  # streams being parsed or answered, beyond queued + running
_MIN_IDLE_S = 300
_ENVOY_IDLE_DEFAULT_S = 300  # HCM stream_idle_timeout when unset (Envoy's docs: 5 minutes)
# A character of prompt can take up to 6 bytes in JSON (\uXXXX), and a body carries more
# than the prompt (roles, parameters).
_BYTES_PER_PROMPT_CHAR = 6
# How long a client may take to send its whole request: the largest body (4 MiB by default)
# over a 1 Mbit/s link takes about 34 s. A client slower than this gets Envoy's 408.
REQUEST_TIMEOUT_S = 60
# How long a client may take to send its request headers (a few hundred bytes).
REQUEST_HEADERS_TIMEOUT_S = 10
# The request header the sidecar sets to the effective max_tokens (extproc.request.respond).
MAX_TOKENS_HEADER = "x-llm-max-tokens"


def _seconds(s: float) -> str:
    return f"{math.ceil(s)}s"


def extproc_streams(policy: Policy) -> int:
    """How many ext_proc streams the policy can hold open at once: every queued or running
    request is one, plus headroom for requests being parsed or answered. Envoy's circuit
    breakers for the sidecar's cluster and the sidecar's own stream limit both use it."""
    queued = sum(b.max_queue for b in policy.buckets)
    pool = policy.pool
    if pool is None:
        running = sum(b.max_concurrency for b in policy.buckets)
    elif pool.adaptive is not None:
        running = max(pool.adaptive.max_limit, pool.max_concurrency)
    else:
        running = pool.max_concurrency
    return queued + running + _STREAM_HEADROOM


def body_buffer_bytes(policy: Policy) -> int:
    """The largest request body Envoy buffers (above it Envoy answers 413 itself): room for
    the largest prompt the policy admits, as JSON, rounded up to a power of two."""
    prompt_bytes = math.ceil(
        policy.limits.max_prompt_tokens * policy.tokens.chars_per_token * _BYTES_PER_PROMPT_CHAR
    )
    return max(DEFAULT_BODY_BYTES, 1 << math.ceil(math.log2(prompt_bytes)))


def render(
    policy: Policy,
    *,
    extproc_address: str = "127.0.0.1",
    extproc_port: int = 50051,
    longest_route_queue_timeout_s: float = 0.0,
    sidecar_cluster: str = SIDECAR_CLUSTER,
    backend_cluster: str = "backend",
) -> dict[str, Any]:
    """The policy-dependent parts of an Envoy config, as dicts in Envoy's YAML shape.

    Several backends, each with its own sidecar and policy (docs/deploy.md, "Several models"):
    render once per backend with its own ``sidecar_cluster`` and ``backend_cluster``. The
    ext_proc filter always names ``llm_extproc``; with another ``sidecar_cluster`` the routes
    carry an ``ExtProcPerRoute`` override that sends their calls to it instead, so one filter
    serves every backend (its ``max_message_timeout`` must be the longest of the renders)."""
    route_wait = longest_route_queue_timeout_s  # a route's waiter may be relegated after it
    route_wait += policy.longest_relegation_s if route_wait else 0.0
    longest_wait = max(policy.longest_queue_timeout_s, route_wait)
    streams = extproc_streams(policy)
    buffer = body_buffer_bytes(policy)

    filters: list[dict[str, Any]] = []
    if policy.trusted_headers:
        filters.append(header_mutation_filter(policy.trusted_headers))
    # The whole body is in before ext_proc opens its stream (the module docstring says why).
    filters.append(buffer_filter(buffer))
    filters.append(
        ext_proc_filter(
            SIDECAR_CLUSTER,
            PROCESSING_MODE,
            max_message_timeout=_seconds(longest_wait + MESSAGE_TIMEOUT_MARGIN_S),
            request_attributes=[ROUTE_ATTRIBUTE],
            receiving_namespaces=[METADATA_NAMESPACE],
        )
    )
    cluster = grpc_cluster(
        sidecar_cluster,
        extproc_port,
        host=extproc_address,
        circuit_breakers={
            "max_connections": 1024,
            "max_pending_requests": streams,
            "max_requests": streams,
        },
    )
    return {
        "http_filters": filters,
        "clusters": [cluster],
        "listener": {"per_connection_buffer_limit_bytes": buffer},
        "http_connection_manager": {
            "stream_idle_timeout": _seconds(max(_MIN_IDLE_S, longest_wait + 60)),
            "request_headers_timeout": f"{REQUEST_HEADERS_TIMEOUT_S}s",
            "request_timeout": f"{REQUEST_TIMEOUT_S}s",
            "local_reply_config": local_reply_config(buffer),
            # x-request-id on every answer: the id the sidecar logs a refusal with.
            "always_set_request_id_in_response": True,
            **PATH_NORMALISATION,
        },
        "virtual_host": {"response_headers_to_add": [echo_request_header(MAX_TOKENS_HEADER)]},
        "routes": routes(backend_cluster, sidecar_cluster),
        "llm_routes": {"timeout": f"{LLM_ROUTE_TIMEOUT_S}s"},
        # Every other route skips the sidecar and streams its body upstream unbuffered.
        "other_routes": {
            "typed_per_filter_config": disabled_on_route(EXT_PROC_FILTER, BUFFER_FILTER)
        },
    }


def routes(cluster: str = "backend", sidecar: str = SIDECAR_CLUSTER) -> list[dict[str, Any]]:
    """The virtual host's routes, in order, to ``cluster``: each path of ``contract.LLM_PATHS``
    (those the sidecar admits and those it refuses) through the sidecar on a route of its own,
    with the long LLM timeout; then the ``PASS_THROUGH`` allowlist, one
    route per method, without the buffer and the sidecar; last, a catch-all Envoy answers
    itself with 404 (``unknown_url``), also without them."""

    def llm() -> dict[str, Any]:
        return {"cluster": cluster, "timeout": f"{LLM_ROUTE_TIMEOUT_S}s"}

    # Exact paths (one regex for all would pass RE2's program size limit, 100 by default).
    out: list[dict[str, Any]] = [{"match": {"path": p}, "route": llm()} for p in LLM_PATHS]
    if sidecar != SIDECAR_CLUSTER:  # this backend's own sidecar, in place of the filter's
        for route in out:
            route["typed_per_filter_config"] = {
                EXT_PROC_FILTER: {
                    "@type": EXT_PROC_PER_ROUTE_TYPE,
                    "overrides": {"grpc_service": {"envoy_grpc": {"cluster_name": sidecar}}},
                }
            }
    for method in dict.fromkeys(m for m, _, _ in PASS_THROUGH):
        allowed = (
            re.escape(p) + (".*" if prefix else "") for m, p, prefix in PASS_THROUGH if m == method
        )
        out.append(
            {
                "match": {
                    "safe_regex": {"regex": _any_of(allowed)},
                    "headers": [{"name": ":method", "string_match": {"exact": method}}],
                },
                "route": {"cluster": cluster, "timeout": f"{REQUEST_TIMEOUT_S}s"},
                "typed_per_filter_config": disabled_on_route(EXT_PROC_FILTER, BUFFER_FILTER),
            }
        )
    # Anything else: Envoy's own 404 (unknown_url). A route, not the absence of one: without a
    # route the buffer and ext_proc filters would still run before the router's 404, and the
    # sidecar would see (and might admit) a request that goes nowhere.
    out.append(
        {
            "match": {"prefix": "/"},
            "direct_response": {"status": 404},
            "typed_per_filter_config": disabled_on_route(EXT_PROC_FILTER, BUFFER_FILTER),
        }
    )
    return out


def _any_of(patterns: Iterable[str]) -> str:
    """An RE2 regex for a route's ``safe_regex``, which must match the whole path (without its
    query): any one of ``patterns``."""
    return "|".join(patterns)


_FILTER_MESSAGES: dict[str, type[Message]] = {
    EXT_PROC_TYPE: ext_proc_pb2.ExternalProcessor,
    EXT_PROC_PER_ROUTE_TYPE: ext_proc_pb2.ExtProcPerRoute,
    BUFFER_TYPE: buffer_pb2.Buffer,
    BUFFER_PER_ROUTE_TYPE: buffer_pb2.BufferPerRoute,
    HEADER_MUTATION_TYPE: header_mutation_pb2.HeaderMutation,
}


def _parse_typed(typed_config: dict[str, Any]) -> None:
    config = {k: v for k, v in typed_config.items() if k != "@type"}
    json_format.ParseDict(config, _FILTER_MESSAGES[typed_config["@type"]]())


def validate(rendered: dict[str, Any]) -> None:
    """Parse every rendered message with Envoy's own protobuf types; raises on a mistake."""
    rendered = copy.deepcopy(rendered)  # ParseDict consumes "@type" keys
    for f in rendered["http_filters"]:
        _parse_typed(f["typed_config"])
    for typed_config in rendered["other_routes"]["typed_per_filter_config"].values():
        _parse_typed(typed_config)
    for c in rendered["clusters"]:
        json_format.ParseDict(c, cluster_pb2.Cluster())
    json_format.ParseDict(
        rendered["http_connection_manager"], http_connection_manager_pb2.HttpConnectionManager()
    )
    json_format.ParseDict(
        {**rendered["virtual_host"], "name": "llm", "domains": ["*"], "routes": rendered["routes"]},
        route_components_pb2.VirtualHost(),
    )


def _duration_s(value: object) -> float | None:
    """An Envoy duration as YAML gives it ("121s", "0.5s", or {seconds, nanos})."""
    if isinstance(value, str) and value.endswith("s"):
        try:
            return float(value[:-1])
        except ValueError:
            return None
    if isinstance(value, dict):
        return float(value.get("seconds", 0)) + float(value.get("nanos", 0)) / 1e9
    return None


def _walk(node: object) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def deadline_problems(policy: Policy, envoy_config: dict[str, Any]) -> list[str]:
    """Where an Envoy config (a bootstrap, or `render-envoy`'s output) cannot honour the
    policy's queue deadlines. Each problem is one sentence naming the bucket, the setting and
    what happens to the request; empty when everything fits.

    - ext_proc ``max_message_timeout`` below a queue timeout + the margin: Envoy refuses the
      sidecar's timeout override and answers 504 after ``message_timeout`` (1 s), silently;
    - HCM ``stream_idle_timeout`` (Envoy's default 300 s when unset) at or below a queue
      timeout: a queued request sends no bytes, so Envoy resets it while it waits.

    A route's ``timeout`` is no problem: its timer starts only once the sidecar let the request
    go (pinned by tests/e2e/test_pool_through_envoy.py, test_the_route_timeout_does_not_count_...).
    """
    problems: list[str] = []
    nodes = list(_walk(envoy_config))
    ext = [n for n in nodes if n.get("@type") == EXT_PROC_TYPE]
    # HTTP connection managers: a bootstrap's (filters and routes), or render()'s part.
    hcms = [
        n
        for n in nodes
        if "stream_idle_timeout" in n
        or ("http_filters" in n and ("route_config" in n or "rds" in n))
    ]
    idle = min(
        (
            t
            for n in hcms
            if (t := _duration_s(n.get("stream_idle_timeout", f"{_ENVOY_IDLE_DEFAULT_S}s")))
        ),
        default=None,
    )
    for b in policy.buckets:
        need = b.queue_timeout_s + MESSAGE_TIMEOUT_MARGIN_S
        for f in ext:
            mmt = _duration_s(f.get("max_message_timeout", "0s")) or 0.0
            if mmt < need:
                problems.append(
                    f"bucket {b.name}: queue_timeout {b.queue_timeout_s:g}s needs ext_proc "
                    f"max_message_timeout >= {need:g}s, but Envoy's is {mmt:g}s: a request "
                    "that waits longer than message_timeout gets Envoy's 504 instead of a slot"
                )
        if idle is not None and idle <= b.queue_timeout_s:
            problems.append(
                f"bucket {b.name}: queue_timeout {b.queue_timeout_s:g}s is not below the "
                f"HTTP connection manager's stream_idle_timeout ({idle:g}s): Envoy resets "
                "a request that waits that long"
            )
    if not ext:
        problems.append("no ext_proc filter found in the Envoy config")
    return problems


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
