"""The ways through Envoy, what is sent on them, the servers' policies, the ports and the
many-listener Envoy config (built from ``testing.envoy``'s building blocks).

A way is what is measured (a listener and a body); a server is an ext_proc process behind
one or more ways. ``metered_of`` says whose CPU a way's server CPU is: for ``sidecar+redis``
the sidecar's and the redis-server's together (both work for each request of that way)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import yaml

from bench.common.policy import REDIS_PLACEHOLDER, policy_yaml
from extproc.config.envoy import PROCESSING_MODE
from testing.envoy import (
    address,
    buffer_filter,
    direct_response_route,
    ext_proc_filter,
    grpc_cluster,
    http_listener,
    router_filter,
)
from testing.stack import free_port

__all__ = [
    "CHAT_PATH",
    "CLASS_HEADER",
    "FLOOR",
    "HELD",
    "NAIVE",
    "REDIS",
    "SERVERS",
    "SHARED_POLICY",
    "SIDECAR",
    "SIDECAR_POLICY",
    "SIDECAR_REDIS",
    "SIDECAR_RW",
    "SIDECAR_SHARED",
    "WAYS",
    "Ports",
    "chat_body",
    "envoy_config",
    "held_policy",
    "listener_of",
    "metered_of",
    "server_of",
    "shared_policy",
]

CHAT_PATH = "/v1/chat/completions"
CLASS_HEADER = ("x-llm-class", "interactive")

# The ways through Envoy, in the order they are reported.
FLOOR, NAIVE, SIDECAR, SIDECAR_RW = "floor", "naive", "sidecar", "sidecar+rw"
# The sidecar's policy with its slots in a static pool shared through a local redis-server
# (``pool.shared``): the way, its sidecar (server and listener), and the redis-server.
SIDECAR_REDIS = "sidecar+redis"
SIDECAR_SHARED = "sidecar-shared"
REDIS = "redis"
WAYS = (FLOOR, NAIVE, SIDECAR, SIDECAR_RW, SIDECAR_REDIS)
# The ext_proc servers whose CPU is measured (and the redis-server, see metered_of).
SERVERS = (NAIVE, SIDECAR, SIDECAR_SHARED)
# The held-queue sidecar's listener and server (not a way: it is measured on its own).
HELD = "held"


def listener_of(way: str) -> str:
    """The listener a way is sent to (sidecar+rw is the sidecar's, with another body;
    sidecar+redis the shared-pool sidecar's)."""
    return {SIDECAR_RW: SIDECAR, SIDECAR_REDIS: SIDECAR_SHARED}.get(way, way)


def server_of(way: str) -> str | None:
    """The ext_proc server behind a way (None for the floor)."""
    servers = {NAIVE: NAIVE, SIDECAR: SIDECAR, SIDECAR_RW: SIDECAR, SIDECAR_REDIS: SIDECAR_SHARED}
    return servers.get(way)


def metered_of(way: str) -> tuple[str, ...]:
    """The processes whose CPU counts as the way's server CPU: its ext_proc server, and for
    sidecar+redis the redis-server too (every request it admits may cost Redis work)."""
    server = server_of(way)
    if server is None:
        return ()
    return (server, REDIS) if way == SIDECAR_REDIS else (server,)


# --------------------------------------------------------------------------------------------
# What is sent and answered
# --------------------------------------------------------------------------------------------

_SYSTEM = (
    "You are a helpful assistant for a travel company. Answer briefly and precisely, cite the "
    "booking rules you rely on, and never invent prices."
)
_USER = (
    "I booked a flight from Lisbon to Montreal for the 14th of next month and a hotel near the "
    "old port for five nights. My meeting moved by two days, so I need to leave on the 16th "
    "instead and stay until the 23rd. Can I change the flight without paying the full fare "
    "difference, and does the hotel let me shift the dates if I tell them this week? I also "
    "have a connection in Paris on the way out; if the first leg is late, who rebooks me, and "
    "do I keep my seat on the second flight? Please answer point by point and keep it short, "
    "I will forward your answer to my manager for approval before I change anything."
)


def chat_body(*, with_max_tokens: bool) -> bytes:
    """A realistic small chat request (~1 KB). With max_tokens 128 (within every limit: the
    sidecar forwards it untouched) or without (the sidecar adds the default and rewrites)."""
    body: dict[str, Any] = {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "messages": [
            {"role": "system", "content": _SYSTEM},
            {"role": "user", "content": _USER},
            {"role": "assistant", "content": "Sure. Which airline and which hotel chain?"},
            {"role": "user", "content": "TAP Air Portugal, and the hotel is independent."},
        ],
        "temperature": 0.2,
        "top_p": 0.95,
        "stream": False,
        "user": "user-4821",
    }
    if with_max_tokens:
        body["max_tokens"] = 128
    return json.dumps(body).encode()


# What the direct_response route answers: a chat completion of ordinary size.
_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "You can change both; details follow."},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 260, "completion_tokens": 9, "total_tokens": 269},
    }
)

# --------------------------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------------------------

# Tokens, limits and Retry-After of every sidecar way: the default policy's.
_COMMON: dict[str, Any] = {
    "tokens": {"chars_per_token": 4.0},
    "limits": {
        "max_prompt_tokens": 32768,
        "default_max_tokens": 256,
        "max_output_tokens": 1024,
        "on_excess": "clamp",
    },
    "retry_after": {"min": "1s", "max": "60s"},
}
_INTERACTIVE = {"headers": {"x-llm-class": "interactive"}, "max_prompt_tokens": 2000,
                "max_tokens": 128}  # fmt: skip

