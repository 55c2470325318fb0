"""Parsing and classification, table-driven, including every class of bad input."""

from __future__ import annotations

import json
import math
import string
from pathlib import Path

import pytest

from extproc.config.policy import policy_from_yaml
from extproc.outcome import RequestError
from extproc.request.classify import MaxTokensAction, classify, token_counter
from extproc.request.endpoints import canonical, refused_api
from extproc.request.parse import Endpoint, check_content_headers, endpoint_for_path, parse_body

POLICY = policy_from_yaml(
    """
limits: {max_prompt_tokens: 1000, default_max_tokens: 64, max_output_tokens: 512}
buckets:
  - name: interactive
    match: {headers: {x-llm-class: interactive}, max_prompt_tokens: 200, max_tokens: 128}
    max_concurrency: 2
    queue_timeout: 1s
    max_queue: 5
  - name: short
    match: {max_prompt_tokens: 100}
    max_concurrency: 2
    queue_timeout: 1s
    max_queue: 5
  - name: batch
    max_concurrency: 1
    queue_timeout: 10s
    max_queue: 5
"""
)
COUNT = token_counter(POLICY.tokens)
CHAT = Endpoint.CHAT
COMP = Endpoint.COMPLETIONS


def chat(**fields: object) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], **fields}
    return json.dumps(body).encode()


