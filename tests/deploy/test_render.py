"""`llm-extproc render-envoy` and the shipped Envoy configs agree, and Envoy accepts them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.app import default_policy
from extproc.config.envoy import render, validate
from extproc.config.policy import policy_from_yaml
from extproc.contract import LLM_PATHS
from testing.envoy import (
    REPO,
    ROUTER_FILTER,
    assert_valid,
    envoy_validate,
    hcm_config,
    shipped_envoy,
)
from testing.stack import cli

# The connection manager's settings render-envoy derives, each of which envoy.yaml must carry.
HCM_SETTINGS = tuple(render(default_policy())["http_connection_manager"])


def shipped() -> dict[str, Any]:
    cfg = shipped_envoy()
    listener = cfg["static_resources"]["listeners"][0]
    hcm = hcm_config(cfg)
    routes = [r for vh in hcm["route_config"]["virtual_hosts"] for r in vh["routes"]]
    return {
        "http_filters": [f for f in hcm["http_filters"] if f["name"] != ROUTER_FILTER],
        "clusters": [c for c in cfg["static_resources"]["clusters"] if c["name"] == "llm_extproc"],
        "listener": {
            "per_connection_buffer_limit_bytes": listener["per_connection_buffer_limit_bytes"]
        },
        "http_connection_manager": {k: hcm[k] for k in HCM_SETTINGS},
        "virtual_hosts": [
            {k: vh[k] for k in ("response_headers_to_add",)}
            for vh in hcm["route_config"]["virtual_hosts"]
        ],
        "routes": routes,
    }


def test_shipped_envoy_yaml_is_what_render_gives_for_the_default_policy() -> None:
    rendered = render(default_policy())
    validate(rendered)
    have = shipped()
    assert have["http_filters"] == rendered["http_filters"]
    assert have["clusters"] == rendered["clusters"]
    assert have["listener"] == rendered["listener"]
    assert have["http_connection_manager"] == rendered["http_connection_manager"]
    assert have["virtual_hosts"] == [rendered["virtual_host"]]
    # The priority channel (an example of route metadata), then render-envoy's routes: the LLM
    # APIs through every filter, the allowlist skipping the buffer and ext_proc, no catch-all.
    priority, *door = have["routes"]
    assert priority["metadata"] == {"filter_metadata": {"llm_extproc": {"bucket": "priority"}}}
    assert door == rendered["routes"]
    through = [r for r in door if "typed_per_filter_config" not in r]
    assert len(through) == len(LLM_PATHS)
    assert {r["route"]["timeout"] for r in through} == {rendered["llm_routes"]["timeout"]}
    skipping = [r["typed_per_filter_config"] for r in door if r not in through]
    assert skipping and all(
        c == rendered["other_routes"]["typed_per_filter_config"] for c in skipping
    )
    # Last, the catch-all Envoy answers itself: 404, skipping the buffer and ext_proc.
    assert door[-1]["match"] == {"prefix": "/"} and door[-1]["direct_response"] == {"status": 404}


def contains(have: object, want: object) -> bool:
    """Whether ``have`` holds everything ``want`` says: a mapping's keys (with more allowed),
    a list's items in order, a scalar equal."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(
            k in have and contains(have[k], v) for k, v in want.items()
        )
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(have) == len(want)
            and all(contains(h, w) for h, w in zip(have, want, strict=True))
        )
    return have == want


# The Envoy config excerpt README.md showed (issue 30): what an operator adding the sidecar to
# an Envoy of their own copies. Everything in it must come out of render-envoy.
EXCERPT = """
http_filters:
- name: envoy.filters.http.buffer
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer
    max_request_bytes: 4194304
- name: envoy.filters.http.ext_proc
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
    grpc_service: {envoy_grpc: {cluster_name: llm_extproc}}
    failure_mode_allow: false
    processing_mode: {request_header_mode: SEND, response_header_mode: SKIP,
                      request_body_mode: BUFFERED, response_body_mode: NONE}
    message_timeout: 1s
    max_message_timeout: 121s
    allow_mode_override: true
    request_attributes: ["xds.route_metadata"]
    metadata_options: {receiving_namespaces: {untyped: [llm_extproc]}}
typed_per_filter_config:
  envoy.filters.http.ext_proc:
    "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute
    disabled: true
  envoy.filters.http.buffer:
    "@type": type.googleapis.com/envoy.extensions.filters.http.buffer.v3.BufferPerRoute
    disabled: true
response_headers_to_add:
- header: {key: x-llm-max-tokens, value: "%REQ(x-llm-max-tokens)%"}
"""


