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
from extproc.request import prompts
from extproc.request.endpoints import Endpoint, endpoint_for_path
from extproc.request.prompts import bad_type, count, type_name

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


def _max_tokens(body: dict[str, Any], keys: tuple[str, ...]) -> tuple[int | None, tuple[str, ...]]:
    present: list[str] = []
    values: dict[str, int] = {}
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        present.append(key)
        values[key] = count(key, value, MAX_TOKENS_CEILING)
    requested = values[present[-1]] if present else None
    return requested, tuple(present)


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
        choices = max(choices, count(key, value, _SEQUENCES_CEILING))
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
            "invalid_body", f"The request body must be a JSON object, not {type_name(body)}."
        )
    requested, keys = _max_tokens(body, OUTPUT_KEYS[endpoint])
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_type("stream", "a boolean", stream)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_type("model", "a string", model)
    choices = _choices(body)
    texts: list[str] = []
    messages = non_text = token_ids = 0
    batch = 1
    try:
        if endpoint is Endpoint.CHAT:
            messages, non_text = prompts.chat(body, texts)
        elif endpoint is Endpoint.COMPLETIONS:
            token_ids, batch = prompts.completions(body, texts)
        elif endpoint is Endpoint.RESPONSES:
            messages, non_text = prompts.responses(body, texts)
        elif endpoint is Endpoint.MESSAGES:
            messages, non_text = prompts.messages(body, texts)
        else:
            token_ids = prompts.pooling(body, texts)
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
        sequences=choices * batch,
        model=model,
        body=body,
        raw=raw,
    )
