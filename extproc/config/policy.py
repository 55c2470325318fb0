"""The admission policy: load, validate, resolve.

The schema is defined once, as proto3 messages in ``protos/llm_extproc/v1/policy.proto``. A policy
file is YAML; it is read into the ``Policy`` message by a small walker driven by the message
descriptors, so every key is checked against the schema and every error names the file, the key
path and the reason (``policy.yaml: buckets[1].queue_timeout: bad duration '5x' ...``). The walker
accepts what operators write (durations as ``250ms``/``5s``/``2m``, enum values in lower case) and
nothing the schema does not know. The same walker will validate per-route overrides that arrive
from Envoy route metadata.

The message is then resolved into frozen dataclasses with every default filled in and every
cross-field rule checked (bucket names unique, a catch-all bucket last, ...). The request path
reads only the resolved ``Policy``; it never touches protobuf.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import descriptor as _descriptor
from google.protobuf import duration_pb2
from google.protobuf.message import Message

from extproc._proto.llm_extproc.v1 import policy_pb2

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


class PolicyError(ValueError):
    """A policy that cannot be used. The message names the source, the key path and why."""


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


# --- durations ------------------------------------------------------------------------------

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*(ms|s|m|h)\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: object) -> float:
    """``250ms``, ``5s``, ``1.5s``, ``2m``, ``1h`` or a plain number of seconds -> seconds."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 250ms, 5s or 2m, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        m = _DURATION.match(value)
        if m is None:
            raise ValueError(f"bad duration {value!r}: expected a number with ms, s, m or h")
        seconds = float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    else:
        raise ValueError(f"expected a duration like 250ms, 5s or 2m, got {type(value).__name__}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"bad duration {value!r}: must be finite and not negative")
    if seconds > 10 * 365 * 86400:
        raise ValueError(f"bad duration {value!r}: longer than ten years")
    return seconds


# --- the descriptor-driven walker -----------------------------------------------------------

_FD = _descriptor.FieldDescriptor
_DURATION_TYPE = "google.protobuf.Duration"
_INT_RANGES = {
    _FD.TYPE_UINT32: (0, 2**32 - 1),
    _FD.TYPE_UINT64: (0, 2**64 - 1),
    _FD.TYPE_INT32: (-(2**31), 2**31 - 1),
    _FD.TYPE_INT64: (-(2**63), 2**63 - 1),
}


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _scalar(fd: Any, value: object, path: str) -> object:
    """Check one YAML scalar against a proto scalar field and convert it."""
    if fd.type in _INT_RANGES:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise PolicyError(f"{path}: expected an integer, got {_type_name(value)} {value!r}")
        lo, hi = _INT_RANGES[fd.type]
        if not lo <= value <= hi:
            raise PolicyError(f"{path}: {value} is out of range [{lo}, {hi}]")
        return value
    if fd.type in (_FD.TYPE_DOUBLE, _FD.TYPE_FLOAT):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PolicyError(f"{path}: expected a number, got {_type_name(value)} {value!r}")
        if not math.isfinite(value):
            raise PolicyError(f"{path}: expected a finite number, got {value!r}")
        return float(value)
    if fd.type == _FD.TYPE_STRING:
        if not isinstance(value, str):
            raise PolicyError(f"{path}: expected a string, got {_type_name(value)} {value!r}")
        return value
    if fd.type == _FD.TYPE_BOOL:
        if not isinstance(value, bool):
            raise PolicyError(f"{path}: expected true or false, got {value!r}")
        return value
    if fd.type == _FD.TYPE_ENUM:
        names = [v.name.lower() for v in fd.enum_type.values if v.number != 0]
        if not isinstance(value, str) or value.lower() not in names:
            raise PolicyError(f"{path}: expected one of {', '.join(names)}, got {value!r}")
        return fd.enum_type.values_by_name[value.upper()].number
    raise PolicyError(f"{path}: unsupported field type {fd.type}")  # pragma: no cover


def _fill(message: Message, data: object, path: str) -> None:
    """Fill ``message`` from a YAML mapping, checking every key against the descriptor."""
    desc = message.DESCRIPTOR
    if desc.full_name == _DURATION_TYPE:
        raise AssertionError("durations are handled by the caller")  # pragma: no cover
    if not isinstance(data, Mapping):
        raise PolicyError(f"{path or '<top>'}: expected a mapping, got {_type_name(data)}")
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        fd = desc.fields_by_name.get(key) if isinstance(key, str) else None
        if fd is None:
            known = ", ".join(f.name for f in desc.fields)
            raise PolicyError(f"{where}: unknown key (known keys: {known})")
        if value is None:
            continue  # YAML null: leave the field unset, so its default applies
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            _fill_map(getattr(message, fd.name), fd.message_type, value, where)
        elif fd.is_repeated:
            if not isinstance(value, list):
                raise PolicyError(f"{where}: expected a list, got {_type_name(value)}")
            target = getattr(message, fd.name)
            for i, item in enumerate(value):
                if fd.message_type is not None:
                    _fill(target.add(), item, f"{where}[{i}]")
                else:
                    target.append(_scalar(fd, item, f"{where}[{i}]"))
        elif fd.message_type is not None and fd.message_type.full_name == _DURATION_TYPE:
            try:
                seconds = parse_duration(value)
            except ValueError as e:
                raise PolicyError(f"{where}: {e}") from None
            d = duration_pb2.Duration()
            d.FromNanoseconds(round(seconds * 1e9))
            getattr(message, fd.name).CopyFrom(d)
        elif fd.message_type is not None:
            sub = getattr(message, fd.name)
            sub.SetInParent()
            _fill(sub, value, where)
        else:
            setattr(message, fd.name, _scalar(fd, value, where))


def _fill_map(target: Any, entry: Any, data: object, path: str) -> None:
    if not isinstance(data, Mapping):
        raise PolicyError(f"{path}: expected a mapping, got {_type_name(data)}")
    key_fd, value_fd = entry.fields_by_name["key"], entry.fields_by_name["value"]
    for key, value in data.items():
        k = _scalar(key_fd, key, f"{path} key")
        target[k] = _scalar(value_fd, value, f"{path}.{key}")


# --- resolving the message into the policy --------------------------------------------------

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9a-z-]+$")


