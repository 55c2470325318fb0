"""Property-based tests of parsing and classification (hypothesis).

1. Any bytes at all give a ParsedRequest or a RequestError with a 4xx status; nothing else
   escapes (no crash reaches the gRPC stream).
2. Rewriting changes only what it means to: every other field the client sent is kept, equal.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.config.policy import policy_from_yaml
from extproc.outcome import RequestError
from extproc.request.classify import classify, token_counter
from extproc.request.parse import MAX_TOKENS_KEYS, Endpoint, parse_body

POLICY = policy_from_yaml(
    """
limits: {max_prompt_tokens: 100000, default_max_tokens: 64, max_output_tokens: 512}
buckets:
  - {name: small, match: {max_prompt_tokens: 50}, max_concurrency: 1, queue_timeout: 1s}
  - {name: rest, max_concurrency: 1, queue_timeout: 1s}
"""
)
COUNT = token_counter(POLICY.tokens)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


def outcome(endpoint: Endpoint, raw: bytes) -> object:
    try:
        parsed = parse_body(endpoint, raw)
        return classify(POLICY, COUNT, {}, parsed)
    except RequestError as e:
        assert 400 <= e.status < 500
        assert e.code and e.message
        json.loads(e.rejection().body)  # the error body itself is valid JSON
        return e


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300), st.sampled_from(list(Endpoint)))
def test_any_bytes_give_a_request_or_a_4xx(raw: bytes, endpoint: Endpoint) -> None:
    outcome(endpoint, raw)


@pytest.mark.slow  # 400 examples: seconds
@settings(max_examples=400, deadline=None)
@given(json_values, st.sampled_from(list(Endpoint)))
def test_any_json_gives_a_request_or_a_4xx(value: Any, endpoint: Endpoint) -> None:
    outcome(endpoint, json.dumps(value).encode())


message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant"]),
        "content": st.text(max_size=40) | st.none(),
    },
)
extra_fields = st.dictionaries(
    st.text(min_size=1, max_size=10).filter(
        # Not the fields the parser reads and type-checks (``tools`` and ``functions`` must be
        # arrays: tests/unit/test_parse.py; ``n`` and ``best_of`` integers:
        # tests/unit/test_sequences.py); hypothesis found ``{"functions": false}``, ``{"n": []}``.
        lambda k: (
            k
            not in (
                "messages",
                *MAX_TOKENS_KEYS,
                "stream",
                "model",
                "tools",
                "functions",
                "n",
                "best_of",
            )
        )
    ),
    json_values,
    max_size=5,
)
max_tokens = st.none() | st.integers(1, 2**31 - 1)


@pytest.mark.slow  # 300 examples: seconds
@settings(max_examples=300, deadline=None)
@given(st.lists(message, min_size=1, max_size=4), extra_fields, max_tokens, max_tokens)
def test_rewrite_keeps_every_other_field(
    messages: list[dict[str, Any]], extra: dict[str, Any], mt: int | None, mct: int | None
) -> None:
    body: dict[str, Any] = {"messages": messages, **extra}
    if mt is not None:
        body["max_tokens"] = mt
    if mct is not None:
        body["max_completion_tokens"] = mct
    cls = classify(POLICY, COUNT, {}, parse_body(Endpoint.CHAT, json.dumps(body).encode()))
    assert 1 <= cls.max_tokens <= 512
    if cls.new_body is None:
        assert all(body.get(k) in (None, cls.max_tokens) for k in MAX_TOKENS_KEYS)
        return
    sent = json.loads(cls.new_body)
    # What the backend gets parses with our own strict parser: no duplicate key slipped in.
    assert parse_body(Endpoint.CHAT, cls.new_body).requested_max_tokens == cls.max_tokens
    for key, value in body.items():
        if key in MAX_TOKENS_KEYS:
            assert sent[key] == cls.max_tokens
        else:
            assert sent[key] == value
    assert set(sent) - set(body) <= {"max_tokens"}
    if mt is None and mct is None:
        assert sent["max_tokens"] == 64
