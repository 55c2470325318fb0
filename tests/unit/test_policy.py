"""Policy loading: the schema, defaults, and precise errors (file, key, why)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from extproc.app import default_policy
from extproc.config.policy import (
    OnExcess,
    PolicyError,
    is_retry,
    parse_duration,
    policy_from_yaml,
)
from testing.stack import cli

REPO = Path(__file__).resolve().parents[2]

MINIMAL = """
buckets:
  - {name: all, max_concurrency: 4, queue_timeout: 5s, max_queue: 10}
"""


@pytest.mark.parametrize(
    "text,seconds",
    [
        ("250ms", 0.25),
        ("5s", 5.0),
        ("1.5s", 1.5),
        ("2m", 120.0),
        ("1h", 3600.0),
        (3, 3.0),
        ("0s", 0.0),
        (".5s", 0.5),
    ],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["5", "5x", "-1s", "s", "", True, None, [1], "1e400s"])
def test_bad_durations(text: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_defaults_fill_in() -> None:
    p = policy_from_yaml(MINIMAL)
    assert p.tokens.chars_per_token == 4.0
    assert p.limits.max_prompt_tokens == 32768
    assert p.limits.default_max_tokens == 256
    assert p.limits.max_output_tokens == 1024
    assert p.limits.on_excess is OnExcess.CLAMP
    assert (p.retry_after.min_s, p.retry_after.max_s) == (1.0, 60.0)
    (b,) = p.buckets
    assert (b.name, b.max_concurrency, b.queue_timeout_s, b.max_queue) == ("all", 4, 5.0, 10)
    assert b.match.is_catch_all


def policy_doc_blocks() -> list[str]:
    """The YAML blocks of docs/policy.md's "The policy file" section, in order."""
    import re

    text = (REPO / "docs" / "policy.md").read_text(encoding="utf-8")
    section = text.split("\n## The policy file\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```yaml\n(.*?)```", section, re.S)


def test_embedded_default_matches_the_documented_example() -> None:
    """docs/policy.md's first policy block is the embedded default with every key spelled out: it
    resolves to exactly the embedded policy. The second holds what the default leaves off,
    at the defaults where a setting has one (the objectives have none)."""
    from extproc.config.policy import AdaptivePolicy, BackendPolicy, TenantPolicy

    default_block, off_block = policy_doc_blocks()[:2]
    p = default_policy()
    assert policy_from_yaml(default_block, "docs/policy.md") == p
    assert p.pool is not None and p.pool.max_concurrency == 64
    assert [(b.name, b.priority, b.min_share, b.max_share) for b in p.buckets] == [
        ("priority", 0, 0.0, 1.0),
        ("interactive-retry", 2, 0.0, 1.0),
        ("interactive", 1, 0.5, 1.0),
        ("batch", 10, 0.1, 0.75),
    ]
    off = policy_from_yaml(off_block, "docs/policy.md")
    assert off.pool is not None and off.pool.max_tokens_in_flight is not None
    assert off.pool.adaptive == AdaptivePolicy(slo_s={"ttft": 2.0, "itl": 0.1})
    assert off.backend.scrape_timeout_s == BackendPolicy().scrape_timeout_s
    assert off.bucket("all").vllm_priority == 0
    tenant = off.bucket("all").tenant
    assert tenant is not None and off.bucket("all").order.value == "fair"
    assert (tenant.max_tracked, tenant.idle_ttl_s) == (
        TenantPolicy().max_tracked,
        TenantPolicy().idle_ttl_s,
    )


def test_on_excess_reject_and_header_names_lowercased() -> None:
    p = policy_from_yaml(
        """
limits: {on_excess: reject}
buckets:
  - {name: a, match: {headers: {X-Team: blue}}, max_concurrency: 1, queue_timeout: 1s, max_queue: 0}
  - {name: b, max_concurrency: 1, queue_timeout: 1s, max_queue: 0}
"""
    )
    assert p.limits.on_excess is OnExcess.REJECT
    assert p.buckets[0].match.headers == (("x-team", "blue"),)


@pytest.mark.parametrize(
    ("value", "retry"),
    [
        (None, False),
        ("0", False),
        ("000", False),
        ("1", True),
        ("2", True),
        ("0010", True),
        ("9" * 5000, True),  # no int(): Python refuses to convert over 4300 digits
        ("-1", False),
        ("1.0", False),
        (" 1", False),
        ("", False),
        ("١", False),  # a digit, but not ASCII
        ("yes", False),
    ],
)
def test_a_retry_is_a_retry_count_above_zero(value: str | None, retry: bool) -> None:
    headers = {} if value is None else {"x-stainless-retry-count": value}
    assert is_retry(headers) is retry


