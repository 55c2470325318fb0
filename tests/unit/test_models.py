"""Buckets and route metadata match the body's ``model`` (issue 31): several models or LoRA
adapters behind one backend, each with buckets of its own (``match.models``), and a route that
sends each model to a bucket (route metadata ``model_buckets``)."""

from __future__ import annotations

import json

import pytest

from extproc.config.policy import PolicyError, policy_from_yaml, route_override_from_mapping
from extproc.request.classify import classify, token_counter
from extproc.request.endpoints import Endpoint
from extproc.request.parse import parse_body

POLICY = policy_from_yaml(
    """
pool: {max_concurrency: 8}
buckets:
  - name: small-model
    match: {models: [llama-8b, llama-8b-lora-support]}
    queue_timeout: 1s
  - name: big-interactive
    match: {models: [llama-70b], headers: {x-llm-class: interactive}}
    queue_timeout: 2s
  - name: rest
    queue_timeout: 10s
"""
)
COUNT = token_counter(POLICY.tokens)


def bucket_of(
    model: str | None, headers: dict[str, str] | None = None, route: object = None
) -> str:
    body: dict[str, object] = {"messages": [{"role": "user", "content": "hi"}]}
    if model is not None:
        body["model"] = model
    req = parse_body(Endpoint.CHAT, json.dumps(body).encode())
    return classify(POLICY, COUNT, headers or {}, req, route).bucket.name  # type: ignore[arg-type]


def test_buckets_match_the_bodys_model() -> None:
    assert bucket_of("llama-8b") == "small-model"
    assert bucket_of("llama-8b-lora-support") == "small-model"
    assert bucket_of("llama-70b", {"x-llm-class": "interactive"}) == "big-interactive"
    assert bucket_of("llama-70b") == "rest"  # the header is ANDed
    assert bucket_of("Llama-8B") == "rest"  # exact, as vLLM names its models
    assert bucket_of(None) == "rest"
    assert not POLICY.buckets[0].match.is_catch_all
    assert POLICY.to_dict()["buckets"][0]["match"] == {
        "models": ["llama-8b", "llama-8b-lora-support"]
    }


def test_route_metadata_sends_each_model_to_a_bucket() -> None:
    route = route_override_from_mapping(
        {"bucket": "rest", "model_buckets": {"llama-8b": "big-interactive"}}, POLICY
    )
    assert bucket_of("llama-8b", route=route) == "big-interactive"  # before `bucket`
    assert bucket_of("llama-70b", route=route) == "rest"  # `bucket` for the others
    alone = route_override_from_mapping({"model_buckets": {"llama-70b": "small-model"}}, POLICY)
    assert bucket_of("llama-70b", route=alone) == "small-model"
    assert bucket_of("llama-8b", route=alone) == "small-model"  # not listed: matching


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"model_buckets": {"m": "nope"}}, "model_buckets['m']: 'nope' is not a bucket"),
        (
            {"bucket": "rest", "max_concurrency": 2, "model_buckets": {"m": "rest"}},
            "model_buckets: not with max_concurrency/max_queue",
        ),
        ({"model_buckets": {"m": 3}}, "model_buckets"),
    ],
)
def test_bad_model_buckets_are_refused(metadata: dict[str, object], message: str) -> None:
    with pytest.raises(PolicyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        route_override_from_mapping(metadata, POLICY)
