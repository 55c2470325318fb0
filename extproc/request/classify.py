"""Stage 2: count the prompt, bound the lengths, choose the bucket, rewrite the body.

Order matters and is fixed:
1. estimate prompt tokens; above ``limits.max_prompt_tokens`` -> 413 ``prompt_too_long``;
2. output sequences (``n``, or ``best_of`` when larger, times the prompts of a batched
   ``/v1/completions``) above ``limits.max_sequences`` -> 400 ``too_many_sequences``;
   effective ``max_tokens`` (per sequence): the client's value, or ``limits.default_max_tokens``
   when absent; above ``limits.max_output_tokens`` it is clamped (``on_excess: clamp``) or
   refused with 400 ``max_tokens_too_large`` (``on_excess: reject``);
3. the bucket the route's metadata names for the body's ``model`` (``model_buckets``) or for
   every request (``bucket``), else the first bucket whose match holds for (headers, prompt
   tokens, output tokens: effective max_tokens times the sequences, the body's ``model``);
Route metadata (``RouteOverride``) may also replace the limits of steps 1-2 and the queue
timeout for its route.
4. the body is rewritten only when max_tokens changed, or its ``priority`` is not the bucket's
   ``vllm_priority``. Each max_tokens key the client sent is set to the effective value; when
   it sent none, ``max_tokens`` is added (vLLM reads it on both endpoints). ``priority`` is
   vLLM's queue order (lower runs first, with ``--scheduling-policy priority``), so only the
   policy may set it: a bucket with ``vllm_priority`` writes its own value over the client's,
   and a bucket without one removes the client's (vLLM then uses its default, 0), so no
   client jumps vLLM's queue. A key that is absent is appended to the client's bytes;
   otherwise the body is re-serialised.
"""

from __future__ import annotations

import dataclasses
import json
import math
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from extproc.config.policy import BucketPolicy, Limits, OnExcess, Policy, RouteOverride, TokenPolicy
from extproc.outcome import Outcome, RequestError
from extproc.request.endpoints import Endpoint
from extproc.request.parse import OUTPUT_KEYS, PROMPT_FIELD, ParsedRequest

__all__ = [
    "Classification",
    "MaxTokensAction",
    "TokenCounter",
    "classify",
    "effective_limits",
    "token_counter",
]

# Counts the tokens of a batch of strings.
TokenCounter = Callable[[tuple[str, ...]], int]


class MaxTokensAction(StrEnum):
    KEPT = "kept"
    DEFAULTED = "defaulted"
    CLAMPED = "clamped"


@dataclass(frozen=True, slots=True, kw_only=True)
class Classification:
    bucket: BucketPolicy
    prompt_tokens: int
    max_tokens: int
    max_tokens_action: MaxTokensAction
    # Output sequences (n or best_of, times a batch's prompts), each up to max_tokens.
    sequences: int
    # The body to send upstream when it changed, else None (forward the original bytes).
    new_body: bytes | None
    # The bucket's, or the route's when route metadata overrides it.
    queue_timeout_s: float

    @property
    def output_tokens(self) -> int:
        """The most output tokens the request can cost: max_tokens for each sequence."""
        return self.max_tokens * self.sequences


def token_counter(tokens: TokenPolicy) -> TokenCounter:
    """Build the prompt-text counter once, at policy load."""
    if tokens.tokenizer:
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise RuntimeError(
                "tokens.tokenizer is set but the 'tokenizers' package is missing: "
                "pip install 'llm-extproc[tokenizer]'"
            ) from e
        tok = Tokenizer.from_file(tokens.tokenizer)

        def exact(texts: tuple[str, ...]) -> int:
            if not texts:
                return 0
            return sum(len(e.ids) for e in tok.encode_batch(list(texts), add_special_tokens=False))

        return exact

    cpt = tokens.chars_per_token

    def estimate(texts: tuple[str, ...]) -> int:
        return math.ceil(sum(_text_tokens(t, cpt) for t in texts))

    return estimate