def test_retried_splits_first_attempts_from_retries() -> None:
    p = policy_from_yaml(
        """
pool: {max_concurrency: 4}
buckets:
  - {name: again, match: {headers: {x-c: i}, retried: true}, priority: 1, queue_timeout: 1s,
     max_queue: 9}
  - {name: first, match: {retried: false}, queue_timeout: 1s, max_queue: 9}
  - {name: rest, queue_timeout: 1s, max_queue: 9}
"""
    )
    again, first, rest = p.buckets
    assert again.match.retried is True and first.match.retried is False
    assert rest.match.retried is None and rest.match.is_catch_all
    assert not first.match.is_catch_all
    retry = {"x-c": "i", "x-stainless-retry-count": "2"}
    assert again.match.matches(retry, 10, 10)
    assert not again.match.matches({"x-c": "i", "x-stainless-retry-count": "0"}, 10, 10)
    assert not again.match.matches({"x-stainless-retry-count": "2"}, 10, 10)  # headers too
    assert first.match.matches({"x-c": "i"}, 10, 10) and not first.match.matches(retry, 10, 10)
    assert p.to_dict()["buckets"][0]["match"] == {"headers": {"x-c": "i"}, "retried": True}
    assert policy_from_yaml(yaml.safe_dump(p.to_dict())) == p


