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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import duration_pb2

from extproc._proto.llm_extproc.v1 import policy_pb2
from extproc.config.schema import PolicyError, fill, parse_duration

__all__ = [
    "AdaptivePolicy",
    "BackendPolicy",
    "BucketPolicy",
    "ClientDeadlinePolicy",
    "Limits",
    "MatchRule",
    "Mode",
    "OnExcess",
    "Order",
    "OverloadPolicy",
    "Policy",
    "PolicyError",
    "PoolPolicy",
    "RetryAfterPolicy",
    "RouteOverride",
    "SharedPolicy",
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


class Order(StrEnum):
    FIFO = "fifo"
    COST = "cost"


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
    # Without a pool: the bucket's slots (>= 1). With a pool: a cap on top of max_share, or 0.
    max_concurrency: int
    queue_timeout_s: float
    max_queue: int
    trusted: bool = False
    # With a pool (extproc.admission.core): band, guaranteed and largest share, queue order.
    priority: int = 0
    min_share: float = 0.0
    max_share: float = 1.0
    order: Order = Order.FIFO
    # Written into the forwarded body as `priority` (vLLM's --scheduling-policy priority).
    vllm_priority: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AdaptivePolicy:
    """The pool's limit from the backend's metrics (extproc.backend.adaptive)."""

    min_limit: int = 4
    max_limit: int = 512
    initial: int = 32
    ttft_slo_s: float | None = None
    ttft_quantile: float = 0.9
    itl_slo_s: float | None = None
    itl_quantile: float = 0.9
    interval_s: float = 0.5
    window_s: float = 10.0
    max_kv_usage: float = 0.9
    stale_after_s: float = 5.0
    fallback_after_s: float = 30.0


@dataclass(frozen=True, slots=True, kw_only=True)
class OverloadPolicy:
    """Staged recovery after overload (extproc.backend.overload)."""

    enabled: bool = True
    tighten_eviction_rate: float = 0.05
    step_hold_s: float = 120.0
    window_s: float = 30.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedPolicy:
    """One pool for several replicas, its slots leased from Redis (extproc.shared)."""

    redis: str
    key_prefix: str = "llm-extproc:pool"
    lease_s: float = 10.0
    timeout_s: float = 0.25
    # Before Redis was ever reached, each replica takes limit / replicas.
    replicas: int = 1

    @property
    def redis_display(self) -> str:
        """The URL without its password (for logs, /debug/queues and `check`)."""
        return re.sub(r"(?<=://)([^:@/]*):[^@/]*@", r"\1:***@", self.redis)


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolPolicy:
    """One pool per backend that the buckets draw from."""

    # Static limit; with `adaptive`, the fallback when the metrics are gone.
    max_concurrency: int
    max_tokens_in_flight: int | None = None
    fail_fast: bool = True
    adaptive: AdaptivePolicy | None = None
    overload: OverloadPolicy = field(default_factory=OverloadPolicy)
    # Absent: the pool is this sidecar's alone.
    shared: SharedPolicy | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendPolicy:
    metrics: tuple[str, ...] = ()
    scrape_timeout_s: float = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientDeadlinePolicy:
    headers: tuple[str, ...] = ("x-envoy-expected-rq-timeout-ms",)
    margin_s: float = 0.5


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
    # The route's own timeout: caps the queue deadline of the route's requests.
    timeout_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    tokens: TokenPolicy = field(default_factory=TokenPolicy)
    limits: Limits = field(default_factory=Limits)
    retry_after: RetryAfterPolicy = field(default_factory=RetryAfterPolicy)
    buckets: tuple[BucketPolicy, ...]
    mode: Mode = Mode.ENFORCE
    trusted_headers: tuple[str, ...] = ()
    pool: PoolPolicy | None = None
    backend: BackendPolicy = field(default_factory=BackendPolicy)
    client_deadline: ClientDeadlinePolicy = field(default_factory=ClientDeadlinePolicy)

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
                    **(
                        {
                            "priority": b.priority,
                            "min_share": b.min_share,
                            "max_share": b.max_share,
                            "order": str(b.order),
                        }
                        if self.pool is not None
                        else {}
                    ),
                    **({"vllm_priority": b.vllm_priority} if b.vllm_priority is not None else {}),
                }
                for b in self.buckets
            ],
            **({"pool": self._pool_dict(self.pool, duration)} if self.pool is not None else {}),
            "backend": {
                "metrics": list(self.backend.metrics),
                "scrape_timeout": duration(self.backend.scrape_timeout_s),
            },
            "client_deadline": {
                "headers": list(self.client_deadline.headers),
                "margin": duration(self.client_deadline.margin_s),
            },
        }

    @staticmethod
    def _pool_dict(pool: PoolPolicy, duration: Callable[[float], str]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "max_concurrency": pool.max_concurrency,
            "max_tokens_in_flight": pool.max_tokens_in_flight,
            "fail_fast": pool.fail_fast,
            "overload": {
                "enabled": pool.overload.enabled,
                "tighten_eviction_rate": pool.overload.tighten_eviction_rate,
                "step_hold": duration(pool.overload.step_hold_s),
                "window": duration(pool.overload.window_s),
            },
        }
        s = pool.shared
        if s is not None:
            out["shared"] = {
                "redis": s.redis_display,
                "key_prefix": s.key_prefix,
                "lease": duration(s.lease_s),
                "timeout": duration(s.timeout_s),
                "replicas": s.replicas,
            }
        a = pool.adaptive
        if a is not None:
            slo: dict[str, Any] = {}
            if a.ttft_slo_s is not None:
                slo.update(ttft=duration(a.ttft_slo_s), ttft_quantile=a.ttft_quantile)
            if a.itl_slo_s is not None:
                slo.update(inter_token=duration(a.itl_slo_s), inter_token_quantile=a.itl_quantile)
            out["adaptive"] = {
                "min": a.min_limit,
                "max": a.max_limit,
                "initial": a.initial,
                "slo": slo,
                "interval": duration(a.interval_s),
                "window": duration(a.window_s),
                "max_kv_usage": a.max_kv_usage,
                "stale_after": duration(a.stale_after_s),
                "fallback_after": duration(a.fallback_after_s),
            }
        return out


