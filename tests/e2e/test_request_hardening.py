"""Hostile request bodies, round 2, through the real Envoy: what reaches the backend.

- A client's own ``priority`` (vLLM's queue order with ``--scheduling-policy priority``) never
  reaches vLLM: a bucket with ``vllm_priority`` writes its own, a bucket without one removes it.
- A number beyond the double range (``1e400``) is refused with 400 ``invalid_json``, so a
  rewritten body can never carry ``Infinity``.
- The prompt estimate without a tokenizer charges a character by its UTF-8 length: 6,000 emoji
  are 24,000 tokens (real tokenizers: 6,000-24,000), not 1,500, so they cannot pass a
  ``max_prompt_tokens`` of 4,096.
- Route metadata that would give a route a share of 0 slots is refused, never a 500.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from testing.envoy import with_route_metadata
from testing.harness import running_stack, scrape, start_stack
from testing.stack import Stack
from testing.wait import until

# The README's "what the default leaves off" buckets: retries behind first attempts, with no
# vllm_priority of their own, and a catch-all that sets one.
POLICY = """
limits: {max_prompt_tokens: 4096}
pool: {max_concurrency: 8}
buckets:
  - {name: retries, match: {retried: true}, priority: 1, queue_timeout: 30s, max_queue: 100}
  - {name: all, queue_timeout: 30s, max_queue: 100, vllm_priority: 0}
"""


@pytest.fixture(scope="module")
def stack(module_tmp: Path) -> Iterator[Stack]:
    yield from start_stack(module_tmp, POLICY)


def post(stack: Stack, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(
        stack.url + "/v1/chat/completions",
        data=body,
        headers={"content-type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat(**fields: object) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def forwarded(answer: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the bucket, the body) the backend received."""
    echo = answer["echo"]
    return echo["headers"]["x-llm-bucket"], json.loads(echo["body"])


@pytest.mark.parametrize("max_tokens", [10, None, 100000])  # kept, defaulted, clamped
def test_a_retry_cannot_set_vllms_priority(stack: Stack, max_tokens: int | None) -> None:
    fields: dict[str, object] = {"priority": -2147483648}
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    status, answer = post(stack, chat(**fields), {"x-stainless-retry-count": "1"})
    assert status == 200, answer
    bucket, body = forwarded(answer)
    assert bucket == "retries" and "priority" not in body


def test_a_first_attempt_gets_its_buckets_priority_not_its_own(stack: Stack) -> None:
    status, answer = post(stack, chat(max_tokens=10, priority=-2147483648))
    assert status == 200, answer
    bucket, body = forwarded(answer)
    assert bucket == "all" and body["priority"] == 0


def test_the_default_policys_buckets_remove_a_clients_priority(module_tmp: Path) -> None:
    with running_stack(module_tmp / "default", None) as s:  # the embedded default policy
        for headers in ({}, {"x-llm-class": "interactive"}):
            status, answer = post(s, chat(max_tokens=10, priority=-7), headers)
            assert status == 200, answer
            assert "priority" not in forwarded(answer)[1]


@pytest.mark.parametrize("number", [b"1e400", b"-1E+999"])
def test_a_number_beyond_the_double_range_is_refused(stack: Stack, number: bytes) -> None:
    body = b'{"temperature": ' + number + b', "max_tokens": 100000, "messages": [{"role": "user"}]}'
    status, answer = post(stack, body)
    assert status == 400
    assert answer["error"]["code"] == "invalid_json"
    assert "out of range" in answer["error"]["message"]


def test_emoji_cannot_pass_the_prompt_limit_as_a_quarter_token_each(stack: Stack) -> None:
    status, answer = post(
        stack, chat(max_tokens=10).replace(b'"hi"', b'"' + "😀".encode() * 6000 + b'"')
    )
    assert status == 413, answer
    assert answer["error"]["code"] == "prompt_too_long"
    assert "about 24003 tokens" in answer["error"]["message"]  # 6,000 x 4 + 1 message x 3
    status, answer = post(stack, chat(max_tokens=10).replace(b'"hi"', b'"' + b"abcd" * 1000 + b'"'))
    assert status == 200, answer  # 4,000 ASCII characters: 1,000 tokens


def test_route_max_queue_alone_on_a_pool_bucket_is_refused_not_a_500(module_tmp: Path) -> None:
    """Route metadata `max_queue` without `max_concurrency`, for a bucket of a pool that has no
    `max_concurrency` of its own: the route's share would have 0 slots (ValueError, then
    KeyError: every request on the route failed). Now refused like any bad metadata: counted,
    and the policy file applies to the route."""
    with running_stack(module_tmp / "routes", POLICY, rds=True) as s:
        routes = yaml.safe_load(s.routes_path.read_text())
        before = s.envoy_stat("http.llm.rds.llm.update_success")
        s.write_routes(
            with_route_metadata(routes, "/v1/chat/completions", {"bucket": "all", "max_queue": 3})
        )
        until(lambda: s.envoy_stat("http.llm.rds.llm.update_success") > before, "routes loaded")
        for _ in range(3):
            status, answer = post(s, chat(max_tokens=10))
            assert status == 200, answer
            assert forwarded(answer)[0] == "all"
        errors = scrape(s)[("llm_extproc_route_policy_errors_total", ())]
        assert errors == 3
