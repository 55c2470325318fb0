"""Stage 1: parse an OpenAI-style request body into the few facts admission needs.

``parse_body`` takes the raw bytes Envoy buffered and returns a ``ParsedRequest`` or raises
``RequestError`` with the status and an error code that names the problem and the field. It never
raises anything else on any input (tests/unit/test_parse_props.py drives it with arbitrary bytes).

What it accepts, on purpose strict where laxness would let a request slip past the limits:
- UTF-8 JSON (a UTF-8 byte-order mark is tolerated) holding one object; NaN/Infinity literals,
  numbers beyond the double range (``1e400``, which Python reads as infinity) and duplicate keys
  are refused (a duplicate ``max_tokens`` could mean one value to us and another
  to the backend);
- chat: ``messages``, a non-empty list of objects whose ``content`` is a string, null, or a list of
  content parts; ``text`` parts are counted as text, any other part type costs a fixed number of
  tokens (``tokens.non_text_part_tokens``) and is passed on for the backend to judge;
- completions: ``prompt``, a string, a list of strings, a list of token ids, or a list of lists of
  token ids (token ids count exactly);
- ``max_tokens`` / ``max_completion_tokens``: an integer from 1 to 2**31 - 1, or null
  (= absent);
- ``stream``: a boolean or null.

Prompt text is gathered as a tuple of strings; counting it is the next stage's job
(``extproc.request.classify``), so the tokenizer choice stays out of parsing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from extproc.outcome import RequestError
from extproc.request.endpoints import Endpoint, endpoint_for_path

__all__ = ["Endpoint", "ParsedRequest", "check_content_headers", "endpoint_for_path", "parse_body"]


MAX_TOKENS_KEYS = ("max_tokens", "max_completion_tokens")
# Each API's output bound: the keys that carry it (the last wins when several are set; the
# first is the one added when the client sent none). Pooling has no output to bound.
OUTPUT_KEYS: dict[Endpoint, tuple[str, ...]] = {
    Endpoint.CHAT: MAX_TOKENS_KEYS,
    Endpoint.COMPLETIONS: MAX_TOKENS_KEYS,
    Endpoint.RESPONSES: ("max_output_tokens",),
    Endpoint.MESSAGES: ("max_tokens",),
    Endpoint.POOLING: (),
}
# The field a prompt too long is reported on.
PROMPT_FIELD: dict[Endpoint, str] = {
    Endpoint.CHAT: "messages",
    Endpoint.COMPLETIONS: "prompt",
    Endpoint.RESPONSES: "input",
    Endpoint.MESSAGES: "messages",
    Endpoint.POOLING: "input",
}
# Above this a max_tokens is not a request but a bug (no model has such a context); refuse it
# rather than clamp it, so the client hears about it. Values in range but above the policy's
# max_output_tokens are clamped or refused as the policy says.
MAX_TOKENS_CEILING = 2**31 - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class ParsedRequest:
    endpoint: Endpoint
    # Prompt text to count: message contents, tool definitions, prompt strings.
    texts: tuple[str, ...]
    # Tokens known exactly (token-id prompts).
    token_ids: int = 0
    messages: int = 0
    non_text_parts: int = 0
    # The client's max_tokens: max_completion_tokens when present, else max_tokens, else None.
    requested_max_tokens: int | None = None
    # Which of max_tokens / max_completion_tokens the body holds (with a non-null value).
    max_tokens_keys: tuple[str, ...] = ()
    stream: bool = False
    # Output sequences asked for: n (best_of when larger) times the prompts of a batched
    # /v1/completions prompt; each may run to max_tokens.
    sequences: int = 1
    model: str | None = None
    # The decoded body, kept so the rewrite stage need not parse again.
    body: dict[str, Any] = field(compare=False, repr=False, default_factory=dict)
    # The bytes as received (the rewrite appends to them when it only adds a key).
    raw: bytes = field(compare=False, repr=False, default=b"")


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(literal: str) -> float:
    """A JSON number with a fraction or exponent, as a double; one beyond the double range
    (``1e400``) is refused: it would parse as infinity, and a rewritten body would carry
    ``Infinity``, which is not JSON."""
    value = float(literal)
    if math.isinf(value):
        raise ValueError(f"the number {literal[:32]} is out of range")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise RequestError(
                    "duplicate_key", f"The request body repeats the key {key!r}.", key
                )
            seen.add(key)
    return obj


_JSON_TYPES = {"application/json"}


def check_content_headers(content_type: str | None, content_encoding: str | None) -> None:
    """Refuse bodies we cannot read before looking at them (415)."""
    if content_encoding and content_encoding.strip().lower() not in ("identity", ""):
        raise RequestError(
            "unsupported_content_encoding",
            f"Content-Encoding {content_encoding.strip()!r} is not supported; send the JSON "
            "body uncompressed.",
            status=415,
        )
    if content_type:
        media = content_type.split(";", 1)[0].strip().lower()
        if media not in _JSON_TYPES and not media.endswith("+json"):
            raise RequestError(
                "unsupported_media_type",
                f"Content-Type {media!r} is not supported; send application/json.",
                status=415,
            )


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), type(value).__name__)


def _bad_type(param: str, expected: str, value: object) -> RequestError:
    return RequestError(
        "invalid_type", f"'{param}' must be {expected}, not {_type_name(value)}.", param
    )


def _count(key: str, value: object, ceiling: int) -> int:
    """``value`` of the field ``key`` as an integer from 1 to ``ceiling``, else a 400."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad_type(key, "an integer", value)
    if not 1 <= value <= ceiling:
        raise RequestError(
            "invalid_value", f"'{key}' must be between 1 and {ceiling}, got {value}.", key
        )
    return value