# --- resolving the message into the policy --------------------------------------------------

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9a-z-]+$")


# Each default is written once, in the dataclasses above; these instances are where
# resolving reads them from.
_TOKENS, _LIMITS, _RETRY_AFTER = TokenPolicy(), Limits(), RetryAfterPolicy()
_ADAPTIVE, _OVERLOAD, _BACKEND = AdaptivePolicy(), OverloadPolicy(), BackendPolicy()
_SHARED = SharedPolicy(redis="")
_DEADLINE = ClientDeadlinePolicy()


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
        if b.max_concurrency < 1 and not msg.HasField("pool"):
            raise PolicyError(f"{where}.max_concurrency: must be at least 1 (or use a `pool`)")
        if not msg.HasField("pool"):
            for name in ("priority", "min_share", "max_share"):
                if b.HasField(name):
                    raise PolicyError(f"{where}.{name}: needs a `pool` (the buckets' shared slots)")
            if b.order != policy_pb2.ORDER_UNSPECIFIED:
                raise PolicyError(f"{where}.order: needs a `pool` (the buckets' shared slots)")
        min_share = _set_or(b, "min_share", 0.0)
        max_share = _set_or(b, "max_share", 1.0)
        if not 0.0 <= min_share <= 1.0 or not 0.0 < max_share <= 1.0 or min_share > max_share:
            raise PolicyError(
                f"{where}: min_share and max_share must satisfy 0 <= min_share <= max_share <= 1 "
                f"and max_share > 0 (got {min_share:g}, {max_share:g})"
            )
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
                priority=_set_or(b, "priority", 0),
                min_share=min_share,
                max_share=max_share,
                order=Order.COST if b.order == policy_pb2.COST else Order.FIFO,
                vllm_priority=_set_or(b, "vllm_priority", None),
            )
        )
    if not buckets[-1].match.is_catch_all:
        raise PolicyError(
            f"buckets[{len(buckets) - 1}]: the last bucket must have no `match`, so that every "
            "request has a bucket"
        )
    if sum(b.min_share for b in buckets) > 1.0 + 1e-9:
        raise PolicyError("buckets: the min_share values add up to more than 1")
    backend = _resolve_backend(msg.backend)
    pool = _resolve_pool(msg.pool, backend) if msg.HasField("pool") else None
    cd = msg.client_deadline
    deadline_headers: list[str] = []
    for i, name in enumerate(cd.headers):
        if not _HEADER_NAME.match(name.lower()):
            raise PolicyError(f"client_deadline.headers[{i}]: {name!r} is not a valid header name")
        deadline_headers.append(name.lower())
    client_deadline = ClientDeadlinePolicy(
        headers=tuple(deadline_headers) if cd.headers else _DEADLINE.headers,
        margin_s=_seconds(cd.margin) if cd.HasField("margin") else _DEADLINE.margin_s,
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
        pool=pool,
        backend=backend,
        client_deadline=client_deadline,
    )