def _seconds(d: duration_pb2.Duration) -> float:
    return float(d.ToNanoseconds()) / 1e9


def _resolve(msg: policy_pb2.Policy) -> Policy:
    t = msg.tokens
    tokens = TokenPolicy(
        chars_per_token=t.chars_per_token if t.HasField("chars_per_token") else 4.0,
        tokenizer=t.tokenizer or None,
        non_text_part_tokens=(
            t.non_text_part_tokens if t.HasField("non_text_part_tokens") else 512
        ),
        message_overhead_tokens=(
            t.message_overhead_tokens if t.HasField("message_overhead_tokens") else 3
        ),
    )
    if tokens.chars_per_token <= 0:
        raise PolicyError("tokens.chars_per_token: must be greater than 0")
    if tokens.tokenizer and not Path(tokens.tokenizer).is_file():
        raise PolicyError(f"tokens.tokenizer: no such file {tokens.tokenizer!r}")

    lm = msg.limits
    limits = Limits(
        max_prompt_tokens=lm.max_prompt_tokens if lm.HasField("max_prompt_tokens") else 32768,
        default_max_tokens=lm.default_max_tokens if lm.HasField("default_max_tokens") else 256,
        max_output_tokens=lm.max_output_tokens if lm.HasField("max_output_tokens") else 1024,
        on_excess=OnExcess.REJECT if lm.on_excess == policy_pb2.REJECT else OnExcess.CLAMP,
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
        min_s=_seconds(ra.min) if ra.HasField("min") else 1.0,
        max_s=_seconds(ra.max) if ra.HasField("max") else 60.0,
        jitter=ra.jitter if ra.HasField("jitter") else 0.5,
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
        mode=Mode.SHADOW if msg.mode == policy_pb2.SHADOW else Mode.ENFORCE,
        trusted_headers=tuple(trusted_headers),
    )


def _opt(msg: Any, name: str) -> Any:
    return getattr(msg, name) if msg.HasField(name) else None


def route_override_from_mapping(data: object, policy: Policy) -> RouteOverride:
    """Validate route metadata (namespace ``llm_extproc``) against the RouteOverride schema
    and the policy it refines. Raises PolicyError naming the key."""
    msg = policy_pb2.RouteOverride()
    _fill(msg, data, "")
    names = {b.name for b in policy.buckets}
    override = RouteOverride(
        bucket=msg.bucket or None,
        max_concurrency=_opt(msg, "max_concurrency"),
        max_queue=_opt(msg, "max_queue"),
        queue_timeout_s=_seconds(msg.queue_timeout) if msg.HasField("queue_timeout") else None,
        max_prompt_tokens=_opt(msg, "max_prompt_tokens"),
        max_output_tokens=_opt(msg, "max_output_tokens"),
        default_max_tokens=_opt(msg, "default_max_tokens"),
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
        _fill(msg, data, "")
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