def _max_tokens(body: dict[str, Any], keys: tuple[str, ...]) -> tuple[int | None, tuple[str, ...]]:
    present: list[str] = []
    values: dict[str, int] = {}
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        present.append(key)
        values[key] = _count(key, value, MAX_TOKENS_CEILING)
    requested = values[present[-1]] if present else None
    return requested, tuple(present)


def _chat(body: dict[str, Any], texts: list[str]) -> tuple[int, int]:
    messages = body.get("messages")
    if messages is None:
        raise RequestError("missing_field", "'messages' is required.", "messages")
    if not isinstance(messages, list):
        raise _bad_type("messages", "an array", messages)
    if not messages:
        raise RequestError("invalid_value", "'messages' must not be empty.", "messages")
    non_text = 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad_type(where, "an object", message)
        role = message.get("role")
        if not isinstance(role, str):
            raise _bad_type(f"{where}.role", "a string", role)
        # null: an assistant message with tool calls may have no content
        content = message.get("content")
        non_text += _parts(content, f"{where}.content", texts, _TEXT, null_ok=True)
        name = message.get("name")
        if isinstance(name, str):
            texts.append(name)
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            if not isinstance(tool_calls, list):
                raise _bad_type(f"{where}.tool_calls", "an array", tool_calls)
            texts.append(json.dumps(tool_calls, separators=(",", ":"), ensure_ascii=False))
    _tools(body, texts, ("tools", "functions"))
    return len(messages), non_text


def _tools(body: dict[str, Any], texts: list[str], keys: tuple[str, ...]) -> None:
    """Tool definitions count as prompt: their JSON."""
    for key in keys:
        value = body.get(key)
        if value is not None:
            if not isinstance(value, list):
                raise _bad_type(key, "an array", value)
            texts.append(json.dumps(value, separators=(",", ":"), ensure_ascii=False))