def run(endpoint: Endpoint, raw: bytes, headers: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return classify(POLICY, COUNT, headers or {}, parse_body(endpoint, raw))


@pytest.mark.parametrize(
    "method,path,expected",
    [
        ("POST", "/v1/chat/completions", CHAT),
        ("POST", "/v1/completions", COMP),
        ("POST", "/v1/completions?x=1", COMP),
        ("GET", "/v1/chat/completions", None),
        ("POST", "/v1/models", None),
        ("POST", "/v1/chat/completions/extra", None),
        ("GET", "/health", None),
        # Spellings a server behind Envoy may take for the same path (extproc.request.endpoints)
        ("POST", "/v1/%63hat/completions", CHAT),
        ("POST", "/v1/chat%2Fcompletions", CHAT),
        ("POST", "/v1/chat%252Fcompletions", CHAT),  # encoded twice
        ("POST", "//v1//chat/completions", CHAT),
        ("POST", "/v1/./chat/completions", CHAT),
        ("POST", "/v1/models/../chat/completions", CHAT),
        ("POST", "/../../v1/completions", COMP),
        ("POST", "/v1/chat/completions/", CHAT),
        ("POST", "/V1/Chat/Completions", CHAT),
        ("POST", "/v1\\completions", COMP),
        ("POST", "/v1/completions#x", COMP),
        ("POST", "/v1/responses", Endpoint.RESPONSES),
        ("GET", "/v1/responses", None),  # reads a stored response: no generation
        ("POST", "/v1/messages", Endpoint.MESSAGES),
        ("POST", "//v1/%65mbeddings/", Endpoint.POOLING),
        ("POST", "/rerank", Endpoint.POOLING),
        ("POST", "/v2/rerank", Endpoint.POOLING),
        ("POST", "/score", Endpoint.POOLING),
        ("POST", "/v1/chat/completions/..", None),
        ("POST", "/v2/chat/completions", None),
    ],
)
def test_endpoints(method: str, path: str, expected: Endpoint | None) -> None:
    assert endpoint_for_path(method, path) == expected


@pytest.mark.parametrize(
    "method,path,expected",
    [
        ("POST", "/invocations", "/invocations"),
        ("POST", "/v1/audio/transcriptions", "/v1/audio/transcriptions"),
        ("POST", "//v1/audio/%74ranslations/", "/v1/audio/translations"),
        ("GET", "/invocations", None),
        ("POST", "/v1/chat/completions", None),  # admitted, not refused
        ("POST", "/v1/responses", None),
        ("POST", "/v1/embeddings", None),
        ("POST", "/tokenize", None),
        ("POST", "/v1/other", None),
    ],
)
def test_apis_the_sidecar_refuses(method: str, path: str, expected: str | None) -> None:
    assert refused_api(method, path) == expected


def test_canonical_is_bounded_on_hostile_paths() -> None:
    """Linear in the path: a long run of dot segments or of nested encodings costs little."""
    assert canonical("/.." * 10_000 + "/v1/completions") == "/v1/completions"
    assert canonical("/v1/" + "%25" * 5000 + "63").startswith("/v1/")
    assert canonical("") == "/" and canonical("?") == "/"


# Every bad input: (endpoint, body, status, code, param)
BAD = [
    (CHAT, b"", 400, "empty_body", None),
    (CHAT, b"{", 400, "invalid_json", None),
    (CHAT, b'{"messages": [}', 400, "invalid_json", None),
    (CHAT, b"\xff\xfe{}", 400, "invalid_encoding", None),
    (CHAT, b'{"a": "\xc3"}', 400, "invalid_encoding", None),
    (CHAT, b"[1,2]", 400, "invalid_body", None),
    (CHAT, b'"text"', 400, "invalid_body", None),
    (CHAT, b"null", 400, "invalid_body", None),
    (CHAT, b'{"max_tokens": NaN, "messages": []}', 400, "invalid_json", None),
    (CHAT, b'{"max_tokens": Infinity}', 400, "invalid_json", None),
    # Beyond the double range: Python reads these as infinity, which a rewrite would emit.
    (CHAT, b'{"temperature": 1e400, "messages": [{"role":"user"}]}', 400, "invalid_json", None),
    (CHAT, b'{"temperature": -1E+999, "messages": [{"role":"user"}]}', 400, "invalid_json", None),
    (
        CHAT,
        b'{"max_tokens": 1, "max_tokens": 99999, "messages": [{"role":"user"}]}',
        400,
        "duplicate_key",
        "max_tokens",
    ),
    (CHAT, b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json", None),
    (CHAT, b'{"max_tokens": ' + b"9" * 5000 + b"}", 400, "invalid_json", None),
    (CHAT, b'{"model": "m"}', 400, "missing_field", "messages"),
    (CHAT, b'{"messages": "hi"}', 400, "invalid_type", "messages"),
    (CHAT, b'{"messages": []}', 400, "invalid_value", "messages"),
    (CHAT, b'{"messages": [1]}', 400, "invalid_type", "messages[0]"),
    (CHAT, b'{"messages": [{"content": "x"}]}', 400, "invalid_type", "messages[0].role"),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": 5}]}',
        400,
        "invalid_type",
        "messages[0].content",
    ),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": [{"text": "x"}]}]}',
        400,
        "invalid_type",
        "messages[0].content[0].type",
    ),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}',
        400,
        "invalid_type",
        "messages[0].content[0].text",
    ),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": ["x"]}]}',
        400,
        "invalid_type",
        "messages[0].content[0]",
    ),
    (CHAT, chat(max_tokens="100"), 400, "invalid_type", "max_tokens"),
    (CHAT, chat(max_tokens=10.5), 400, "invalid_type", "max_tokens"),
    (CHAT, chat(max_tokens=100.0), 400, "invalid_type", "max_tokens"),
    (CHAT, chat(max_tokens=True), 400, "invalid_type", "max_tokens"),
    (CHAT, chat(max_tokens=[1]), 400, "invalid_type", "max_tokens"),
    (CHAT, chat(max_tokens=0), 400, "invalid_value", "max_tokens"),
    (CHAT, chat(max_tokens=-5), 400, "invalid_value", "max_tokens"),
    (CHAT, chat(max_completion_tokens=-1), 400, "invalid_value", "max_completion_tokens"),
    (CHAT, chat(max_tokens=2**31), 400, "invalid_value", "max_tokens"),
    (CHAT, chat(max_tokens=10**30), 400, "invalid_value", "max_tokens"),
    (CHAT, chat(stream="yes"), 400, "invalid_type", "stream"),
    (CHAT, chat(model=7), 400, "invalid_type", "model"),
    (CHAT, chat(tools={"a": 1}), 400, "invalid_type", "tools"),
    (
        CHAT,
        b'{"messages": [{"role": "user", "tool_calls": 1}]}',
        400,
        "invalid_type",
        "messages[0].tool_calls",
    ),
    (COMP, b'{"model": "m"}', 400, "missing_field", "prompt"),
    (COMP, b'{"prompt": null}', 400, "missing_field", "prompt"),
    (COMP, b'{"prompt": 5}', 400, "invalid_type", "prompt"),
    (COMP, b'{"prompt": ["a", 1]}', 400, "invalid_type", "prompt"),
    (COMP, b'{"prompt": [1, -2]}', 400, "invalid_type", "prompt"),
    (COMP, b'{"prompt": [[1], ["a"]]}', 400, "invalid_type", "prompt"),
    (
        CHAT,
        json.dumps({"messages": [{"role": "user", "content": "x" * 4004}]}).encode(),
        413,
        "prompt_too_long",
        "messages",
    ),
    (COMP, json.dumps({"prompt": list(range(1001))}).encode(), 413, "prompt_too_long", "prompt"),
]


