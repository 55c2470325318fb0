"""The admission policy: load, validate, resolve.

The schema is defined once, as proto3 messages in ``protos/llm_extproc/v1/policy.proto``. A policy
file is YAML; ``extproc.config.schema`` reads it into the ``Policy`` message, checking every key,
and every error names the file, the key path and the reason (``policy.yaml:
buckets[1].queue_timeout: bad duration '5x' ...``). Route metadata from Envoy is read into the
``RouteOverride`` message the same way.

The message is then resolved into frozen dataclasses with every default filled in and every
cross-field rule checked (bucket names unique, a catch-all bucket last, ...). Each default is
written once, in the dataclass fields below; the embedded default policy
(``default_policy.yaml``) states only its buckets. The request path reads only the resolved
``Policy``; it never touches protobuf.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import duration_pb2

from extproc._proto.llm_extproc.v1 import policy_pb2
from extproc.config.schema import PolicyError, fill, parse_duration

__all__ = [
    "BucketPolicy",
    "Limits",
    "MatchRule",
    "Mode",
    "OnExcess",
    "Policy",
    "PolicyError",
    "RetryAfterPolicy",
    "RouteOverride",
    "TokenPolicy",
    "load_policy",
    "parse_duration",
    "policy_from_mapping",
    "policy_from_yaml",
    "route_override_from_mapping",
]


class OnExcess(StrEnum):
    CLAMP = "clamp"
    REJECT = "reject"


class Mode(StrEnum):
    ENFORCE = "enforce"
    SHADOW = "shadow"


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenPolicy:
    chars_per_token: float = 4.0
    tokenizer: str | None = None
    non_text_part_tokens: int = 512
    message_overhead_tokens: int = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    max_prompt_tokens: int = 32768
    default_max_tokens: int = 256
    max_output_tokens: int = 1024
    on_excess: OnExcess = OnExcess.CLAMP
    # Bytes of request bodies queued requests may hold, all buckets together: 256 MiB, an
    # eighth of the 2 GiB the Istio manifest gives the pod (a queued 4 MB body costs ~5 MB).
    max_queued_bytes: int = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryAfterPolicy:
    min_s: float = 1.0
    max_s: float = 60.0
    jitter: float = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class MatchRule:
    # Header names lower-cased (Envoy hands them to us lower-cased); values exact.
    headers: tuple[tuple[str, str], ...] = ()
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None

    @property
    def is_catch_all(self) -> bool:
        return not self.headers and self.max_prompt_tokens is None and self.max_tokens is None

    def matches(self, headers: Mapping[str, str], prompt_tokens: int, max_tokens: int) -> bool:
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            return False
        if self.max_tokens is not None and max_tokens > self.max_tokens:
            return False
        return all(headers.get(name) == value for name, value in self.headers)


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketPolicy:
    name: str
    match: MatchRule = field(default_factory=MatchRule)
    max_concurrency: int
    queue_timeout_s: float
    max_queue: int
    trusted: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteOverride:
    """Per-route values from Envoy route metadata; None = the policy file's value."""

    bucket: str | None = None
    max_concurrency: int | None = None
    max_queue: int | None = None
    queue_timeout_s: float | None = None
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    default_max_tokens: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    tokens: TokenPolicy = field(default_factory=TokenPolicy)
    limits: Limits = field(default_factory=Limits)
    retry_after: RetryAfterPolicy = field(default_factory=RetryAfterPolicy)
    buckets: tuple[BucketPolicy, ...]
    mode: Mode = Mode.ENFORCE
    trusted_headers: tuple[str, ...] = ()

    def bucket(self, name: str) -> BucketPolicy:
        for bucket in self.buckets:
            if bucket.name == name:
                return bucket
        raise KeyError(name)

    @property
    def longest_queue_timeout_s(self) -> float:
        return max(b.queue_timeout_s for b in self.buckets)

    def to_dict(self) -> dict[str, Any]:
        """The resolved policy in the file's own shape (what `llm-extproc check` prints)."""

        def duration(seconds: float) -> str:
            return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"

        return {
            "mode": str(self.mode),
            "trusted_headers": list(self.trusted_headers),
            "tokens": {
                "chars_per_token": self.tokens.chars_per_token,
                "tokenizer": self.tokens.tokenizer,
                "non_text_part_tokens": self.tokens.non_text_part_tokens,
                "message_overhead_tokens": self.tokens.message_overhead_tokens,
            },
            "limits": {
                "max_prompt_tokens": self.limits.max_prompt_tokens,
                "default_max_tokens": self.limits.default_max_tokens,
                "max_output_tokens": self.limits.max_output_tokens,
                "on_excess": str(self.limits.on_excess),
                "max_queued_bytes": self.limits.max_queued_bytes,
            },
            "retry_after": {
                "min": duration(self.retry_after.min_s),
                "max": duration(self.retry_after.max_s),
                "jitter": self.retry_after.jitter,
            },
            "buckets": [
                {
                    "name": b.name,
                    "match": {
                        k: v
                        for k, v in (
                            ("headers", dict(b.match.headers) or None),
                            ("max_prompt_tokens", b.match.max_prompt_tokens),
                            ("max_tokens", b.match.max_tokens),
                        )
                        if v is not None
                    },
                    "max_concurrency": b.max_concurrency,
                    "queue_timeout": duration(b.queue_timeout_s),
                    "max_queue": b.max_queue,
                    "trusted": b.trusted,
                }
                for b in self.buckets
            ],
        }


