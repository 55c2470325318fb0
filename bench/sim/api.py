"""The OpenAI wire format, pure: request bodies in (validation, token counts), response bodies
and SSE chunks out; and the body of the simulator's own ``POST /sim/speed``.

Token accounting: a prompt's token count is the number of characters of its text / 4 (rounded
up, at least 1). The simulator always
generates exactly ``max_completion_tokens`` / ``max_tokens`` tokens (default 16), each the text
``" tok"``, with ``finish_reason="length"``.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .profiles import check_speed_factor

DEFAULT_MAX_TOKENS: Final = 16
CHARS_PER_TOKEN: Final = 4
TOKEN_TEXT: Final = " tok"


class SimRequestError(Exception):
    """A request the server rejects; rendered as an OpenAI-style JSON error."""

    def __init__(
        self, message: str, *, status: int = 400, err_type: str = "BadRequestError"
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": None,
                "code": self.status,
            }
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class ParsedRequest:
    """What the simulator needs from an OpenAI request body."""

    chat: bool
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool


def _text_chars(value: Any) -> int:
    """Characters of text in a chat message ``content`` (string or list of parts)."""
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        total = 0
        for part in value:
            if isinstance(part, str):
                total += len(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                total += len(part["text"])
        return total
    raise SimRequestError("message content must be a string or a list of content parts")


def _prompt_units(prompt: Any) -> tuple[int, int]:
    """(characters, token ids) of a completions ``prompt``.

    Accepts str, list[str] (counted as one concatenated prompt, no batching), list[int] and
    list[list[int]] (token ids).
    """
    if isinstance(prompt, str):
        return len(prompt), 0
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return sum(len(p) for p in prompt), 0
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return 0, len(prompt)
        if all(isinstance(p, list) for p in prompt):
            return 0, sum(len(p) for p in prompt)
    raise SimRequestError("prompt must be a string, a list of strings or a list of token ids")


def count_prompt_tokens(body: Mapping[str, Any], *, chat: bool) -> int:
    """Prompt tokens of a request body: ceil(characters / 4) plus any token ids; at least 1."""
    chars = 0
    ids = 0
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise SimRequestError("messages must be a non-empty list")
        for message in messages:
            if not isinstance(message, Mapping):
                raise SimRequestError("each message must be an object")
            chars += _text_chars(message.get("content"))
    else:
        if "prompt" not in body:
            raise SimRequestError("prompt is required")
        chars, ids = _prompt_units(body["prompt"])
    return max(1, math.ceil(chars / CHARS_PER_TOKEN) + ids)


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SimRequestError(f"{name} must be a positive integer")
    return value


def parse_request(body: Any, *, chat: bool, max_model_len: int) -> ParsedRequest:
    """Validate an OpenAI request body and extract token counts; raises :class:`SimRequestError`."""
    if not isinstance(body, Mapping):
        raise SimRequestError("request body must be a JSON object")
    prompt_tokens = count_prompt_tokens(body, chat=chat)
    raw_max = body.get("max_completion_tokens") if chat else None
    if raw_max is None:
        raw_max = body.get("max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if raw_max is None else _positive_int(raw_max, "max_tokens")
    if prompt_tokens + max_tokens > max_model_len:
        raise SimRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion."
        )
    stream = bool(body.get("stream", False))
    options = body.get("stream_options")
    include_usage = stream and isinstance(options, Mapping) and bool(options.get("include_usage"))
    return ParsedRequest(
        chat=chat,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
    )


def dumps(obj: Any) -> str:
    """Compact JSON, as vLLM sends it."""
    return json.dumps(obj, separators=(",", ":"))


class Render:
    """Pre-rendered OpenAI response fragments for one request (cheap per-token streaming)."""

    __slots__ = ("_obj", "chat", "created", "model", "rid")

    def __init__(self, *, chat: bool, model: str) -> None:
        self.chat = chat
        self.rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self._obj = "chat.completion.chunk" if chat else "text_completion"

    def _chunk(self, choice: dict[str, Any] | None, usage: dict[str, int] | None = None) -> bytes:
        obj: dict[str, Any] = {
            "id": self.rid,
            "object": self._obj,
            "created": self.created,
            "model": self.model,
            "choices": [] if choice is None else [choice],
        }
        if usage is not None:
            obj["usage"] = usage
        return b"data: " + dumps(obj).encode() + b"\n\n"

    def role_chunk(self) -> bytes:
        return self._chunk(
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        )

    def token_chunk(self, finish_reason: str | None = None) -> bytes:
        if self.chat:
            choice = {
                "index": 0,
                "delta": {"content": TOKEN_TEXT},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": TOKEN_TEXT,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        return self._chunk(choice)

    def usage_chunk(self, usage: dict[str, int]) -> bytes:
        return self._chunk(None, usage)

    def full_response(self, n_tokens: int, usage: dict[str, int]) -> dict[str, Any]:
        text = TOKEN_TEXT * n_tokens
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        return {
            "id": self.rid,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }


def token_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The ``usage`` object of a response."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def parse_speed_factor(body: Any) -> float:
    """The factor of a ``POST /sim/speed`` body ``{"factor": 0.5}``; raises
    :class:`SimRequestError`."""
    if not isinstance(body, Mapping) or "factor" not in body:
        raise SimRequestError('body must be a JSON object {"factor": <number>}')
    factor = body["factor"]
    if isinstance(factor, bool) or not isinstance(factor, int | float):
        raise SimRequestError("factor must be a number")
    try:
        return float(check_speed_factor(factor))  # checked first: a huge int cannot overflow
    except ValueError as exc:
        raise SimRequestError(str(exc)) from None