def _parts(
    content: object,
    where: str,
    texts: list[str],
    text_types: frozenset[str],
    *,
    media: frozenset[str] | None = None,
    null_ok: bool = False,
) -> int:
    """A content that is a string or an array of typed parts (or null, where ``null_ok``):
    the text of parts whose type is in ``text_types``; a part whose type is in ``media``
    (None: every other part) counts as a non-text part; the JSON of the rest (tool calls and
    results: text the model reads). Returns the non-text parts."""
    if isinstance(content, str):
        texts.append(content)
        return 0
    if content is None and null_ok:
        return 0
    if not isinstance(content, list):
        expected = (
            "a string, an array of content parts, or null"
            if null_ok
            else "a string or an array of content parts"
        )
        raise _bad_type(where, expected, content)
    non_text = 0
    for j, part in enumerate(content):
        pwhere = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise _bad_type(pwhere, "an object", part)
        kind = part.get("type")
        if not isinstance(kind, str):
            raise _bad_type(f"{pwhere}.type", "a string", kind)
        if kind in text_types:
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad_type(f"{pwhere}.text", "a string", text)
            texts.append(text)
        elif media is None or kind in media:
            non_text += 1
        else:
            texts.append(json.dumps(part, separators=(",", ":"), ensure_ascii=False))
    return non_text


_MEDIA_TYPES = frozenset(
    {"image", "image_url", "input_image", "input_audio", "input_file", "document", "file"}
)
_RESPONSES_TEXT = frozenset({"input_text", "output_text", "text"})
_TEXT = frozenset({"text"})


def _responses(body: dict[str, Any], texts: list[str]) -> tuple[int, int]:
    """The Responses API: ``instructions`` and ``input`` (a string, or an array of items:
    messages whose content is a string or parts, and other items such as tool calls and
    their outputs, counted as their JSON). Returns (messages, non-text parts)."""
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad_type("instructions", "a string", instructions)
        texts.append(instructions)
    items = body.get("input")
    if items is None:
        raise RequestError("missing_field", "'input' is required.", "input")
    if isinstance(items, str):
        texts.append(items)
        return 1, 0
    if not isinstance(items, list):
        raise _bad_type("input", "a string or an array of input items", items)
    if not items:
        raise RequestError("invalid_value", "'input' must not be empty.", "input")
    non_text = 0
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad_type(where, "an object", item)
        if item.get("type", "message") == "message":
            role = item.get("role")
            if not isinstance(role, str):
                raise _bad_type(f"{where}.role", "a string", role)
            content = item.get("content")
            non_text += _parts(
                content, f"{where}.content", texts, _RESPONSES_TEXT, media=_MEDIA_TYPES
            )
        else:
            texts.append(json.dumps(item, separators=(",", ":"), ensure_ascii=False))
    _tools(body, texts, ("tools",))
    return len(items), non_text


def _messages(body: dict[str, Any], texts: list[str]) -> tuple[int, int]:
    """Anthropic's Messages API: ``system`` (a string or text blocks) and ``messages``, each
    with a string or an array of content blocks. Returns (messages, non-text parts)."""
    system = body.get("system")
    non_text = 0
    if system is not None:
        non_text += _parts(system, "system", texts, _TEXT, media=_MEDIA_TYPES)
    messages = body.get("messages")
    if messages is None:
        raise RequestError("missing_field", "'messages' is required.", "messages")
    if not isinstance(messages, list):
        raise _bad_type("messages", "an array", messages)
    if not messages:
        raise RequestError("invalid_value", "'messages' must not be empty.", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad_type(where, "an object", message)
        role = message.get("role")
        if not isinstance(role, str):
            raise _bad_type(f"{where}.role", "a string", role)
        content = message.get("content")
        non_text += _parts(content, f"{where}.content", texts, _TEXT, media=_MEDIA_TYPES)
    _tools(body, texts, ("tools",))
    return len(messages), non_text


# Fields of the pooling requests that are not text the model reads.
_POOLING_SETTINGS = frozenset(
    {
        "model",
        "encoding_format",
        "dimensions",
        "user",
        "priority",
        "request_id",
        "truncate_prompt_tokens",
    }
)


def _pooling(body: dict[str, Any], texts: list[str]) -> int:
    """The pooling endpoints (embeddings, pooling, classify, score, rerank) name their inputs
    differently (``input``, ``text_1``/``text_2``, ``queries``/``documents``, ``query``,
    ``messages``...): every string in the body but its settings is prompt, every integer in
    an array a token id. Returns the token ids. Nesting is bounded by the JSON parser."""
    token_ids = 0
    stack: list[object] = [v for k, v in body.items() if k not in _POOLING_SETTINGS]
    if not stack:
        raise RequestError("missing_field", "'input' is required.", "input")
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, list):
            token_ids += sum(1 for v in value if _is_token_id(v))
            stack.extend(v for v in value if isinstance(v, (str, list, dict)))
        elif isinstance(value, dict):
            stack.extend(value.values())
    return token_ids