# --- resolving the message into the policy --------------------------------------------------

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9a-z-]+$")


# Each default is written once, in the dataclasses above; these instances are where
# resolving reads them from.
_TOKENS, _LIMITS, _RETRY_AFTER = TokenPolicy(), Limits(), RetryAfterPolicy()


def _set_or(msg: Any, name: str, default: Any) -> Any:
    """A proto3 ``optional`` field's value when the file set it, else the default."""
    return getattr(msg, name) if msg.HasField(name) else default


def _seconds(d: duration_pb2.Duration) -> float:
    return float(d.ToNanoseconds()) / 1e9


def _resolve(msg: policy_pb2.Policy) -> Policy:
    t = msg.tokens
    tokens = TokenPolicy(
        chars_per_token=_set_or(t, "chars_per_token", _TOKENS.chars_per_token),
        tokenizer=t.tokenizer or None,
        non_text_part_tokens=_set_or(t, "non_text_part_tokens", _TOKENS.non_text_part_tokens),
        message_overhead_tokens=_set_or(
            t, "message_overhead_tokens", _TOKENS.message_overhead_tokens
        ),
    )
    if tokens.chars_per_token <= 0:
        raise PolicyError("tokens.chars_per_token: must be greater than 0")
    if tokens.tokenizer and not Path(tokens.tokenizer).is_file():
        raise PolicyError(f"tokens.tokenizer: no such file {tokens.tokenizer!r}")

    lm = msg.limits
    limits = Limits(
        max_prompt_tokens=_set_or(lm, "max_prompt_tokens", _LIMITS.max_prompt_tokens),
        default_max_tokens=_set_or(lm, "default_max_tokens", _LIMITS.default_max_tokens),
        max_output_tokens=_set_or(lm, "max_output_tokens", _LIMITS.max_output_tokens),
        on_excess={policy_pb2.REJECT: OnExcess.REJECT, policy_pb2.CLAMP: OnExcess.CLAMP}.get(
            lm.on_excess, _LIMITS.on_excess
        ),
        max_queued_bytes=_set_or(lm, "max_queued_bytes", _LIMITS.max_queued_bytes),
    )
    for name in ("max_prompt_tokens", "default_max_tokens", "max_output_tokens"):
        if getattr(limits, name) < 1:
            raise PolicyError(f"limits.{name}: must be at least 1")
    if limits.default_max_tokens > limits.max_output_tokens:
        raise PolicyError(
            f"limits.default_max_tokens: {limits.default_max_tokens} is above "
            f"limits.max_output_tokens ({limits.max_output_tokens})"
        )

    ra = msg.retry_after
    retry_after = RetryAfterPolicy(
        min_s=_seconds(ra.min) if ra.HasField("min") else _RETRY_AFTER.min_s,
        max_s=_seconds(ra.max) if ra.HasField("max") else _RETRY_AFTER.max_s,
        jitter=_set_or(ra, "jitter", _RETRY_AFTER.jitter),
    )
    if retry_after.min_s < 1.0:
        raise PolicyError("retry_after.min: must be at least 1s (Retry-After is whole seconds)")
    if retry_after.max_s < retry_after.min_s:
        raise PolicyError("retry_after.max: must not be below retry_after.min")
    if not 0 <= retry_after.jitter <= 10:
        raise PolicyError("retry_after.jitter: must be between 0 and 10")

    trusted_headers: list[str] = []
    for i, name in enumerate(msg.trusted_headers):
        if not _HEADER_NAME.match(name.lower()):
            raise PolicyError(f"trusted_headers[{i}]: {name!r} is not a valid header name")
        trusted_headers.append(name.lower())

    if not msg.buckets:
        raise PolicyError("buckets: at least one bucket is required")
    buckets: list[BucketPolicy] = []
    seen: set[str] = set()
    for i, b in enumerate(msg.buckets):
        where = f"buckets[{i}]"
        if not _NAME.match(b.name):
            raise PolicyError(
                f"{where}.name: {b.name!r} must be 1-63 characters of a-z, 0-9, '_' or '-'"
            )
        if b.name in seen:
            raise PolicyError(f"{where}.name: bucket {b.name!r} is defined twice")
        seen.add(b.name)
        if b.max_concurrency < 1:
            raise PolicyError(f"{where}.max_concurrency: must be at least 1")
        if not b.HasField("queue_timeout"):
            raise PolicyError(f"{where}.queue_timeout: required (e.g. 5s)")
        headers = []
        for name, value in sorted(b.match.headers.items()):
            if not _HEADER_NAME.match(name.lower()):
                raise PolicyError(f"{where}.match.headers: {name!r} is not a valid header name")
            headers.append((name.lower(), value))
        m = b.match
        match = MatchRule(
            headers=tuple(headers),
            max_prompt_tokens=m.max_prompt_tokens if m.HasField("max_prompt_tokens") else None,
            max_tokens=m.max_tokens if m.HasField("max_tokens") else None,
        )
        if b.trusted:
            untrusted = [name for name, _ in match.headers if name not in trusted_headers]
            if not match.headers or untrusted:
                raise PolicyError(
                    f"{where}.match.headers: bucket {b.name!r} is trusted, so it may match only "
                    "on headers listed in trusted_headers"
                    + (f" (not: {', '.join(untrusted)})" if untrusted else "")
                )
        if match.is_catch_all and i != len(msg.buckets) - 1:
            raise PolicyError(
                f"{where}: bucket {b.name!r} matches every request, so the buckets after it "
                "could never be chosen; put it last"
            )
        buckets.append(
            BucketPolicy(
                name=b.name,
                match=match,
                max_concurrency=b.max_concurrency,
                queue_timeout_s=_seconds(b.queue_timeout),
                max_queue=b.max_queue,
                trusted=b.trusted,
            )
        )
    if not buckets[-1].match.is_catch_all:
        raise PolicyError(
            f"buckets[{len(buckets) - 1}]: the last bucket must have no `match`, so that every "
            "request has a bucket"
        )
    return Policy(
        tokens=tokens,
        limits=limits,
        retry_after=retry_after,
        buckets=tuple(buckets),
        mode={policy_pb2.SHADOW: Mode.SHADOW, policy_pb2.ENFORCE: Mode.ENFORCE}.get(
            msg.mode, Mode.ENFORCE
        ),
        trusted_headers=tuple(trusted_headers),
    )