def test_render_prints_everything_the_envoy_excerpt_shows() -> None:
    """The excerpt's HTTP filters, a non-LLM route's per-filter config and the virtual host's
    response headers are all in what render-envoy prints for the embedded default policy,
    with the same values; and every answer names its request (x-request-id)."""
    excerpt = yaml.safe_load(EXCERPT)
    rendered = render(default_policy())
    ours = [
        f for f in rendered["http_filters"] if f["name"] != "envoy.filters.http.header_mutation"
    ]
    assert contains(ours, excerpt["http_filters"]), ours
    assert contains(
        rendered["other_routes"]["typed_per_filter_config"], excerpt["typed_per_filter_config"]
    )
    assert contains(
        rendered["virtual_host"]["response_headers_to_add"], excerpt["response_headers_to_add"]
    )
    assert rendered["http_connection_manager"]["always_set_request_id_in_response"] is True


def test_render_follows_the_policy() -> None:
    policy = policy_from_yaml(
        """
limits: {max_prompt_tokens: 200000}
buckets:
  - {name: a, max_concurrency: 10, queue_timeout: 10m, max_queue: 20000}
"""
    )
    r = render(policy, longest_route_queue_timeout_s=30)
    ext_proc = r["http_filters"][-1]["typed_config"]
    assert ext_proc["max_message_timeout"] == "601s"
    assert [f["name"] for f in r["http_filters"]] == [
        "envoy.filters.http.buffer",
        "envoy.filters.http.ext_proc",
    ]
    breakers = r["clusters"][0]["circuit_breakers"]["thresholds"][0]
    assert breakers["max_requests"] == 20010 + 1024
    assert r["listener"]["per_connection_buffer_limit_bytes"] == 8 * 1024 * 1024
    assert r["http_connection_manager"]["stream_idle_timeout"] == "660s"
    # The buffer filter sits before ext_proc and holds as much as the listener does.
    assert r["http_filters"][0]["typed_config"]["max_request_bytes"] == 8 * 1024 * 1024
    # The request's own bytes only: on Envoy 1.40 the wait in the queue does not count.
    assert r["http_connection_manager"]["request_timeout"] == "60s"
    assert r["http_connection_manager"]["request_headers_timeout"] == "10s"
    (too_large,) = [
        m["body_format_override"]["json_format"]["error"]
        for m in r["http_connection_manager"]["local_reply_config"]["mappers"]
        if m["body_format_override"]["json_format"]["error"]["code"] == "body_too_large"
    ]
    assert "8388608 bytes" in too_large["message"]
    # A route override waiting longer than the file's buckets raises the limit.
    assert (
        render(policy, longest_route_queue_timeout_s=3600)["http_filters"][-1]["typed_config"][
            "max_message_timeout"
        ]
        == "3601s"
    )


def test_the_message_timeout_covers_a_relegation() -> None:
    """A waiter of a bucket that relegates may wait its queue_timeout and its target's: the
    policy's buckets, and a route's longer queue_timeout, each with the relegation after it."""
    policy = policy_from_yaml(
        """
pool: {max_concurrency: 4}
buckets:
  - {name: a, match: {headers: {x: a}}, queue_timeout: 10s, relegate_to: b}
  - {name: b, priority: 1, queue_timeout: 5s}
"""
    )

    def timeout(route_s: float) -> str:
        r = render(policy, longest_route_queue_timeout_s=route_s)
        return str(r["http_filters"][-1]["typed_config"]["max_message_timeout"])

    assert (timeout(0), timeout(30)) == ("16s", "36s")


