"""Hostile and odd requests, each with the status and error code it must get through Envoy.

Used by tests/e2e/test_corpus.py against the real Envoy with CORPUS_POLICY. A case is sent as
raw HTTP/1.1 bytes, so nothing normalises it on the way. ``code`` is the ``error.code`` of the
JSON body; None means the request reached the backend (the test backend echoes it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

CORPUS_POLICY = """
tokens: {non_text_part_tokens: 100}
limits: {max_prompt_tokens: 500, default_max_tokens: 50, max_output_tokens: 100}
buckets:
  - {name: all, max_concurrency: 8, queue_timeout: 5s, max_queue: 100}
"""

# The buffer filter's max_request_bytes (and the listener's per_connection_buffer_limit_bytes)
# in envoy/envoy.yaml: above it Envoy answers 413 body_too_large itself.
ENVOY_BUFFER_LIMIT = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    name: str
    body: bytes
    status: int
    code: str | None = None
    path: str = "/v1/chat/completions"
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "application/json"})
    # For admitted requests: the max_tokens the backend must see (None: not checked).
    max_tokens: int | None = None
    chunked: bool = False


def chat(content: object = "hi", **fields: object) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": content}], **fields}
    ).encode()


def raw_chat(max_tokens_literal: str) -> bytes:
    return (
        b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":'
        + max_tokens_literal.encode()
        + b"}"
    )


def _cases() -> list[Case]:
    c: list[Case] = []

    def bad(name: str, body: bytes, code: str, status: int = 400, **kw: object) -> None:
        c.append(Case(name=name, body=body, status=status, code=code, **kw))  # type: ignore[arg-type]

    def ok(name: str, body: bytes, max_tokens: int | None = None, **kw: object) -> None:
        c.append(Case(name=name, body=body, status=200, max_tokens=max_tokens, **kw))  # type: ignore[arg-type]

    # Malformed and non-object JSON
    bad("open brace", b"{", "invalid_json")
    bad("truncated", b'{"messages": [{"role": "user", "content": "hi"', "invalid_json")
    bad("single quotes", b"{'messages': []}", "invalid_json")
    bad("trailing comma", b'{"messages": [],}', "invalid_json")
    bad("extra data", b'{"messages": []} {"x": 1}', "invalid_json")
    bad("whitespace only", b"   \n\t ", "invalid_json")
    bad("empty body", b"", "empty_body")
    bad("null", b"null", "invalid_body")
    bad("array", b"[]", "invalid_body")
    bad("number", b"123", "invalid_body")
    bad("string", b'"hello"', "invalid_body")
    bad("true", b"true", "invalid_body")
    bad("duplicate messages", b'{"messages": [], "messages": []}', "duplicate_key")
    bad("duplicate max_tokens", raw_chat('1, "max_tokens": 99999'), "duplicate_key")
    bad("array bomb", b"[" * 100_000 + b"]" * 100_000, "invalid_json")
    bad("object bomb", b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "invalid_json")
    bad("NaN", raw_chat("NaN"), "invalid_json")
    bad("Infinity", raw_chat("Infinity"), "invalid_json")
    bad("-Infinity", raw_chat("-Infinity"), "invalid_json")
    # max_tokens of every wrong kind
    bad("max_tokens string", chat(max_tokens="100"), "invalid_type")
    bad("max_tokens fraction", chat(max_tokens=100.5), "invalid_type")
    bad("max_tokens float", raw_chat("100.0"), "invalid_type")
    bad("max_tokens bool", chat(max_tokens=True), "invalid_type")
    bad("max_tokens list", chat(max_tokens=[1]), "invalid_type")
    bad("max_tokens object", chat(max_tokens={"n": 1}), "invalid_type")
    bad("max_tokens negative", chat(max_tokens=-1), "invalid_value")
    bad("max_tokens zero", chat(max_tokens=0), "invalid_value")
    bad("max_tokens 2^31", chat(max_tokens=2**31), "invalid_value")
    # Beyond the double range: refused at parse, before any field is read (it would be Infinity).
    bad("max_tokens 1e400", raw_chat("1e400"), "invalid_json")
    bad("max_tokens 5000 digits", raw_chat("9" * 5000), "invalid_json")
    bad("max_completion_tokens string", chat(max_completion_tokens="x"), "invalid_type")
    ok("max_tokens null", chat(max_tokens=None), max_tokens=50)
    ok("max_tokens absent", chat(), max_tokens=50)
    ok("max_tokens int32 max", chat(max_tokens=2**31 - 1), max_tokens=100)
    ok("max_tokens within", chat(max_tokens=7), max_tokens=7)
    ok("both max keys", chat(max_tokens=5, max_completion_tokens=500), max_tokens=100)
    # messages of the wrong shape
    bad("no messages", b'{"model": "m"}', "missing_field")
    bad("messages string", b'{"messages": "hi"}', "invalid_type")
    bad("messages object", b'{"messages": {"role": "user"}}', "invalid_type")
    bad("messages empty", b'{"messages": []}', "invalid_value")
    bad("message null", b'{"messages": [null]}', "invalid_type")
    bad("role number", b'{"messages": [{"role": 1, "content": "x"}]}', "invalid_type")
    bad("content number", chat(5), "invalid_type")
    bad("content object", chat({"text": "x"}), "invalid_type")
    bad("part without type", chat([{"text": "x"}]), "invalid_type")
    bad("text part not string", chat([{"type": "text", "text": 5}]), "invalid_type")
    bad("part not object", chat(["x"]), "invalid_type")
    bad(
        "tool_calls object",
        b'{"messages": [{"role": "assistant", "tool_calls": {}}]}',
        "invalid_type",
    )
    bad("tools object", chat(tools={"type": "function"}), "invalid_type")
    bad("stream string", chat(stream="yes"), "invalid_type")
    bad(
        "model number",
        b'{"model": 5, "messages": [{"role": "user", "content": "x"}]}',
        "invalid_type",
    )
    ok("unknown part type", chat([{"type": "hologram", "data": "x"}]), max_tokens=50)
    ok("image part", chat([{"type": "image_url", "image_url": {"url": "data:,x"}}]))
    ok("content null", b'{"messages": [{"role": "assistant", "content": null}]}')
    # Encodings
    bad(
        "invalid utf-8",
        b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
        "invalid_encoding",
    )
    bad("utf-16 with bom", '{"messages": []}'.encode("utf-16"), "invalid_encoding")
    bad(
        "overlong utf-8",
        b'{"messages": [{"role": "user", "content": "\xc0\xaf"}]}',
        "invalid_encoding",
    )
    bad(
        "raw NUL in string",
        b'{"messages": [{"role": "user", "content": "a\x00b"}]}',
        "invalid_json",
    )
    ok("utf-8 bom", b"\xef\xbb\xbf" + chat(max_tokens=9), max_tokens=9)
    ok("escaped NUL", b'{"messages": [{"role": "user", "content": "a\\u0000b"}]}')
    ok("lone surrogate", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', max_tokens=50)
    ok("emoji and CJK", chat("héllo 😀 日本語 " * 10), max_tokens=50)
    # Headers
    bad(
        "gzip",
        b"\x1f\x8b\x08\x00",
        "unsupported_content_encoding",
        415,
        headers={"content-type": "application/json", "content-encoding": "gzip"},
    )
    bad(
        "brotli",
        chat(),
        "unsupported_content_encoding",
        415,
        headers={"content-type": "application/json", "content-encoding": "br"},
    )
    bad("text/plain", chat(), "unsupported_media_type", 415, headers={"content-type": "text/plain"})
    bad(
        "form",
        b"messages=hi",
        "unsupported_media_type",
        415,
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    bad(
        "multipart",
        chat(),
        "unsupported_media_type",
        415,
        headers={"content-type": "multipart/form-data; boundary=x"},
    )
    ok(
        "json with charset",
        chat(max_tokens=3),
        max_tokens=3,
        headers={"content-type": "application/json; charset=utf-8"},
    )
    ok("no content-type", chat(max_tokens=4), max_tokens=4, headers={})
    ok(
        "identity encoding",
        chat(max_tokens=5),
        max_tokens=5,
        headers={"content-type": "application/json", "content-encoding": "identity"},
    )
    ok("chunked upload", chat(max_tokens=6), max_tokens=6, chunked=True)
    # Sizes: the prompt limit (500 tokens = ceil(chars / 4) + 3 per message) and Envoy's buffer
    ok("prompt at the limit", chat("x" * 1988), max_tokens=50)
    bad("prompt one token over", chat("x" * 1989), "prompt_too_long", 413)
    ok("body just under Envoy's buffer", chat(padding="p" * (ENVOY_BUFFER_LIMIT - 200)))
    bad(
        "body over Envoy's buffer",
        chat(padding="p" * (ENVOY_BUFFER_LIMIT + 10)),
        "body_too_large",
        413,
    )
    # Completions
    ok("token ids", b'{"prompt": [1, 2, 3]}', path="/v1/completions", max_tokens=50)
    ok("token id lists", b'{"prompt": [[1, 2], [3]]}', path="/v1/completions")
    ok(
        "string list",
        b'{"prompt": ["a", "b"], "max_tokens": 2}',
        path="/v1/completions",
        max_tokens=2,
    )
    bad("mixed prompt", b'{"prompt": ["a", 1]}', "invalid_type", path="/v1/completions")
    bad("negative token id", b'{"prompt": [1, -2]}', "invalid_type", path="/v1/completions")
    bad("prompt object", b'{"prompt": {"text": "a"}}', "invalid_type", path="/v1/completions")
    bad(
        "too many token ids",
        json.dumps({"prompt": list(range(501))}).encode(),
        "prompt_too_long",
        413,
        path="/v1/completions",
    )
    # Paths and methods the sidecar must leave alone
    ok("query string", chat(max_tokens=8), path="/v1/chat/completions?debug=1", max_tokens=8)
    ok("GET on chat path", b"", method="GET", headers={})
    ok("allowlisted path, bad body", b"{not json", path="/tokenize")
    # The door (tests/e2e/test_door.py has every spelling): an API the sidecar cannot bound
    # is refused whatever its body, and a path nobody serves is Envoy's 404.
    bad("unbounded API, bad body", b"{not json", "unsupported_endpoint", 404, path="/invocations")
    bad("pooling API, bad body", b"{not json", "invalid_json", path="/v1/embeddings")
    bad("unknown path", chat(), "unknown_url", 404, path="/v1/nothing")
    return c


CASES = _cases()