def _duration_or(msg: Any, name: str, default: float) -> float:
    return _seconds(getattr(msg, name)) if msg.HasField(name) else default


def _resolve_backend(msg: policy_pb2.Backend) -> BackendPolicy:
    for i, url in enumerate(msg.metrics):
        if not re.match(r"^http://[^/\s:]+(:\d{1,5})?(/\S*)?$", url):
            raise PolicyError(
                f"backend.metrics[{i}]: {url!r} must be http://host[:port][/path] (plain HTTP)"
            )
    timeout = _duration_or(msg, "scrape_timeout", _BACKEND.scrape_timeout_s)
    if not 0 < timeout <= 10:
        raise PolicyError("backend.scrape_timeout: must be above 0 and at most 10s")
    return BackendPolicy(metrics=tuple(msg.metrics), scrape_timeout_s=timeout)


def _resolve_pool(msg: policy_pb2.Pool, backend: BackendPolicy) -> PoolPolicy:
    adaptive: AdaptivePolicy | None = None
    if msg.HasField("adaptive"):
        a, slo, d = msg.adaptive, msg.adaptive.slo, _ADAPTIVE
        adaptive = AdaptivePolicy(
            min_limit=_set_or(a, "min", d.min_limit),
            max_limit=_set_or(a, "max", d.max_limit),
            initial=_set_or(a, "initial", d.initial),
            ttft_slo_s=_seconds(slo.ttft) if slo.HasField("ttft") else None,
            ttft_quantile=_set_or(slo, "ttft_quantile", d.ttft_quantile),
            itl_slo_s=_seconds(slo.inter_token) if slo.HasField("inter_token") else None,
            itl_quantile=_set_or(slo, "inter_token_quantile", d.itl_quantile),
            interval_s=_duration_or(a, "interval", d.interval_s),
            window_s=_duration_or(a, "window", d.window_s),
            max_kv_usage=_set_or(a, "max_kv_usage", d.max_kv_usage),
            stale_after_s=_duration_or(a, "stale_after", d.stale_after_s),
            fallback_after_s=_duration_or(a, "fallback_after", d.fallback_after_s),
        )
        if not 1 <= adaptive.min_limit <= adaptive.initial <= adaptive.max_limit:
            raise PolicyError("pool.adaptive: need 1 <= min <= initial <= max")
        for name in ("ttft_slo_s", "itl_slo_s"):
            value = getattr(adaptive, name)
            if value is not None and value <= 0:
                raise PolicyError("pool.adaptive.slo: an objective must be above 0")
        for name in ("ttft_quantile", "itl_quantile"):
            if not 0 < getattr(adaptive, name) < 1:
                raise PolicyError("pool.adaptive.slo: quantiles must be between 0 and 1")
        if not 0 < adaptive.max_kv_usage <= 1:
            raise PolicyError("pool.adaptive.max_kv_usage: must be in (0, 1]")
        if not 0.05 <= adaptive.interval_s <= 60:
            raise PolicyError("pool.adaptive.interval: must be between 50ms and 60s")
        if adaptive.window_s < adaptive.interval_s:
            raise PolicyError("pool.adaptive.window: must not be shorter than the interval")
        if adaptive.fallback_after_s < adaptive.stale_after_s:
            raise PolicyError("pool.adaptive.fallback_after: must not be below stale_after")
        if not backend.metrics:
            raise PolicyError(
                "pool.adaptive: needs backend.metrics (the vLLM /metrics URLs to read the "
                "limit from)"
            )
    if msg.HasField("max_concurrency"):
        limit = msg.max_concurrency
    elif adaptive is not None:
        limit = adaptive.initial
    else:
        raise PolicyError("pool.max_concurrency: required unless the pool is `adaptive`")
    if limit < 1:
        raise PolicyError("pool.max_concurrency: must be at least 1")
    tokens = _set_or(msg, "max_tokens_in_flight", None)
    if tokens is not None and tokens < 1:
        raise PolicyError("pool.max_tokens_in_flight: must be at least 1")
    o, d_o = msg.overload, _OVERLOAD
    overload = OverloadPolicy(
        enabled=_set_or(o, "enabled", d_o.enabled),
        tighten_eviction_rate=_set_or(o, "tighten_eviction_rate", d_o.tighten_eviction_rate),
        step_hold_s=_duration_or(o, "step_hold", d_o.step_hold_s),
        window_s=_duration_or(o, "window", d_o.window_s),
    )
    if not 0 < overload.tighten_eviction_rate < 1:
        raise PolicyError("pool.overload.tighten_eviction_rate: must be between 0 and 1")
    if overload.window_s <= 0 or overload.step_hold_s <= 0:
        raise PolicyError("pool.overload: window and step_hold must be above 0")
    return PoolPolicy(
        max_concurrency=limit,
        max_tokens_in_flight=tokens,
        fail_fast=_set_or(msg, "fail_fast", True),
        adaptive=adaptive,
        overload=overload,
        shared=_resolve_shared(msg.shared) if msg.HasField("shared") else None,
    )