@pytest.mark.parametrize("endpoint,raw,status,code,param", BAD)
def test_bad_input_gets_a_precise_error(
    endpoint: Endpoint, raw: bytes, status: int, code: str, param: str | None
) -> None:
    with pytest.raises(RequestError) as info:
        run(endpoint, raw)
    e = info.value
    assert (e.status, e.code, e.param) == (status, code, param)
    body = json.loads(e.rejection().body)
    assert body["error"]["code"] == code
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"]


@pytest.mark.parametrize(
    "ctype,cenc,code",
    [
        ("text/plain", None, "unsupported_media_type"),
        ("application/x-www-form-urlencoded", None, "unsupported_media_type"),
        ("application/json", "gzip", "unsupported_content_encoding"),
        (None, "br", "unsupported_content_encoding"),
    ],
)
def test_unreadable_content_headers(ctype: str | None, cenc: str | None, code: str) -> None:
    with pytest.raises(RequestError) as info:
        check_content_headers(ctype, cenc)
    assert (info.value.status, info.value.code) == (415, code)


@pytest.mark.parametrize(
    "ctype,cenc",
    [
        (None, None),
        ("application/json", None),
        ("application/json; charset=utf-8", "identity"),
        ("Application/JSON", None),
        ("application/vnd.api+json", None),
    ],
)
def test_readable_content_headers(ctype: str | None, cenc: str | None) -> None:
    check_content_headers(ctype, cenc)