def route_override_from_mapping(data: object, policy: Policy) -> RouteOverride:
    """Validate route metadata (namespace ``llm_extproc``) against the RouteOverride schema
    and the policy it refines. Raises PolicyError naming the key."""
    msg = policy_pb2.RouteOverride()
    fill(msg, data, "")
    names = {b.name for b in policy.buckets}
    override = RouteOverride(
        bucket=msg.bucket or None,
        max_concurrency=_set_or(msg, "max_concurrency", None),
        max_queue=_set_or(msg, "max_queue", None),
        queue_timeout_s=_seconds(msg.queue_timeout) if msg.HasField("queue_timeout") else None,
        max_prompt_tokens=_set_or(msg, "max_prompt_tokens", None),
        max_output_tokens=_set_or(msg, "max_output_tokens", None),
        default_max_tokens=_set_or(msg, "default_max_tokens", None),
    )
    if override.bucket is not None and override.bucket not in names:
        raise PolicyError(
            f"bucket: {override.bucket!r} is not a bucket of the policy "
            f"(known: {', '.join(sorted(names))})"
        )
    if (override.max_concurrency is not None or override.max_queue is not None) and (
        override.bucket is None
    ):
        raise PolicyError("max_concurrency/max_queue: set `bucket` too, to say whose limits")
    if override.max_concurrency is not None and override.max_concurrency < 1:
        raise PolicyError("max_concurrency: must be at least 1")
    for name in ("max_prompt_tokens", "max_output_tokens", "default_max_tokens"):
        value = getattr(override, name)
        if value is not None and value < 1:
            raise PolicyError(f"{name}: must be at least 1")
    return override


def policy_from_mapping(data: object, source: str = "<policy>") -> Policy:
    """Validate and resolve a policy given as plain data (what YAML or JSON parse into)."""
    msg = policy_pb2.Policy()
    try:
        fill(msg, data, "")
        return _resolve(msg)
    except PolicyError as e:
        raise PolicyError(f"{source}: {e}") from None


def policy_from_yaml(text: str, source: str = "<policy>") -> Policy:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise PolicyError(f"{source}: not valid YAML: {e}") from None
    return policy_from_mapping({} if data is None else data, source)


def load_policy(path: str | Path) -> Policy:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyError(f"{p}: cannot read: {e}") from None
    return policy_from_yaml(text, str(p))