_REDIS_URL = re.compile(r"^(rediss?://[^\s/]*(/\d{1,5})?|unix:///\S+)$")
_KEY_PREFIX = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")


def _resolve_shared(msg: policy_pb2.Shared) -> SharedPolicy:
    d = _SHARED
    shared = SharedPolicy(
        redis=msg.redis,
        key_prefix=msg.key_prefix or d.key_prefix,
        lease_s=_duration_or(msg, "lease", d.lease_s),
        timeout_s=_duration_or(msg, "timeout", d.timeout_s),
        replicas=_set_or(msg, "replicas", d.replicas),
    )
    if not _REDIS_URL.match(shared.redis):
        raise PolicyError(
            f"pool.shared.redis: {shared.redis_display!r} must be redis://host[:port][/db], "
            "rediss://... or unix:///path"
        )
    if not _KEY_PREFIX.match(shared.key_prefix):
        raise PolicyError(
            "pool.shared.key_prefix: 1-100 characters of A-Z, a-z, 0-9, '_', '.', ':' or '-'"
        )
    if not 0.5 <= shared.lease_s <= 600:
        raise PolicyError("pool.shared.lease: must be between 500ms and 10m")
    # A renewal goes out every lease / 3: a call must end well within that.
    if not 0 < shared.timeout_s <= shared.lease_s / 4:
        raise PolicyError("pool.shared.timeout: must be above 0 and at most a quarter of the lease")
    if shared.replicas < 1:
        raise PolicyError("pool.shared.replicas: must be at least 1")
    return shared


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
        timeout_s=_seconds(msg.timeout) if msg.HasField("timeout") else None,
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
