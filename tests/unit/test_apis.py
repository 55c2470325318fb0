"""Every generation API vLLM serves that the sidecar admits, parsed and bounded (issue 31):
the Responses API, Anthropic's Messages, the pooling endpoints; each with a prompt estimate,
its own output bound rewritten in its own key, its own field names in errors. Chat and
completions: tests/unit/test_parse.py; through the real Envoy: tests/e2e/test_door.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.config.policy import PolicyError, policy_from_yaml
from extproc.outcome import Outcome, RequestError, queue_rejection
from extproc.request.classify import MaxTokensAction, classify, token_counter
from extproc.request.endpoints import Endpoint
from extproc.request.parse import parse_body
from extproc.request.respond import anthropic_error

POLICY = policy_from_yaml(
    """
limits: {max_prompt_tokens: 1000, default_max_tokens: 64, max_output_tokens: 512}
buckets:
  - name: all
    vllm_priority: 3
    max_concurrency: 2
    queue_timeout: 1s
"""
)
COUNT = token_counter(POLICY.tokens)
RESPONSES, MESSAGES, POOLING = Endpoint.RESPONSES, Endpoint.MESSAGES, Endpoint.POOLING


def run(endpoint: Endpoint, body: dict[str, Any]) -> Any:
    return classify(POLICY, COUNT, {}, parse_body(endpoint, json.dumps(body).encode()))


def sent(cls: Any) -> dict[str, Any]:
    assert cls.new_body is not None
    return json.loads(cls.new_body)  # type: ignore[no-any-return]


def test_responses_input_instructions_and_tools_are_the_prompt() -> None:
    body = {
        "model": "m",
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": "hello there"},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "and this"},
                    {"type": "input_image", "image_url": "data:..."},
                ],
            },
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
        ],
        "tools": [{"type": "function", "name": "f"}],
    }
    req = parse_body(RESPONSES, json.dumps(body).encode())
    assert "be brief" in req.texts and "hello there" in req.texts and "and this" in req.texts
    assert any('"function_call_output"' in t for t in req.texts)  # other items: their JSON
    assert any('"name":"f"' in t for t in req.texts)  # tools
    assert (req.messages, req.non_text_parts) == (3, 1)
    assert parse_body(RESPONSES, b'{"input": "just text"}').texts == ("just text",)


def test_responses_bound_is_max_output_tokens() -> None:
    clamped = run(RESPONSES, {"input": "hi", "max_output_tokens": 9000})
    assert (clamped.max_tokens, clamped.max_tokens_action) == (512, MaxTokensAction.CLAMPED)
    assert sent(clamped)["max_output_tokens"] == 512 and "max_tokens" not in sent(clamped)
    defaulted = run(RESPONSES, {"input": "hi"})
    assert sent(defaulted) == {"input": "hi", "max_output_tokens": 64}
    # vllm_priority is written on chat and completions only: here the client's goes.
    assert "priority" not in sent(run(RESPONSES, {"input": "hi", "priority": -9}))


def test_messages_system_blocks_and_max_tokens() -> None:
    body = {
        "model": "m",
        "system": [{"type": "text", "text": "you are terse"}],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image", "source": {"type": "base64", "data": "..."}},
                ],
            },
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
            },
            {"role": "user", "content": "thanks"},
        ],
        "max_tokens": 5000,
    }
    req = parse_body(MESSAGES, json.dumps(body).encode())
    assert {"you are terse", "look", "thanks"} <= set(req.texts)
    assert any('"tool_use"' in t for t in req.texts)
    assert (req.messages, req.non_text_parts) == (3, 1)
    cls = run(MESSAGES, body)
    assert sent(cls)["max_tokens"] == 512 and cls.max_tokens_action is MaxTokensAction.CLAMPED


@pytest.mark.parametrize(
    "body",
    [
        {"model": "e", "input": "one text"},
        {"model": "e", "input": ["a", "b", "c"]},
        {"model": "e", "input": [[1, 2, 3], [4, 5]]},
        {"model": "r", "query": "q", "documents": ["d1", "d2"]},
        {"model": "s", "text_1": "x", "text_2": ["y", "z"]},
    ],
)
def test_pooling_counts_the_prompt_and_bounds_no_output(body: dict[str, Any]) -> None:
    cls = run(POOLING, {**body, "encoding_format": "float"})
    assert cls.prompt_tokens > 0 and cls.max_tokens == 0 and cls.output_tokens == 0
    assert cls.new_body is None  # nothing to add: no max_tokens, no priority
    stripped = run(POOLING, {**body, "priority": -5})
    assert "priority" not in sent(stripped) and "max_tokens" not in sent(stripped)


def test_a_pooling_prompt_too_long_is_refused() -> None:
    with pytest.raises(RequestError) as e:
        run(POOLING, {"model": "e", "input": ["word " * 1000]})
    assert (e.value.status, e.value.code, e.value.param) == (413, "prompt_too_long", "input")


@pytest.mark.parametrize(
    ("endpoint", "body", "code", "param"),
    [
        (RESPONSES, {}, "missing_field", "input"),
        (RESPONSES, {"input": []}, "invalid_value", "input"),
        (RESPONSES, {"input": 5}, "invalid_type", "input"),
        (RESPONSES, {"input": "x", "instructions": 1}, "invalid_type", "instructions"),
        (RESPONSES, {"input": "x", "max_output_tokens": "9"}, "invalid_type", "max_output_tokens"),
        (RESPONSES, {"input": [{"role": 1}]}, "invalid_type", "input[0].role"),
        (MESSAGES, {"max_tokens": 5}, "missing_field", "messages"),
        (
            MESSAGES,
            {"messages": [{"role": "user", "content": 3}]},
            "invalid_type",
            "messages[0].content",
        ),
        (
            MESSAGES,
            {"messages": [{"role": "user", "content": "x"}], "system": 2},
            "invalid_type",
            "system",
        ),
        (
            MESSAGES,
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            "invalid_value",
            "max_tokens",
        ),
        (POOLING, {"model": "e"}, "missing_field", "input"),
    ],
)
def test_bad_requests_name_their_field(
    endpoint: Endpoint, body: dict[str, Any], code: str, param: str
) -> None:
    with pytest.raises(RequestError) as e:
        parse_body(endpoint, json.dumps(body).encode())
    assert (e.value.status, e.value.code, e.value.param) == (400, code, param)


def test_a_policy_admits_the_apis_it_names() -> None:
    bucket = "buckets: [{name: a, max_concurrency: 1, queue_timeout: 1s}]"
    assert policy_from_yaml(bucket).endpoints == (
        "chat",
        "completions",
        "responses",
        "messages",
        "pooling",
    )
    assert policy_from_yaml("endpoints: [chat]\n" + bucket).endpoints == ("chat",)
    with pytest.raises(PolicyError, match=r"endpoints\[1\]: 'audio' is not one of"):
        policy_from_yaml("endpoints: [chat, audio]\n" + bucket)


@pytest.mark.parametrize(
    ("outcome", "status", "kind"),
    [
        (Outcome.REJECTED_QUEUE_FULL, 429, "rate_limit_error"),
        (Outcome.EVICTED_TIMEOUT, 429, "rate_limit_error"),
        (Outcome.REJECTED_SHUTTING_DOWN, 503, "overloaded_error"),
    ],
)
def test_queue_refusals_in_anthropics_shape(outcome: Outcome, status: int, kind: str) -> None:
    rejection = queue_rejection(outcome, bucket="b", retry_after_s=3)
    shaped = json.loads(anthropic_error(rejection))
    assert rejection.status == status
    assert shaped["type"] == "error" and shaped["error"]["type"] == kind
    assert shaped["error"]["code"] == rejection.code
    assert shaped["error"]["message"] == json.loads(rejection.body)["error"]["message"]
