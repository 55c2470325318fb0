"""What each API's body says of its prompt: one reader per API, each checking the fields it
reads and gathering the prompt's text into ``texts`` (``extproc.request.parse`` calls the one
for the request's endpoint after reading the JSON).

Each returns what counting needs besides the text: chat, responses and messages the number of
messages and of non-text content parts (each costs ``tokens.non_text_part_tokens``);
completions the token ids given as ids (counted exactly) and the number of prompts in a batch;
pooling the token ids. A wrong type or value is a ``RequestError`` naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from extproc.outcome import RequestError

__all__ = [
    "bad_type",
    "chat",
    "completions",
    "count",
    "messages",
    "pooling",
    "responses",
    "type_name",
]


def type_name(value: object) -> str:
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


def bad_type(param: str, expected: str, value: object) -> RequestError:
    return RequestError(
        "invalid_type", f"'{param}' must be {expected}, not {type_name(value)}.", param
    )


def count(key: str, value: object, ceiling: int) -> int:
    """``value`` of the field ``key`` as an integer from 1 to ``ceiling``, else a 400."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_type(key, "an integer", value)
    if not 1 <= value <= ceiling:
        raise RequestError(
            "invalid_value", f"'{key}' must be between 1 and {ceiling}, got {value}.", key
        )
    return value


def chat(body: dict[str, Any], texts: list[str]) -> tuple[int, int]:
    non_text = 0
    listed = _message_list(body)
    for where, message in listed:
        # null: an assistant message with tool calls may have no content
        content = message.get("content")
        non_text += _parts(content, f"{where}.content", texts, _TEXT, null_ok=True)
        name = message.get("name")
        if isinstance(name, str):
            texts.append(name)
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            if not isinstance(tool_calls, list):
                raise bad_type(f"{where}.tool_calls", "an array", tool_calls)
            texts.append(json.dumps(tool_calls, separators=(",", ":"), ensure_ascii=False))
    _tools(body, texts, ("tools", "functions"))
    return len(listed), non_text


def _message_list(body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``messages``: a non-empty array of objects, each with a string ``role``; each with the
    key path errors name it by."""
    messages = body.get("messages")
    if messages is None:
        raise RequestError("missing_field", "'messages' is required.", "messages")
    if not isinstance(messages, list):
        raise bad_type("messages", "an array", messages)
    if not messages:
        raise RequestError("invalid_value", "'messages' must not be empty.", "messages")
    listed: list[tuple[str, dict[str, Any]]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_type(where, "an object", message)
        role = message.get("role")
        if not isinstance(role, str):
            raise bad_type(f"{where}.role", "a string", role)
        listed.append((where, message))
    return listed


def _tools(body: dict[str, Any], texts: list[str], keys: tuple[str, ...]) -> None:
    """Tool definitions count as prompt: their JSON."""
    for key in keys:
        value = body.get(key)
        if value is not None:
            if not isinstance(value, list):
                raise bad_type(key, "an array", value)
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
        raise bad_type(where, expected, content)
    non_text = 0
    for j, part in enumerate(content):
        pwhere = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise bad_type(pwhere, "an object", part)
        kind = part.get("type")
        if not isinstance(kind, str):
            raise bad_type(f"{pwhere}.type", "a string", kind)
        if kind in text_types:
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_type(f"{pwhere}.text", "a string", text)
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


def responses(body: dict[str, Any], texts: list[str]) -> tuple[int, int]:
    """The Responses API: ``instructions`` and ``input`` (a string, or an array of items:
    messages whose content is a string or parts, and other items such as tool calls and
    their outputs, counted as their JSON). Returns (messages, non-text parts)."""
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_type("instructions", "a string", instructions)
        texts.append(instructions)
    items = body.get("input")
    if items is None:
        raise RequestError("missing_field", "'input' is required.", "input")
    if isinstance(items, str):
        texts.append(items)
        return 1, 0
    if not isinstance(items, list):
        raise bad_type("input", "a string or an array of input items", items)
    if not items:
        raise RequestError("invalid_value", "'input' must not be empty.", "input")
    non_text = 0
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_type(where, "an object", item)
        if item.get("type", "message") == "message":
            role = item.get("role")
            if not isinstance(role, str):
                raise bad_type(f"{where}.role", "a string", role)
            content = item.get("content")
            non_text += _parts(
                content, f"{where}.content", texts, _RESPONSES_TEXT, media=_MEDIA_TYPES
            )
        else:
            texts.append(json.dumps(item, separators=(",", ":"), ensure_ascii=False))
    _tools(body, texts, ("tools",))
    return len(items), non_text


def messages(body: dict[str, Any], texts: list[str]) -> tuple[int, int]:
    """Anthropic's Messages API: ``system`` (a string or text blocks) and ``messages``, each
    with a string or an array of content blocks. Returns (messages, non-text parts)."""
    system = body.get("system")
    non_text = 0
    if system is not None:
        non_text += _parts(system, "system", texts, _TEXT, media=_MEDIA_TYPES)
    listed = _message_list(body)
    for where, message in listed:
        content = message.get("content")
        non_text += _parts(content, f"{where}.content", texts, _TEXT, media=_MEDIA_TYPES)
    _tools(body, texts, ("tools",))
    return len(listed), non_text


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


def pooling(body: dict[str, Any], texts: list[str]) -> int:
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


def completions(body: dict[str, Any], texts: list[str]) -> tuple[int, int]:
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
        raise bad_type("prompt", expected, prompt)
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