# The fallback estimate (no tokenizer) charges each character by what it is:
# - an ASCII letter, space or control character: 1 / chars_per_token (the policy's setting,
#   for prose);
# - an ASCII digit or punctuation mark: 1 token (tokenizers split numbers into digits or short
#   groups, and punctuation rarely merges: random punctuation runs at about 0.8 a character);
# - beyond ASCII, by the length of its UTF-8 encoding, since what a vocabulary lacks falls back
#   to a token per byte: 2 bytes (accented Latin, Greek, Cyrillic, Arabic, Hebrew) 1.2 tokens,
#   3 bytes (CJK, Indic, Thai, symbols) 2, 4 bytes (emoji, rare CJK) 4.
# Counted as characters / 4, 6,000 emoji were 1,500 tokens to us and 6,000-24,000 to real
# tokenizers. The rates are set so that on prose of fourteen scripts, code and mixed text the
# estimate is at least 0.9x and at most 3x the larger count of two real tokenizers
# (`python -m bench.micro.prompt_estimate`; figures in docs/performance.md).
_HEAVY = (string.digits + string.punctuation).encode()
_LEAD_BYTES = (
    (b"2", 1.2, range(0xC0, 0xE0)),
    (b"3", 2.0, range(0xE0, 0xF0)),
    (b"4", 4.0, range(0xF0, 0x100)),
)


def _byte_classes() -> bytes:
    """A ``bytes.translate`` table: ``h`` digit or punctuation, ``l`` the rest of ASCII, a UTF-8
    lead byte its length, ``c`` a continuation byte (counted with its lead byte)."""
    table = bytearray(b"c" * 256)
    for b in range(0x80):
        table[b] = ord("h") if b in _HEAVY else ord("l")
    for mark, _, leads in _LEAD_BYTES:
        for b in leads:
            table[b] = mark[0]
    return bytes(table)


_BYTE_CLASS = _byte_classes()


def _text_tokens(text: str, chars_per_token: float) -> float:
    """The fallback's tokens for one text, in C-speed passes with no loop per character: for
    ASCII one ``translate`` that deletes the heavy characters (about 1 us per KiB;
    ``python -m bench.micro.prompt_estimate`` times it); otherwise the UTF-8 bytes classed by
    one ``translate`` and counted (about 6 us per KiB). A lone surrogate (an escape the JSON
    allowed) counts as a 3-byte character, as ``surrogatepass`` encodes it."""
    if text.isascii():  # O(1) in CPython
        raw = text.encode("ascii")
        heavy = len(raw) - len(raw.translate(None, _HEAVY))
        return (len(raw) - heavy) / chars_per_token + heavy
    classes = text.encode("utf-8", "surrogatepass").translate(_BYTE_CLASS)
    tokens = classes.count(b"l") / chars_per_token + classes.count(b"h")
    for mark, cost, _ in _LEAD_BYTES:
        tokens += cost * classes.count(mark)
    return tokens


_WHITESPACE = b" \t\r\n"
# The APIs whose vLLM request is known to take `priority` (checked against vLLM 0.32: chat and
# completions): a bucket's vllm_priority is written there; on the others only the client's
# `priority` is removed, so that no client jumps vLLM's queue and no unknown key is added.
_PRIORITY_APIS = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})


def _append(req: ParsedRequest, max_tokens: int | None, priority: int | None) -> bytes | None:
    """The body with ``"max_tokens":N`` and/or ``"priority":P`` appended before its closing
    brace, when the body has no such key at all (not even null: that would make a duplicate)
    and no BOM. Keeps the client's bytes as they are and costs a fraction of re-serialising.
    None: not applicable."""
    raw = req.raw
    if not raw or raw.startswith(b"\xef\xbb\xbf"):
        return None
    key = OUTPUT_KEYS[req.endpoint][0] if max_tokens is not None else ""
    if (max_tokens is not None and key in req.body) or (
        priority is not None and "priority" in req.body
    ):
        return None
    end = len(raw.rstrip(_WHITESPACE))
    if raw[end - 1 : end] != b"}":
        return None
    extra = []
    if max_tokens is not None:
        extra.append(b'"%s":%d' % (key.encode(), max_tokens))
    if priority is not None:
        extra.append(b'"priority":%d' % priority)
    return raw[: end - 1] + (b"," if req.body else b"") + b",".join(extra) + b"}"


def _rewrite(
    original: dict[str, Any], keys: tuple[str, ...], value: int, priority: int | None
) -> bytes:
    """The body re-serialised with every output bound key in ``keys`` at ``value`` (none for
    pooling) and ``priority`` the bucket's (None: no ``priority`` key at all)."""
    body = dict(original)  # shallow copy: the parsed request stays as the client sent it
    for key in keys:
        body[key] = value
    if priority is None:
        body.pop("priority", None)
    else:
        body["priority"] = priority
    try:
        text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        return text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from \ud800-style escapes: keep them escaped
        return json.dumps(body, separators=(",", ":")).encode("ascii")