def _is_token_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _completions(body: dict[str, Any], texts: list[str]) -> tuple[int, int]:
    """Gather a completions prompt; return the count of exact token ids, and of prompts (a
    batch is an array of strings or of token-id arrays: vLLM answers each)."""
    if "prompt" not in body or body["prompt"] is None:
        raise RequestError("missing_field", "'prompt' is required.", "prompt")
    prompt = body["prompt"]
    expected = "a string, an array of strings, or an array of token ids"
    if isinstance(prompt, str):
        texts.append(prompt)
        return 0, 1
    if not isinstance(prompt, list):
        raise _bad_type("prompt", expected, prompt)
    if not prompt:
        raise RequestError("invalid_value", "'prompt' must not be empty.", "prompt")
    if all(isinstance(p, str) for p in prompt):
        texts.extend(prompt)
        return 0, len(prompt)
    if all(_is_token_id(p) for p in prompt):
        return len(prompt), 1
    if all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in prompt):
        return sum(len(p) for p in prompt), len(prompt)
    raise RequestError("invalid_type", f"'prompt' must be {expected}.", "prompt")


# Above this an n or best_of is not a request but a bug; the policy's max_sequences refuses
# far lower values with its own message.
_SEQUENCES_CEILING = 2**31 - 1


def _choices(body: dict[str, Any]) -> int:
    """n, or best_of when larger (vLLM generates best_of sequences and returns n): each an
    integer of at least 1 when present."""
    choices = 1
    for key in ("n", "best_of"):
        value = body.get(key)
        if value is None:
            continue
        choices = max(choices, _count(key, value, _SEQUENCES_CEILING))
    return choices


def parse_body(endpoint: Endpoint, raw: bytes) -> ParsedRequest:
    if not raw:
        raise RequestError("empty_body", "The request body is empty; send a JSON object.")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(
            "invalid_encoding", f"The request body is not valid UTF-8 (byte {e.start})."
        ) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        body = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_reject_constant,
            parse_float=_finite_float,
        )
    except json.JSONDecodeError as e:
        raise RequestError(
            "invalid_json", f"The request body is not valid JSON: {e.msg} at byte {e.pos}."
        ) from None
    except RecursionError:
        raise RequestError("invalid_json", "The request body is nested too deeply.") from None
    except ValueError as e:  # NaN/Infinity, out-of-range numbers, integers too long to convert
        raise RequestError("invalid_json", f"The request body is not valid JSON: {e}.") from None
    if not isinstance(body, dict):
        raise RequestError(
            "invalid_body", f"The request body must be a JSON object, not {_type_name(body)}."
        )
    requested, keys = _max_tokens(body, OUTPUT_KEYS[endpoint])
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad_type("stream", "a boolean", stream)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad_type("model", "a string", model)
    choices = _choices(body)
    texts: list[str] = []
    messages = non_text = token_ids = 0
    prompts = 1
    try:
        if endpoint is Endpoint.CHAT:
            messages, non_text = _chat(body, texts)
        elif endpoint is Endpoint.COMPLETIONS:
            token_ids, prompts = _completions(body, texts)
        elif endpoint is Endpoint.RESPONSES:
            messages, non_text = _responses(body, texts)
        elif endpoint is Endpoint.MESSAGES:
            messages, non_text = _messages(body, texts)
        else:
            token_ids = _pooling(body, texts)
    except RecursionError:  # json.dumps of deeply nested tools
        raise RequestError("invalid_json", "The request body is nested too deeply.") from None
    return ParsedRequest(
        endpoint=endpoint,
        texts=tuple(texts),
        token_ids=token_ids,
        messages=messages,
        non_text_parts=non_text,
        requested_max_tokens=requested,
        max_tokens_keys=keys,
        stream=bool(stream),
        sequences=choices * prompts,
        model=model,
        body=body,
        raw=raw,
    )