def test_prompt_estimate_counts_text_parts_tools_and_fixed_costs() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "a" * 40},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "b" * 40},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64," + "A" * 5000},
                    },
                    {"type": "input_audio", "input_audio": {"data": "x"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    parsed = parse_body(CHAT, json.dumps(body).encode())
    assert parsed.messages == 3 and parsed.non_text_parts == 2
    text_chars = sum(map(len, parsed.texts))
    tools_json = json.dumps(body["tools"], separators=(",", ":"))
    calls_json = json.dumps(body["messages"][2]["tool_calls"], separators=(",", ":"))
    assert text_chars == 40 + 40 + len(tools_json) + len(calls_json)
    policy = policy_from_yaml(
        "limits: {max_prompt_tokens: 100000}\n"
        "buckets: [{name: a, max_concurrency: 1, queue_timeout: 1s}]"
    )
    cls = classify(policy, token_counter(policy.tokens), {}, parsed)
    # ceil(letters and spaces / 4 + digits and punctuation) + 2 non-text parts * 512 +
    # 3 messages * 3 (the texts are ASCII: the tools' JSON, the tool call's id "1")
    assert all(t.isascii() for t in parsed.texts)
    heavy = sum(ch in string.digits + string.punctuation for t in parsed.texts for ch in t)
    assert heavy > 1
    expected = math.ceil((text_chars - heavy) / 4 + heavy) + 2 * 512 + 3 * 3
    assert cls.prompt_tokens == expected


def test_completions_prompts() -> None:
    assert parse_body(COMP, b'{"prompt": "abcd"}').texts == ("abcd",)
    assert parse_body(COMP, b'{"prompt": ["ab", "cd"]}').texts == ("ab", "cd")
    assert parse_body(COMP, b'{"prompt": [1, 2, 3]}').token_ids == 3
    assert parse_body(COMP, b'{"prompt": [[1, 2], [3]]}').token_ids == 3
    with pytest.raises(RequestError, match="'prompt' must not be empty"):  # nothing to answer
        parse_body(COMP, b'{"prompt": []}')


def test_missing_max_tokens_is_defaulted_and_body_rewritten() -> None:
    cls = run(CHAT, chat())
    assert (cls.max_tokens, cls.max_tokens_action) == (64, MaxTokensAction.DEFAULTED)
    assert cls.new_body is not None
    assert json.loads(cls.new_body) == {**json.loads(chat()), "max_tokens": 64}


def test_null_max_tokens_counts_as_absent() -> None:
    cls = run(CHAT, chat(max_tokens=None))
    assert cls.max_tokens_action is MaxTokensAction.DEFAULTED
    assert cls.new_body is not None and json.loads(cls.new_body)["max_tokens"] == 64
    # Replaced, not appended: a second "max_tokens" would be refused by our own parser.
    assert parse_body(CHAT, cls.new_body).requested_max_tokens == 64


def test_defaulted_max_tokens_is_appended_to_the_clients_bytes() -> None:
    raw = b'{"messages": [{"role": "user", "content": "h\\u00e9"}], "temperature": 1.50}\n '
    cls = run(CHAT, raw)
    assert cls.new_body == raw.rstrip()[:-1] + b',"max_tokens":64}'
    # With a BOM the body is re-serialised instead (and loses the BOM).
    cls = run(CHAT, b"\xef\xbb\xbf" + raw)
    assert cls.new_body is not None and not cls.new_body.startswith(b"\xef")
    assert json.loads(cls.new_body)["max_tokens"] == 64


def test_excess_is_clamped_keeping_every_other_field() -> None:
    raw = chat(
        max_tokens=2**31 - 1, temperature=0.7, extra={"nested": [1, 2.5, "é", None]}, stream=True
    )
    cls = run(CHAT, raw)
    assert (cls.max_tokens, cls.max_tokens_action) == (512, MaxTokensAction.CLAMPED)
    assert cls.new_body is not None
    assert json.loads(cls.new_body) == {**json.loads(raw), "max_tokens": 512}


def test_max_completion_tokens_wins_and_both_keys_are_bounded() -> None:
    cls = run(CHAT, chat(max_tokens=5000, max_completion_tokens=100))
    assert cls.max_tokens == 100
    assert cls.new_body is not None
    body = json.loads(cls.new_body)
    assert body["max_tokens"] == 100 and body["max_completion_tokens"] == 100
    cls = run(CHAT, chat(max_completion_tokens=9999))
    assert cls.new_body is not None
    body = json.loads(cls.new_body)
    assert body["max_completion_tokens"] == 512 and "max_tokens" not in body


def test_body_within_limits_is_not_rewritten() -> None:
    cls = run(CHAT, chat(max_tokens=100))
    assert cls.new_body is None and cls.max_tokens_action is MaxTokensAction.KEPT


def test_reject_mode_refuses_excess() -> None:
    policy = policy_from_yaml(
        "limits: {max_output_tokens: 10, default_max_tokens: 5, on_excess: reject}\n"
        "buckets: [{name: a, max_concurrency: 1, queue_timeout: 1s}]"
    )
    with pytest.raises(RequestError) as info:
        classify(policy, token_counter(policy.tokens), {}, parse_body(CHAT, chat(max_tokens=11)))
    assert (info.value.status, info.value.code, info.value.param) == (
        400,
        "max_tokens_too_large",
        "max_tokens",
    )


def test_unicode_survives_rewrite() -> None:
    raw = '{"messages":[{"role":"user","content":"héllo \\ud83d\\ude00 \\ud800 日本"}]}'.encode()
    cls = run(CHAT, raw)
    assert cls.new_body is not None
    assert json.loads(cls.new_body)["messages"] == json.loads(raw)["messages"]


def test_bom_is_tolerated() -> None:
    assert run(CHAT, b"\xef\xbb\xbf" + chat(max_tokens=10)).max_tokens == 10


@pytest.mark.parametrize(
    "headers,body,bucket",
    [
        ({"x-llm-class": "interactive"}, chat(max_tokens=100), "interactive"),
        ({"x-llm-class": "interactive"}, chat(max_tokens=129), "short"),  # max_tokens too big
        (
            {"x-llm-class": "interactive"},
            json.dumps({"messages": [{"role": "user", "content": "x" * 900}]}).encode(),
            "batch",
        ),
        ({"x-llm-class": "Interactive"}, chat(max_tokens=100), "short"),  # exact values
        ({}, chat(max_tokens=500), "short"),
        ({}, json.dumps({"messages": [{"role": "user", "content": "x" * 800}]}).encode(), "batch"),
    ],
)
def test_first_matching_bucket_wins(headers: dict[str, str], body: bytes, bucket: str) -> None:
    assert run(CHAT, body, headers).bucket.name == bucket


def test_exact_counts_with_a_local_tokenizer_json(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    policy = policy_from_yaml(
        f"tokens: {{tokenizer: '{path}', message_overhead_tokens: 0}}\n"
        "buckets: [{name: a, max_concurrency: 1, queue_timeout: 1s}]"
    )
    count = token_counter(policy.tokens)
    assert count(("hello world hello", "zzz")) == 4
    assert count(()) == 0
    raw = json.dumps({"messages": [{"role": "user", "content": "hello world"}]}).encode()
    assert classify(policy, count, {}, parse_body(CHAT, raw)).prompt_tokens == 2


PRIORITY_POLICY = policy_from_yaml(
    """
limits: {default_max_tokens: 64, max_output_tokens: 512}
pool: {max_concurrency: 4}
buckets:
  - {name: urgent, match: {headers: {x-llm-class: interactive}}, vllm_priority: 0,
     queue_timeout: 1s, max_queue: 5}
  - {name: rest, vllm_priority: 7, queue_timeout: 1s, max_queue: 5}
"""
)


@pytest.mark.parametrize(
    "headers,body,priority",
    [
        ({}, chat(max_tokens=10), 7),  # only priority appended
        ({}, chat(), 7),  # max_tokens and priority appended
        ({}, chat(max_tokens=10, priority=-100), 7),  # the client's own value is replaced
        ({"x-llm-class": "interactive"}, chat(max_tokens=10, priority=3), 0),
    ],
)
def test_vllm_priority_is_written_into_the_body(
    headers: dict[str, str], body: bytes, priority: int
) -> None:
    cls = classify(
        PRIORITY_POLICY, token_counter(PRIORITY_POLICY.tokens), headers, parse_body(CHAT, body)
    )
    assert cls.new_body is not None
    sent = json.loads(cls.new_body)
    assert sent["priority"] == priority
    assert sent["max_tokens"] == cls.max_tokens
    assert sent["messages"] == json.loads(body)["messages"]


def test_vllm_priority_already_right_leaves_the_body_alone() -> None:
    body = chat(max_tokens=10, priority=7)
    cls = classify(
        PRIORITY_POLICY, token_counter(PRIORITY_POLICY.tokens), {}, parse_body(CHAT, body)
    )
    assert cls.new_body is None


def test_a_number_near_the_double_range_is_kept_and_a_rewrite_stays_json() -> None:
    raw = b'{"temperature": 1e308, "top_p": 1e-400, "messages": [{"role":"user","content":"x"}]}'
    cls = run(CHAT, raw)
    assert cls.new_body is not None  # max_tokens defaulted
    sent = json.loads(cls.new_body, parse_constant=lambda c: pytest.fail(f"{c} in the body"))
    assert sent["temperature"] == 1e308


def test_out_of_range_numbers_are_named_in_the_error() -> None:
    with pytest.raises(RequestError, match="1e400 is out of range"):
        parse_body(CHAT, b'{"temperature": 1e400, "messages": [{"role":"user"}]}')


@pytest.mark.parametrize(
    "body",
    [
        chat(max_tokens=10, priority=-2147483648),  # tokens kept: only the key goes
        chat(priority=-5),  # max_tokens defaulted as well
        chat(max_tokens=100000, priority=0),  # clamped as well
        chat(max_tokens=10, priority="high"),  # whatever its type
        chat(max_tokens=10, priority=None),
    ],
)
def test_a_bucket_without_vllm_priority_removes_the_clients(body: bytes) -> None:
    """vLLM orders its queue by `priority` (--scheduling-policy priority): only the policy may
    set it, so a client cannot jump the queue in a bucket that sets none."""
    cls = run(CHAT, body)
    assert cls.new_body is not None
    sent = json.loads(cls.new_body)
    assert "priority" not in sent
    assert sent["max_tokens"] == cls.max_tokens
    assert sent["messages"] == json.loads(body)["messages"]


def test_a_body_without_priority_is_left_alone_by_a_bucket_without_vllm_priority() -> None:
    assert run(CHAT, chat(max_tokens=10)).new_body is None


@pytest.mark.parametrize(
    "text,tokens",
    [
        ("abcd" * 10, 10),  # ASCII letters: chars_per_token
        ("a b\tc\nd", 2),  # ASCII whitespace too: 7 / 4
        ("2024-12-01", 10),  # digits and punctuation a token each
        ("def f(x):", 5),  # 6 letters and spaces / 4 + 3 punctuation
        ("é" * 10, 12),  # 2-byte characters: 1.2 each
        ("准入控制", 8),  # 3-byte: 2 each
        ("∑∫√", 6),
        ("😀" * 6000, 24000),  # 4-byte: 4 each (issue 22: was 1,500)
        ("a\ud800", 3),  # a lone surrogate, as a JSON escape allows: 3 bytes, 2 tokens + 1/4
        ("hi 😀 Привет 你好 42", 19),  # 6 ASCII / 4 + 2 digits + 4 + 6 x 1.2 + 2 x 2
    ],
)
def test_the_fallback_estimate_charges_characters_by_what_they_are(text: str, tokens: int) -> None:
    assert token_counter(POLICY.tokens)((text,)) == tokens