# The sidecars of the ways: the default policy's shape (interactive by header, batch for the
# rest), with slots and queues far above what the load reaches, so every request is admitted
# at once.
SIDECAR_POLICY = policy_yaml(
    {
        **_COMMON,
        "buckets": [
            {"name": "interactive", "match": _INTERACTIVE, "max_concurrency": 4096,
             "queue_timeout": "5s", "max_queue": 4096},
            {"name": "batch", "max_concurrency": 4096, "queue_timeout": "120s", "max_queue": 5000},
        ],
    },
    source="bench.overhead sidecar",
)  # fmt: skip

# sidecar+redis: SIDECAR_POLICY's buckets as the bands of one static pool with their slots
# together (2 x 4096), shared through Redis (``{redis}``: the local redis-server's URL) with the
# policy's default lease (10 s, renewed every lease / 3) and timeout (250 ms). One replica: what
# is measured is the round trips, not a split. A lease freed with nobody waiting stays with the
# replica as a spare and is reused without a round trip; ``redis_calls_per_request`` in the
# report says how many requests went to Redis after all.
SHARED_POLICY = policy_yaml(
    {
        **_COMMON,
        "pool": {"max_concurrency": 8192,
                 "shared": {"redis": REDIS_PLACEHOLDER, "key_prefix": "overhead",
                            "replicas": 1}},
        "buckets": [
            {"name": "interactive", "match": _INTERACTIVE, "priority": 0, "queue_timeout": "5s",
             "max_queue": 4096},
            {"name": "batch", "priority": 10, "queue_timeout": "120s", "max_queue": 5000},
        ],
    },
    source="bench.overhead sidecar+redis",
)  # fmt: skip


def shared_policy(redis_url: str) -> str:
    """SHARED_POLICY with the redis-server's URL."""
    return SHARED_POLICY.replace(REDIS_PLACEHOLDER, redis_url)


def held_policy(max_queue: int) -> str:
    """The held-queue sidecar's policy: one slot, a long deadline, room for ``max_queue``
    waiters."""
    data = {
        "tokens": {"chars_per_token": 4.0},
        "limits": {
            "max_prompt_tokens": 32768,
            "default_max_tokens": 256,
            "max_output_tokens": 1024,
        },
        "buckets": [
            {"name": "held", "max_concurrency": 1, "queue_timeout": "300s", "max_queue": max_queue}
        ],
    }
    return policy_yaml(data, source="bench.overhead held")


# --------------------------------------------------------------------------------------------
# Ports and the Envoy config
# --------------------------------------------------------------------------------------------

# Every request held by an ext_proc server is one open gRPC stream: keep Envoy's breakers far
# above the largest queue (their default, 1024, would refuse the held queue).
_BREAKERS = {"max_connections": 1024, "max_pending_requests": 100000, "max_requests": 100000}

# ext_proc server -> the name of its Envoy cluster.
_CLUSTERS = {
    NAIVE: "naive_extproc",
    SIDECAR: "sidecar_extproc",
    SIDECAR_SHARED: "sidecar_shared_extproc",
    HELD: "held_extproc",
}

# The listeners echo the effective max_tokens (the sidecar sets x-llm-max-tokens upstream):
# the sanity check reads it to prove the sidecar processed the request.
_ECHO_MAX_TOKENS = {
    "header": {"key": "x-llm-max-tokens", "value": "%REQ(x-llm-max-tokens)%"},
    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
}


@dataclass(frozen=True, slots=True)
class Ports:
    admin: int
    # listener (floor and each ext_proc server's: naive, sidecar, sidecar-shared, held) -> port
    listeners: dict[str, int]
    grpc: dict[str, int]  # ext_proc server (naive, sidecar, sidecar-shared, held) -> port
    metrics: dict[str, int]  # sidecar, sidecar-shared, held -> metrics port

    @staticmethod
    def pick() -> Ports:
        servers = (NAIVE, SIDECAR, SIDECAR_SHARED, HELD)
        return Ports(
            admin=free_port(),
            listeners={w: free_port() for w in (FLOOR, *servers)},
            grpc={s: free_port() for s in servers},
            metrics={s: free_port() for s in servers if s != NAIVE},
        )


def _listener(name: str, port: int, cluster: str, *, ext_proc_disabled: bool) -> dict[str, Any]:
    """One way: ext_proc (the shipped filter settings) to ``cluster``, a buffer filter, and the
    chat route answered by Envoy itself."""
    return http_listener(
        name,
        port,
        routes=[direct_response_route(CHAT_PATH, _COMPLETION, without_ext_proc=ext_proc_disabled)],
        http_filters=[
            ext_proc_filter(cluster, PROCESSING_MODE),
            buffer_filter(),
            router_filter(),
        ],
        response_headers_to_add=[_ECHO_MAX_TOKENS],
    )


def envoy_config(ports: Ports) -> str:
    """One listener per way (and the held sidecar's), one cluster per ext_proc server."""
    listeners = [
        # The floor's filter names a real ext_proc cluster, but the route disables the filter.
        _listener(FLOOR, ports.listeners[FLOOR], _CLUSTERS[NAIVE], ext_proc_disabled=True),
        *(
            _listener(w, ports.listeners[w], _CLUSTERS[w], ext_proc_disabled=False)
            for w in (NAIVE, SIDECAR, SIDECAR_SHARED, HELD)
        ),
    ]
    cfg = {
        "admin": {"address": address(ports.admin)},
        "static_resources": {
            "listeners": listeners,
            "clusters": [
                grpc_cluster(c, ports.grpc[s], circuit_breakers=_BREAKERS)
                for s, c in _CLUSTERS.items()
            ],
        },
    }
    return yaml.safe_dump(cfg, sort_keys=False)
