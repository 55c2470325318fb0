"""A request's cost is all of its output sequences (issue 31): ``n``, ``best_of`` and the
prompts of a batched ``/v1/completions`` each run to ``max_tokens``. Parsed into
``ParsedRequest.sequences``, bounded by ``limits.max_sequences`` (400 ``too_many_sequences``),
and multiplied into ``Classification.output_tokens``, which the bucket match, the token bound
and the fair order's charge read (``extproc.service``; the token bound through the real Envoy:
tests/e2e/test_sequences.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.config.policy import PolicyError, policy_from_yaml
from extproc.outcome import RequestError
from extproc.request.classify import classify, token_counter
from extproc.request.parse import Endpoint, parse_body

POLICY = policy_from_yaml(
    """
limits: {default_max_tokens: 64, max_output_tokens: 512, max_sequences: 8}
buckets:
  - name: short
    match: {max_tokens: 512}
    max_concurrency: 2
    queue_timeout: 1s
  - name: long
    max_concurrency: 1
    queue_timeout: 10s
"""
)
COUNT = token_counter(POLICY.tokens)
CHAT, COMP = Endpoint.CHAT, Endpoint.COMPLETIONS


def parsed(endpoint: Endpoint, **body: Any) -> Any:
    if endpoint is CHAT:
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    else:
        body.setdefault("prompt", "hi")
    return parse_body(endpoint, json.dumps(body).encode())


@pytest.mark.parametrize(
    ("endpoint", "body", "sequences"),
    [
        (CHAT, {}, 1),
        (CHAT, {"n": 4}, 4),
        (CHAT, {"n": None}, 1),
        (COMP, {"n": 2, "best_of": 6}, 6),  # vLLM generates best_of, returns n
        (COMP, {"best_of": 3}, 3),
        (COMP, {"prompt": ["a", "b", "c"]}, 3),  # a batch: vLLM answers each prompt
        (COMP, {"prompt": [[1, 2], [3], [4, 5, 6]], "n": 2}, 6),
        (COMP, {"prompt": [1, 2, 3]}, 1),  # one prompt of token ids
    ],
)
def test_sequences_are_every_output_a_request_asks_for(
    endpoint: Endpoint, body: dict[str, Any], sequences: int
) -> None:
    assert parsed(endpoint, **body).sequences == sequences


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"n": "4"}, "invalid_type", "n"),
        ({"n": 1.5}, "invalid_type", "n"),
        ({"n": True}, "invalid_type", "n"),
        ({"n": 0}, "invalid_value", "n"),
        ({"best_of": -2}, "invalid_value", "best_of"),
        ({"prompt": []}, "invalid_value", "prompt"),
    ],
)
def test_bad_sequence_counts_are_refused(body: dict[str, Any], code: str, param: str) -> None:
    with pytest.raises(RequestError) as e:
        parsed(COMP, **body)
    assert (e.value.status, e.value.code, e.value.param) == (400, code, param)


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        (CHAT, {"n": 64}, "n"),
        (COMP, {"n": 2, "best_of": 64}, "best_of"),
        (COMP, {"prompt": ["x"] * 50}, "prompt"),
        (COMP, {"prompt": ["x"] * 3, "n": 3}, "n"),
    ],
)
def test_more_sequences_than_the_policy_allows_get_400(
    endpoint: Endpoint, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(RequestError) as e:
        classify(POLICY, COUNT, {}, parsed(endpoint, **body))
    assert (e.value.status, e.value.code, e.value.param) == (400, "too_many_sequences", param)
    assert "at most 8" in e.value.message


def test_output_tokens_count_every_sequence_and_choose_the_bucket() -> None:
    one = classify(POLICY, COUNT, {}, parsed(CHAT, max_tokens=200))
    assert (one.max_tokens, one.sequences, one.output_tokens, one.bucket.name) == (
        200,
        1,
        200,
        "short",
    )
    # max_tokens is per sequence (clamped as usual); four of them are 800 tokens: long.
    four = classify(POLICY, COUNT, {}, parsed(CHAT, max_tokens=200, n=4))
    assert (four.max_tokens, four.output_tokens, four.bucket.name) == (200, 800, "long")
    assert four.new_body is None  # n is the client's: nothing to rewrite
    batch = classify(POLICY, COUNT, {}, parsed(COMP, prompt=["a", "b"], max_tokens=9000))
    assert (batch.max_tokens, batch.output_tokens) == (512, 1024)  # clamped, then counted


def test_max_sequences_is_a_policy_key() -> None:
    bucket = "buckets: [{name: a, max_concurrency: 1, queue_timeout: 1s}]"
    assert policy_from_yaml(bucket).limits.max_sequences == 16
    with pytest.raises(PolicyError, match=r"limits\.max_sequences: must be at least 1"):
        policy_from_yaml("limits: {max_sequences: 0}\n" + bucket)