@pytest.mark.parametrize(
    "text,message",
    [
        ("buckets: []", "buckets: at least one bucket is required"),
        ("{}", "buckets: at least one bucket is required"),
        ("[1, 2]", "<top>: expected a mapping, got list"),
        (
            "bucket: []",
            "bucket: unknown key (known keys: tokens, limits, retry_after, buckets, "
            "mode, trusted_headers, pool, backend, client_deadline, endpoints)",
        ),
        (
            "buckets: [{name: a, max_concurrency: 1, queue_timeout: 5x, max_queue: 1}]",
            "buckets[0].queue_timeout: bad duration '5x'",
        ),
        (
            "buckets: [{name: a, max_concurrency: -1, queue_timeout: 5s, max_queue: 1}]",
            "buckets[0].max_concurrency: -1 is out of range",
        ),
        (
            "buckets: [{name: a, max_concurrency: '4', queue_timeout: 5s, max_queue: 1}]",
            "buckets[0].max_concurrency: expected an integer, got str '4'",
        ),
        (
            "buckets: [{name: a, max_concurrency: 0, queue_timeout: 5s, max_queue: 1}]",
            "buckets[0].max_concurrency: must be at least 1",
        ),
        (
            "buckets: [{name: a, max_concurrency: 1, max_queue: 1}]",
            "buckets[0].queue_timeout: required",
        ),
        (
            "buckets: [{name: A B, max_concurrency: 1, queue_timeout: 1s, max_queue: 1}]",
            "buckets[0].name: 'A B' must be",
        ),
        (
            "buckets: [{name: a, matsh: {}, max_concurrency: 1, queue_timeout: 1s, max_queue: 1}]",
            "buckets[0].matsh: unknown key",
        ),
        (
            "buckets: [{name: a, match: {headers: {x: 1}}, max_concurrency: 1, queue_timeout: 1s}]",
            "buckets[0].match.headers.x: expected a string, got int 1",
        ),
        (
            "buckets:\n- {name: a, max_concurrency: 1, queue_timeout: 1s}\n"
            "- {name: b, max_concurrency: 1, queue_timeout: 1s}",
            "buckets[0]: bucket 'a' matches every request",
        ),
        (
            "buckets:\n- {name: a, match: {max_tokens: 5}, max_concurrency: 1, queue_timeout: 1s}",
            "buckets[0]: the last bucket must have no `match`",
        ),
        (
            "buckets:\n- {name: a, match: {max_tokens: 5}, max_concurrency: 1, queue_timeout: 1s}\n"
            "- {name: a, max_concurrency: 1, queue_timeout: 1s}",
            "buckets[1].name: bucket 'a' is defined twice",
        ),
        (
            "limits: {on_excess: drop}\n" + MINIMAL,
            "limits.on_excess: expected one of clamp, reject",
        ),
        (
            "limits: {default_max_tokens: 2000, max_output_tokens: 1000}\n" + MINIMAL,
            "limits.default_max_tokens: 2000 is above limits.max_output_tokens (1000)",
        ),
        ("tokens: {chars_per_token: 0}\n" + MINIMAL, "tokens.chars_per_token: must be greater"),
        (
            "tokens: {chars_per_token: .nan}\n" + MINIMAL,
            "tokens.chars_per_token: expected a finite",
        ),
        ("retry_after: {min: 500ms}\n" + MINIMAL, "retry_after.min: must be at least 1s"),
        (
            "retry_after: {min: 10s, max: 5s}\n" + MINIMAL,
            "retry_after.max: 5s is below retry_after.min (10s); set min to at most 5s",
        ),
        (
            "buckets: [{name: a, max_concurrency: 1, queue_timeout: 1s, max_queue: true}]",
            "buckets[0].max_queue: expected an integer, got bool True",
        ),
        ("buckets: {name: a}", "buckets: expected a list, got dict"),
        ("buckets: [\n", "not valid YAML"),
        (
            "trusted_headers: [x-tier]\nbuckets:\n"
            "- {name: a, trusted: true, match: {headers: {x-class: a}}, max_concurrency: 1,"
            " queue_timeout: 1s}\n- {name: b, max_concurrency: 1, queue_timeout: 1s}",
            "buckets[0].match.headers: bucket 'a' is trusted, so it may match only on headers "
            "listed in trusted_headers (not: x-class)",
        ),
        ("mode: strict\n" + MINIMAL, "mode: expected one of enforce, shadow"),
        (
            "tokens: {tokenizer: /nonexistent/tokenizer.json}\n" + MINIMAL,
            "tokens.tokenizer: no such file '/nonexistent/tokenizer.json'",
        ),
    ],
)
def test_errors_name_the_key_and_why(text: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        policy_from_yaml(text, "p.yaml")
    assert str(info.value).startswith("p.yaml: ")
    assert message in str(info.value)


def test_check_command(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(MINIMAL)
    out = cli("check", "--policy", str(good))
    assert out.returncode == 0, out.stderr
    assert "name: all" in out.stdout and "queue_timeout: 5s" in out.stdout
    assert "max_message_timeout must be at least 6s" in out.stdout

    bad = tmp_path / "bad.yaml"
    bad.write_text("buckets: [{name: a, max_concurrency: 1, queue_timeout: soon}]")
    out = cli("check", "--policy", str(bad))
    assert out.returncode == 1
    assert out.stderr.strip() == (
        f"error: {bad}: buckets[0].queue_timeout: bad duration 'soon': "
        "expected a number with ms, s, m or h"
    )


def test_round_trip_of_check_output() -> None:
    """What `check` prints is itself a valid policy that resolves to the same thing."""
    p = default_policy()
    again = policy_from_yaml(yaml.safe_dump(p.to_dict()))
    assert again == p


def test_route_overrides_are_validated_against_the_schema_and_policy() -> None:
    from extproc.config.policy import RouteOverride, route_override_from_mapping

    p = default_policy()
    ok = route_override_from_mapping(
        {"bucket": "batch", "max_concurrency": 4.0, "queue_timeout": "2s", "max_output_tokens": 64},
        p,
    )
    assert ok == RouteOverride(
        bucket="batch", max_concurrency=4, queue_timeout_s=2.0, max_output_tokens=64
    )
    for data, message in [
        ({"bucket": "nope"}, "bucket: 'nope' is not a bucket of the policy"),
        ({"buckett": "batch"}, "buckett: unknown key"),
        ({"max_concurrency": 3}, "set `bucket` too"),
        ({"bucket": "batch", "max_concurrency": 0}, "max_concurrency: must be at least 1"),
        ({"queue_timeout": "soon"}, "queue_timeout: bad duration"),
        ({"max_output_tokens": -1}, "max_output_tokens: -1 is out of range"),
    ]:
        with pytest.raises(PolicyError, match=message):
            route_override_from_mapping(data, p)


FULL = """
mode: shadow
trusted_headers: [x-tier]
tokens: {chars_per_token: 3.5, non_text_part_tokens: 100, message_overhead_tokens: 2}
limits: {max_prompt_tokens: 9000, default_max_tokens: 100, max_output_tokens: 200,
         on_excess: reject, max_queued_bytes: 1000000}
retry_after: {min: 2s, max: 90s, jitter: 0.25}
pool:
  max_concurrency: 40
  max_tokens_in_flight: 500000
  fail_fast: false
  overload: {enabled: false, tighten_eviction_rate: 0.1, step_hold: 1m, window: 20s}
  shared: {redis: "redis://cache:6380/2", key_prefix: "p:x", lease: 4s, timeout: 100ms,
           replicas: 3}
  adaptive: {min: 2, max: 80, initial: 10, interval: 250ms, window: 5s, max_kv_usage: 0.8,
             stale_after: 2s, fallback_after: 4s,
             slo: {ttft: 1500ms, ttft_quantile: 0.95, inter_token: 50ms,
                   inter_token_quantile: 0.5, abandoned: 0.02}}
backend: {metrics: ["http://vllm:8000/metrics"], scrape_timeout: 1s}
client_deadline: {headers: [x-deadline-ms], seconds_headers: [x-timeout-s], margin: 250ms}
buckets:
  - {name: vip, match: {headers: {x-tier: gold}}, trusted: true, priority: 0, min_share: 0.25,
     max_share: 0.5, order: cost, max_concurrency: 8, queue_timeout: 30s, max_queue: 5,
     vllm_priority: -1}
  - {name: small, match: {max_prompt_tokens: 100, max_tokens: 50, retried: false},
     queue_timeout: 2s, max_queue: 9}
  - {name: rest, queue_timeout: 500ms, max_queue: 20}
"""


def _schema_keys(desc: object, data: object, path: str) -> list[str]:
    """The keys of ``data`` that the message descriptor ``desc`` does not define."""
    if not isinstance(data, dict):
        return []
    unknown = []
    for key, value in data.items():
        fd = desc.fields_by_name.get(key)  # type: ignore[attr-defined]
        if fd is None:
            unknown.append(f"{path}{key}")
        elif fd.message_type is not None and not fd.message_type.GetOptions().map_entry:
            for item in value if isinstance(value, list) else [value]:
                unknown += _schema_keys(fd.message_type, item, f"{path}{key}.")
    return unknown


def test_check_output_of_a_policy_that_sets_everything() -> None:
    """Every setting comes back from `check` under the schema's own key, and resolves to the
    same policy: ``to_dict`` derives the keys from the model's fields and a few renames."""
    from extproc._proto.llm_extproc.v1 import policy_pb2

    p = policy_from_yaml(FULL)
    printed = p.to_dict()
    assert _schema_keys(policy_pb2.Policy.DESCRIPTOR, printed, "") == []
    assert policy_from_yaml(yaml.safe_dump(printed)) == p
    assert printed["pool"]["adaptive"]["slo"] == {
        "ttft": "1.5s",
        "ttft_quantile": 0.95,
        "inter_token": "50ms",
        "inter_token_quantile": 0.5,
        "abandoned": 0.02,
    }
    assert printed["client_deadline"]["seconds_headers"] == ["x-timeout-s"]
    assert printed["buckets"][2] == {
        "name": "rest",
        "match": {},
        "max_concurrency": 0,
        "queue_timeout": "500ms",
        "max_queue": 20,
        "trusted": False,
        "priority": 0,
        "min_share": 0.0,
        "max_share": 1.0,
        "order": "fifo",
    }


def test_check_output_leaves_out_what_is_unset() -> None:
    """No pool: no pool section and no pool settings on a bucket; an adaptive limit without
    objectives prints an empty ``slo``; a password never shows."""
    printed = policy_from_yaml(MINIMAL).to_dict()
    assert "pool" not in printed
    assert printed["buckets"][0] == {
        "name": "all",
        "match": {},
        "max_concurrency": 4,
        "queue_timeout": "5s",
        "max_queue": 10,
        "trusted": False,
    }
    assert printed["tokens"]["tokenizer"] is None
    pooled = policy_from_yaml(
        "pool: {adaptive: {}, shared: {redis: 'redis://u:pw@cache:6379'}}\n"
        "backend: {metrics: ['http://vllm:8000/metrics']}\n"
        "buckets: [{name: all, queue_timeout: 1s, max_queue: 1}]"
    ).to_dict()["pool"]
    assert list(pooled) == [
        "max_concurrency",
        "max_tokens_in_flight",
        "fail_fast",
        "overload",
        "shared",
        "adaptive",
    ]
    assert pooled["max_tokens_in_flight"] is None
    assert pooled["adaptive"]["slo"] == {}
    assert pooled["shared"]["redis"] == "redis://u:***@cache:6379"
