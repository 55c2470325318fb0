"""The one builder of Envoy configs for tests, ``make demo`` and the benchmarks.

Everything starts from ``envoy/envoy.yaml`` (what ``llm-extproc render-envoy`` prints for the
embedded default policy, checked by ``tests/test_render.py``) and changes only what a run on
127.0.0.1 must change: ports, the access-log path, and a few knobs the tests and benchmarks
turn (failure mode, backend circuit breakers, plain Envoy without ext_proc, mutual TLS to the
sidecar). The building blocks below it (``address``, ``grpc_cluster``, ...) serve configs that
do not start from the shipped file, such as the overhead benchmark's many-listener Envoy.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

__all__ = ["EXT_PROC_FILTER", "REPO", "render_envoy_config", "with_upstream_tls"]

REPO = Path(__file__).resolve().parent.parent
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
_EXT_PROC = EXT_PROC_FILTER


def _set_address(obj: dict[str, Any], port: int) -> None:
    obj["socket_address"] = {"address": "127.0.0.1", "port_value": port}


def render_envoy_config(
    *,
    listener_port: int,
    backend_port: int,
    extproc_port: int,
    admin_port: int,
    source: Path = REPO / "envoy" / "envoy.yaml",
    failure_mode_allow: bool | None = None,
    access_log: Path | None = None,
    ext_proc: bool = True,
    backend_circuit_breakers: Mapping[str, int] | None = None,
) -> str:
    """envoy/envoy.yaml with its ports replaced (and a few test and benchmark knobs).

    ``ext_proc=False`` gives plain Envoy: the ext_proc HTTP filter, its per-route settings and the
    ``llm_extproc`` cluster are removed (``extproc_port`` is then unused).
    ``backend_circuit_breakers`` replaces the backend cluster's default-priority thresholds, e.g.
    ``{"max_connections": 64, "max_requests": 64, "max_pending_requests": 16}``: Envoy then
    answers 503 (``x-envoy-overloaded``) to what overflows them.
    """
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
                    is_ext_proc = hf["name"] == _EXT_PROC
                    if is_ext_proc and failure_mode_allow is not None:
                        hf["typed_config"]["failure_mode_allow"] = failure_mode_allow
                if access_log is not None:
                    # Keep envoy.yaml's access-log format; only send it to this file.
                    for logger in hcm.get("access_log", []):
                        logger["typed_config"]["path"] = str(access_log)
    ports = {"backend": backend_port, "llm_extproc": extproc_port}
    for cluster in resources["clusters"]:
        if cluster["name"] == "backend" and backend_circuit_breakers is not None:
            cluster["circuit_breakers"] = {"thresholds": [dict(backend_circuit_breakers)]}
        port = ports[cluster["name"]]
        for ep in cluster["load_assignment"]["endpoints"]:
            for lb in ep["lb_endpoints"]:
                _set_address(lb["endpoint"]["address"], port)
    return yaml.safe_dump(cfg, sort_keys=False)


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
    """Remove the ext_proc filter, every per-route config that names it and its cluster."""
    resources = cfg["static_resources"]
    for listener in resources["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                hcm = f["typed_config"]
                hcm["http_filters"] = [
                    hf for hf in hcm.get("http_filters", []) if hf["name"] != _EXT_PROC
                ]
                for vhost in hcm.get("route_config", {}).get("virtual_hosts", []):
                    for route in [vhost, *vhost.get("routes", [])]:
                        per_filter = route.get("typed_per_filter_config")
                        if per_filter is not None:
                            per_filter.pop(_EXT_PROC, None)
                            if not per_filter:
                                del route["typed_per_filter_config"]
    resources["clusters"] = [c for c in resources["clusters"] if c["name"] != "llm_extproc"]