def effective_limits(limits: Limits, route: RouteOverride | None) -> Limits:
    if route is None:
        return limits
    max_output = route.max_output_tokens or limits.max_output_tokens
    return dataclasses.replace(
        limits,
        max_prompt_tokens=route.max_prompt_tokens or limits.max_prompt_tokens,
        max_output_tokens=max_output,
        default_max_tokens=min(max_output, route.default_max_tokens or limits.default_max_tokens),
    )


def classify(
    policy: Policy,
    count: TokenCounter,
    headers: Mapping[str, str],
    req: ParsedRequest,
    route: RouteOverride | None = None,
) -> Classification:
    tp = policy.tokens
    prompt_tokens = (
        count(req.texts)
        + req.token_ids
        + req.non_text_parts * tp.non_text_part_tokens
        + req.messages * tp.message_overhead_tokens
    )
    limits = effective_limits(policy.limits, route)
    if prompt_tokens > limits.max_prompt_tokens:
        raise RequestError(
            "prompt_too_long",
            f"The prompt is about {prompt_tokens} tokens; this endpoint accepts at most "
            f"{limits.max_prompt_tokens}.",
            PROMPT_FIELD[req.endpoint],
            outcome=Outcome.REJECTED_TOO_LARGE,
        )

    if req.sequences > limits.max_sequences:
        n, best_of = req.body.get("n") or 1, req.body.get("best_of") or 1
        param = "best_of" if best_of > max(n, 1) else "n" if n > 1 else "prompt"
        raise RequestError(
            "too_many_sequences",
            f"The request asks for {req.sequences} output sequences (n or best_of, times the "
            f"prompts of a batch); this endpoint allows at most {limits.max_sequences}.",
            param,
        )
    requested = req.requested_max_tokens
    output_keys = OUTPUT_KEYS[req.endpoint]
    if not output_keys:  # pooling: a prompt in, no output to bound
        max_tokens, action = 0, MaxTokensAction.KEPT
    elif requested is None:
        max_tokens, action = limits.default_max_tokens, MaxTokensAction.DEFAULTED
    elif requested > limits.max_output_tokens:
        if limits.on_excess is OnExcess.REJECT:
            key = req.max_tokens_keys[-1] if req.max_tokens_keys else output_keys[0]
            raise RequestError(
                "max_tokens_too_large",
                f"'{key}' is {requested}; this endpoint allows at most {limits.max_output_tokens}.",
                key,
            )
        max_tokens, action = limits.max_output_tokens, MaxTokensAction.CLAMPED
    else:
        max_tokens, action = requested, MaxTokensAction.KEPT

    chosen = route.bucket_for(req.model) if route is not None else None
    if chosen is not None:
        bucket = policy.bucket(chosen)
    else:
        for bucket in policy.buckets:
            if bucket.match.matches(headers, prompt_tokens, max_tokens * req.sequences, req.model):
                break
        else:  # pragma: no cover - the policy guarantees a catch-all bucket
            raise AssertionError("policy has no catch-all bucket")

    # Both keys present with different values also needs a rewrite, so the backend cannot
    # read the other one. `priority` is the bucket's or none (step 4): never the client's.
    # vLLM's `priority` field on the APIs known to take it; elsewhere only the client's goes.
    priority = bucket.vllm_priority if req.endpoint in _PRIORITY_APIS else None
    strip_priority = priority is None and "priority" in req.body
    needs_rewrite = (
        action is not MaxTokensAction.KEPT
        or any(req.body.get(k) != max_tokens for k in req.max_tokens_keys)
        or (priority is not None and req.body.get("priority") != priority)
        or strip_priority
    )
    new_body = None
    if needs_rewrite:
        tokens_kept = action is MaxTokensAction.KEPT and all(
            req.body.get(k) == max_tokens for k in req.max_tokens_keys
        )
        if not strip_priority and (action is MaxTokensAction.DEFAULTED or tokens_kept):
            new_body = _append(req, None if tokens_kept else max_tokens, priority)
        if new_body is None:
            keys = req.max_tokens_keys or output_keys[:1]
            new_body = _rewrite(req.body, keys, max_tokens, priority)

    timeout = bucket.queue_timeout_s
    if route is not None and route.queue_timeout_s is not None:
        timeout = route.queue_timeout_s
    return Classification(
        bucket=bucket,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        max_tokens_action=action,
        sequences=req.sequences,
        new_body=new_body,
        queue_timeout_s=timeout,
    )