def test_render_envoy_command_prints_valid_yaml() -> None:
    out = cli("render-envoy", "--extproc-port", "6000")
    assert out.returncode == 0, out.stderr
    doc = yaml.safe_load(out.stdout)
    assert (
        doc["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"][
            "address"
        ]["socket_address"]["port_value"]
        == 6000
    )


@pytest.mark.parametrize("path", sorted((REPO / "envoy").glob("envoy*.yaml")), ids=str)
def test_envoy_accepts_the_shipped_configs(path: Path) -> None:
    assert_valid(path)


def test_rds_variant_is_generated_from_envoy_yaml() -> None:
    sys.path.insert(0, str(REPO / "envoy"))
    try:
        import make_rds
    finally:
        sys.path.remove(str(REPO / "envoy"))
    bootstrap, routes = make_rds.generate()
    assert (REPO / "envoy" / "envoy-rds.yaml").read_text() == bootstrap, "run `make envoy-rds`"
    assert (REPO / "envoy" / "routes" / "routes.yaml").read_text() == routes, "run `make envoy-rds`"


def test_rds_variant_starts_with_its_routes_file() -> None:
    """envoy -c envoy/envoy-rds.yaml from the repository root loads envoy/routes/routes.yaml."""
    out = envoy_validate(Path("envoy/envoy-rds.yaml"))
    assert out.returncode == 0, out.stdout + out.stderr


LONG_WAIT = policy_from_yaml(
    "buckets: [{name: batch, max_concurrency: 4, queue_timeout: 160s, max_queue: 10}]"
)


def test_deadline_check_passes_the_shipped_config_and_what_render_gives() -> None:
    from extproc.config.envoy import deadline_problems

    assert deadline_problems(default_policy(), shipped_envoy()) == []
    assert deadline_problems(LONG_WAIT, render(LONG_WAIT)) == []


def test_deadline_check_names_every_deadline_envoy_cannot_honour() -> None:
    """The shipped envoy.yaml (max_message_timeout 121s, stream_idle_timeout 300s) cannot
    honour a 160 s wait, nor a 700 s one; what render-envoy gives for each can."""
    from extproc.config.envoy import deadline_problems

    problems = deadline_problems(LONG_WAIT, shipped_envoy())
    assert len(problems) == 1 and "max_message_timeout >= 161s, but Envoy's is 121s" in problems[0]
    longer = policy_from_yaml(
        "buckets: [{name: batch, max_concurrency: 4, queue_timeout: 700s, max_queue: 10}]"
    )
    text = "\n".join(deadline_problems(longer, shipped_envoy()))
    assert "max_message_timeout" in text
    assert "stream_idle_timeout (300s)" in text
    assert "route" not in text  # it starts after the wait: tests/e2e/test_pool_through_envoy.py
    assert deadline_problems(longer, render(longer)) == []
    assert deadline_problems(LONG_WAIT, {}) == ["no ext_proc filter found in the Envoy config"]


def test_deadline_check_assumes_envoys_default_idle_timeout_when_unset() -> None:
    from extproc.config.envoy import deadline_problems

    cfg = shipped_envoy()
    del hcm_config(cfg)["stream_idle_timeout"]
    longer = policy_from_yaml(
        "buckets: [{name: batch, max_concurrency: 4, queue_timeout: 400s, max_queue: 10}]"
    )
    assert any("stream_idle_timeout (300s)" in p for p in deadline_problems(longer, cfg))


def test_check_command_exits_1_when_envoy_cannot_honour_a_deadline(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "buckets: [{name: batch, max_concurrency: 4, queue_timeout: 160s, max_queue: 10}]"
    )
    cmd = [sys.executable, "-m", "extproc.cli", "check", "--policy", str(policy)]
    bad = subprocess.run(
        [*cmd, "--envoy", str(REPO / "envoy" / "envoy.yaml")], capture_output=True, text=True
    )
    assert bad.returncode == 1
    assert "deadline cannot be honoured: bucket batch" in bad.stderr
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(yaml.safe_dump(render(policy_from_yaml(policy.read_text()))))
    good = subprocess.run([*cmd, "--envoy", str(rendered)], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert "honours every queue deadline" in good.stdout
