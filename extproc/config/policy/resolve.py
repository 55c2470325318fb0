"""A policy file or route metadata -> the model, every default filled in, every rule checked.

``extproc.config.schema`` first reads the YAML data into the proto message (``Policy`` or
``RouteOverride``), checking every key and type. Each section of the message is then resolved
by a function of its own (``_tokens``, ``_limits``, ..., ``_pool``) that reads its defaults
from the model and checks the section's rules; ``_resolve`` calls them in the file's order and
hands each what it needs of the others (the trusted headers, whether there is a pool, the
backend's metrics). The first problem found is reported, naming the key path and the reason
(``buckets[1].queue_timeout: required (e.g. 5s)``); the public functions put the file first.

**A default follows the values the file set.** Where two keys of a section must be in order
(``default_max_tokens <= max_output_tokens``, ``retry_after.min <= max``, ...) and the file set
one of them, the other's default moves to meet it instead of contradicting it: ``limits:
{max_output_tokens: 64}`` alone gives ``default_max_tokens`` 64, not an error about the 256 the
file never wrote. The exception is a bound that protects the backend (``max_output_tokens``,
``pool.adaptive.max``): no other value raises it; a value above it is an error that names it as
the default. Two values the file set out of order are an error naming both and the fix
(``fields.conflict``). What follows what:

1. ``limits.default_max_tokens``: 256, or ``max_output_tokens`` when lower;
2. ``retry_after.max``: 60s, or ``min`` when higher;
3. ``pool.adaptive.min``: 4, or ``initial`` or ``max`` when lower; ``initial``: 32, moved into
   ``[min, max]``;
4. ``pool.adaptive.window``: 10s, or ``interval`` when longer; ``interval``: 500ms, or
   ``window`` when shorter;
5. ``pool.adaptive.fallback_after``: 30s, or ``stale_after`` when longer; ``stale_after``: 5s,
   or ``fallback_after`` when shorter;
6. ``pool.shared.timeout``: 250ms, or a quarter of ``lease`` when shorter; ``lease``: 10s, or
   four times ``timeout`` when longer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from extproc._proto.llm_extproc.v1 import policy_pb2
from extproc.config.policy.dump import duration as _duration
from extproc.config.policy.fields import conflict as _conflict
from extproc.config.policy.fields import default as _default
from extproc.config.policy.fields import duration_or as _duration_or
from extproc.config.policy.fields import header_name as _header_name
from extproc.config.policy.fields import set_or as _set_or
from extproc.config.policy.model import (
    AdaptivePolicy,
    BackendPolicy,
    BucketPolicy,
    ClientDeadlinePolicy,
    Limits,
    MatchRule,
    Mode,
    OnExcess,
    Order,
    OverloadPolicy,
    Policy,
    PoolPolicy,
    RetryAfterPolicy,
    RouteOverride,
    SharedPolicy,
    TokenPolicy,
)
from extproc.config.policy.tenant import tenant_policy
from extproc.config.schema import PolicyError, fill
from extproc.config.urls import UrlError, check_redis_url, http_url
from extproc.contract import APIS
from extproc.objectives import OBJECTIVES

__all__ = [
    "load_policy",
    "policy_from_mapping",
    "policy_from_yaml",
    "route_override_from_mapping",
]


_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_ORDERS = {policy_pb2.COST: Order.COST, policy_pb2.FAIR: Order.FAIR}
_KEY_PREFIX = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")


def _url(check: Callable[[str], object], url: str, where: str) -> None:
    """``check(url)`` (``extproc.config.urls``), its UrlError a PolicyError at ``where``."""
    try:
        check(url)
    except UrlError as e:
        raise PolicyError(f"{where}: {e}") from None


# --- the sections, in the file's order ------------------------------------------------------


def _tokens(msg: policy_pb2.Tokens) -> TokenPolicy:
    d = TokenPolicy()
    tokens = TokenPolicy(
        chars_per_token=_set_or(msg, "chars_per_token", d.chars_per_token),
        tokenizer=msg.tokenizer or d.tokenizer,
        non_text_part_tokens=_set_or(msg, "non_text_part_tokens", d.non_text_part_tokens),
        message_overhead_tokens=_set_or(msg, "message_overhead_tokens", d.message_overhead_tokens),
    )
    if tokens.chars_per_token <= 0:
        raise PolicyError("tokens.chars_per_token: must be greater than 0")
    if tokens.tokenizer and not Path(tokens.tokenizer).is_file():
        raise PolicyError(f"tokens.tokenizer: no such file {tokens.tokenizer!r}")
    return tokens


def _limits(msg: policy_pb2.Limits) -> Limits:
    d = Limits()
    max_output = _set_or(msg, "max_output_tokens", d.max_output_tokens)
    limits = Limits(
        max_prompt_tokens=_set_or(msg, "max_prompt_tokens", d.max_prompt_tokens),
        # Rule 1: unset, it follows the cap down (never the cap up: the cap protects the backend).
        default_max_tokens=_set_or(
            msg, "default_max_tokens", min(d.default_max_tokens, max_output)
        ),
        max_output_tokens=max_output,
        on_excess={policy_pb2.REJECT: OnExcess.REJECT, policy_pb2.CLAMP: OnExcess.CLAMP}.get(
            msg.on_excess, d.on_excess
        ),
        max_queued_bytes=_set_or(msg, "max_queued_bytes", d.max_queued_bytes),
        max_sequences=_set_or(msg, "max_sequences", d.max_sequences),
    )
    for name in ("max_prompt_tokens", "default_max_tokens", "max_output_tokens", "max_sequences"):
        if getattr(limits, name) < 1:
            raise PolicyError(f"limits.{name}: must be at least 1")
    if limits.default_max_tokens > limits.max_output_tokens:
        raise _conflict(
            msg,
            "limits",
            "default_max_tokens",
            str(limits.default_max_tokens),
            "above",
            "max_output_tokens",
            str(limits.max_output_tokens),
        )
    return limits


def _retry_after(msg: policy_pb2.RetryAfter) -> RetryAfterPolicy:
    d = RetryAfterPolicy()
    min_s = _duration_or(msg, "min", d.min_s)
    retry_after = RetryAfterPolicy(
        min_s=min_s,
        max_s=_duration_or(msg, "max", max(d.max_s, min_s)),  # rule 2
        jitter=_set_or(msg, "jitter", d.jitter),
    )
    for key, seconds in (("min", retry_after.min_s), ("max", retry_after.max_s)):
        if seconds < 1.0:
            raise PolicyError(
                f"retry_after.{key}: must be at least 1s (Retry-After is whole seconds)"
            )
    if retry_after.max_s < retry_after.min_s:
        raise _conflict(
            msg,
            "retry_after",
            "max",
            _duration(retry_after.max_s),
            "below",
            "min",
            _duration(retry_after.min_s),
        )
    if not 0 <= retry_after.jitter <= 10:
        raise PolicyError("retry_after.jitter: must be between 0 and 10")
    return retry_after


def _buckets(
    msgs: Sequence[policy_pb2.Bucket], *, pooled: bool, trusted_headers: tuple[str, ...]
) -> tuple[BucketPolicy, ...]:
    """The buckets, and the rules between them: names unique, one catch-all and it comes
    last, the guaranteed shares fit in the pool."""
    if not msgs:
        raise PolicyError("buckets: at least one bucket is required")
    buckets: list[BucketPolicy] = []
    seen: set[str] = set()
    for i, msg in enumerate(msgs):
        where = f"buckets[{i}]"
        if not _NAME.match(msg.name):
            raise PolicyError(
                f"{where}.name: {msg.name!r} must be 1-63 characters of a-z, 0-9, '_' or '-'"
            )
        if msg.name in seen:
            raise PolicyError(f"{where}.name: bucket {msg.name!r} is defined twice")
        seen.add(msg.name)
        bucket = _bucket(msg, where, pooled=pooled, trusted_headers=trusted_headers)
        if bucket.match.is_catch_all and i != len(msgs) - 1:
            raise PolicyError(
                f"{where}: bucket {bucket.name!r} matches every request, so the buckets after "
                "it could never be chosen; put it last"
            )
        buckets.append(bucket)
    if not buckets[-1].match.is_catch_all:
        raise PolicyError(
            f"buckets[{len(buckets) - 1}]: the last bucket must have no `match`, so that every "
            "request has a bucket"
        )
    if sum(b.min_share for b in buckets) > 1.0 + 1e-9:
        raise PolicyError("buckets: the min_share values add up to more than 1")
    _relegations(buckets)
    return tuple(buckets)


def _relegations(buckets: Sequence[BucketPolicy]) -> None:
    """Each ``relegate_to`` names another bucket of the pool, no more urgent, that does not
    relegate itself: a waiter is relegated once at most (no chains, no cycles)."""
    by_name = {b.name: b for b in buckets}
    for i, b in enumerate(buckets):
        if b.relegate_to is None:
            continue
        where, target = f"buckets[{i}].relegate_to", by_name.get(b.relegate_to)
        if target is None or target is b:
            raise PolicyError(
                f"{where}: {b.relegate_to!r} is not another bucket of the policy "
                f"(known: {', '.join(n for n in by_name if n != b.name)})"
            )
        if target.priority < b.priority:
            raise PolicyError(
                f"{where}: {target.name!r} is more urgent (priority {target.priority} < "
                f"{b.priority}); a waiter may only be relegated to its own band or a later one"
            )
        if target.relegate_to is not None:
            raise PolicyError(
                f"{where}: {target.name!r} relegates too (to {target.relegate_to!r}); a waiter "
                "is relegated once at most, so a bucket relegated to must not relegate"
            )


def _bucket(
    msg: policy_pb2.Bucket, where: str, *, pooled: bool, trusted_headers: tuple[str, ...]
) -> BucketPolicy:
    if not pooled:
        if msg.max_concurrency < 1:
            raise PolicyError(f"{where}.max_concurrency: must be at least 1 (or use a `pool`)")
        for name in ("priority", "min_share", "max_share"):
            if msg.HasField(name):
                raise PolicyError(f"{where}.{name}: needs a `pool` (the buckets' shared slots)")
        if msg.order != policy_pb2.ORDER_UNSPECIFIED or msg.HasField("tenant"):
            key = "order" if msg.order != policy_pb2.ORDER_UNSPECIFIED else "tenant"
            raise PolicyError(f"{where}.{key}: needs a `pool` (the buckets' shared slots)")
        if msg.relegate_to:
            raise PolicyError(f"{where}.relegate_to: needs a `pool` (the buckets' shared slots)")
    min_share = _set_or(msg, "min_share", _default(BucketPolicy, "min_share"))
    max_share = _set_or(msg, "max_share", _default(BucketPolicy, "max_share"))
    if not 0.0 <= min_share <= 1.0 or not 0.0 < max_share <= 1.0 or min_share > max_share:
        raise PolicyError(
            f"{where}: min_share and max_share must satisfy 0 <= min_share <= max_share <= 1 "
            f"and max_share > 0 (got {min_share:g}, {max_share:g})"
        )
    if not msg.HasField("queue_timeout"):
        raise PolicyError(f"{where}.queue_timeout: required (e.g. 5s)")
    match = _match(msg.match, f"{where}.match")
    tenant = tenant_policy(msg, where, trusted_headers)
    if msg.order == policy_pb2.FAIR and tenant is None:
        raise PolicyError(f"{where}.order: fair needs a `tenant` (who each request is for)")
    if msg.trusted:
        untrusted = [name for name, _ in match.headers if name not in trusted_headers]
        if not match.headers or untrusted:
            raise PolicyError(
                f"{where}.match.headers: bucket {msg.name!r} is trusted, so it may match only "
                "on headers listed in trusted_headers"
                + (f" (not: {', '.join(untrusted)})" if untrusted else "")
            )
    return BucketPolicy(
        name=msg.name,
        match=match,
        max_concurrency=msg.max_concurrency,
        queue_timeout_s=_duration_or(msg, "queue_timeout", 0.0),
        max_queue=msg.max_queue,
        trusted=msg.trusted,
        priority=_set_or(msg, "priority", _default(BucketPolicy, "priority")),
        min_share=min_share,
        max_share=max_share,
        order=_ORDERS.get(msg.order, _default(BucketPolicy, "order")),
        vllm_priority=_set_or(msg, "vllm_priority", _default(BucketPolicy, "vllm_priority")),
        tenant=tenant,
        relegate_to=msg.relegate_to or None,
    )


def _match(msg: policy_pb2.Match, where: str) -> MatchRule:
    return MatchRule(
        headers=tuple(
            (_header_name(name, f"{where}.headers"), value)
            for name, value in sorted(msg.headers.items())
        ),
        max_prompt_tokens=_set_or(msg, "max_prompt_tokens", None),
        max_tokens=_set_or(msg, "max_tokens", None),
        retried=_set_or(msg, "retried", None),
        models=tuple(msg.models),
    )


def _backend(msg: policy_pb2.Backend) -> BackendPolicy:
    for i, url in enumerate(msg.metrics):
        _url(http_url, url, f"backend.metrics[{i}]")
    timeout = _duration_or(msg, "scrape_timeout", BackendPolicy().scrape_timeout_s)
    if not 0 < timeout <= 10:
        raise PolicyError("backend.scrape_timeout: must be above 0 and at most 10s")
    return BackendPolicy(metrics=tuple(msg.metrics), scrape_timeout_s=timeout)


def _pool(msg: policy_pb2.Pool, backend: BackendPolicy) -> PoolPolicy:
    adaptive = _adaptive(msg.adaptive, backend) if msg.HasField("adaptive") else None
    if msg.HasField("max_concurrency"):
        limit = msg.max_concurrency
    elif adaptive is not None:
        limit = adaptive.initial
    else:
        raise PolicyError("pool.max_concurrency: required unless the pool is `adaptive`")
    if limit < 1:
        raise PolicyError("pool.max_concurrency: must be at least 1")
    tokens = _set_or(msg, "max_tokens_in_flight", _default(PoolPolicy, "max_tokens_in_flight"))
    if tokens is not None and tokens < 1:
        raise PolicyError("pool.max_tokens_in_flight: must be at least 1")
    overload = _overload(msg.overload)
    shared = _shared(msg.shared) if msg.HasField("shared") else None
    return PoolPolicy(
        max_concurrency=limit,
        max_tokens_in_flight=tokens,
        fail_fast=_set_or(msg, "fail_fast", _default(PoolPolicy, "fail_fast")),
        overload=overload,
        shared=shared,
        adaptive=adaptive,
    )


def _adaptive(msg: policy_pb2.Adaptive, backend: BackendPolicy) -> AdaptivePolicy:
    slo, d, where = msg.slo, AdaptivePolicy(), "pool.adaptive"
    for key in ("min", "initial", "max"):
        if msg.HasField(key) and getattr(msg, key) < 1:
            raise PolicyError(f"{where}.{key}: must be at least 1")
    if msg.HasField("window") and _duration_or(msg, "window", 0.0) < 0.05:
        raise PolicyError(f"{where}.window: must be at least 50ms (the shortest interval)")
    # Rules 3-5: the defaults follow what the file set (max never: it protects the backend).
    max_limit = _set_or(msg, "max", d.max_limit)
    initial_set = [msg.initial] if msg.HasField("initial") else []
    min_limit = _set_or(msg, "min", min(d.min_limit, max_limit, *initial_set))
    interval = _duration_or(msg, "interval", min(d.interval_s, _duration_or(msg, "window", 60.0)))
    stale_after = _duration_or(
        msg, "stale_after", min(d.stale_after_s, _duration_or(msg, "fallback_after", 60.0))
    )
    adaptive = AdaptivePolicy(
        min_limit=min_limit,
        max_limit=max_limit,
        initial=_set_or(msg, "initial", min(max(d.initial, min_limit), max_limit)),
        slo_s={o.name: _duration_or(slo, o.key, 0.0) for o in OBJECTIVES if slo.HasField(o.key)},
        quantiles={o.name: _set_or(slo, o.quantile_key, o.quantile) for o in OBJECTIVES},
        abandoned_max=_set_or(slo, "abandoned", d.abandoned_max),
        interval_s=interval,
        window_s=_duration_or(msg, "window", max(d.window_s, interval)),
        max_kv_usage=_set_or(msg, "max_kv_usage", d.max_kv_usage),
        stale_after_s=stale_after,
        fallback_after_s=_duration_or(msg, "fallback_after", max(d.fallback_after_s, stale_after)),
        queue_while_no_backend=_set_or(msg, "queue_while_no_backend", d.queue_while_no_backend),
    )
    low, initial, high = adaptive.min_limit, adaptive.initial, adaptive.max_limit
    if low > high:
        raise _conflict(msg, where, "min", str(low), "above", "max", str(high))
    if initial < low:
        raise _conflict(msg, where, "initial", str(initial), "below", "min", str(low))
    if initial > high:
        raise _conflict(msg, where, "initial", str(initial), "above", "max", str(high))
    if any(objective <= 0 for objective in adaptive.slo_s.values()):
        raise PolicyError("pool.adaptive.slo: an objective must be above 0")
    if any(not 0 < quantile < 1 for quantile in adaptive.quantiles.values()):
        raise PolicyError("pool.adaptive.slo: quantiles must be between 0 and 1")
    if adaptive.abandoned_max is not None and not 0 < adaptive.abandoned_max < 1:
        raise PolicyError("pool.adaptive.slo.abandoned: must be a share between 0 and 1")
    if not 0 < adaptive.max_kv_usage <= 1:
        raise PolicyError("pool.adaptive.max_kv_usage: must be in (0, 1]")
    if not 0.05 <= adaptive.interval_s <= 60:
        raise PolicyError("pool.adaptive.interval: must be between 50ms and 60s")
    if adaptive.window_s < adaptive.interval_s:
        window, every = _duration(adaptive.window_s), _duration(adaptive.interval_s)
        raise _conflict(msg, where, "window", window, "below", "interval", every)
    if adaptive.fallback_after_s < adaptive.stale_after_s:
        fallback, stale = _duration(adaptive.fallback_after_s), _duration(adaptive.stale_after_s)
        raise _conflict(msg, where, "fallback_after", fallback, "below", "stale_after", stale)
    if not backend.metrics:
        raise PolicyError(
            "pool.adaptive: needs backend.metrics (the vLLM /metrics URLs to read the limit from)"
        )
    return adaptive


def _overload(msg: policy_pb2.Overload) -> OverloadPolicy:
    d = OverloadPolicy()
    overload = OverloadPolicy(
        enabled=_set_or(msg, "enabled", d.enabled),
        tighten_eviction_rate=_set_or(msg, "tighten_eviction_rate", d.tighten_eviction_rate),
        step_hold_s=_duration_or(msg, "step_hold", d.step_hold_s),
        window_s=_duration_or(msg, "window", d.window_s),
    )
    if not 0 < overload.tighten_eviction_rate < 1:
        raise PolicyError("pool.overload.tighten_eviction_rate: must be between 0 and 1")
    if overload.window_s <= 0 or overload.step_hold_s <= 0:
        raise PolicyError("pool.overload: window and step_hold must be above 0")
    return overload


def _shared(msg: policy_pb2.Shared) -> SharedPolicy:
    d = SharedPolicy(redis="")
    # Rule 6: a renewal goes out every lease / 3, so a call must end well within that: the
    # timeout is at most a quarter of the lease, and whichever of the two is unset follows.
    timeout = _duration_or(msg, "timeout", None)
    lease = _duration_or(msg, "lease", max(d.lease_s, 4 * (timeout or 0.0)))
    if timeout is not None and timeout > 150:
        raise PolicyError(
            "pool.shared.timeout: must be at most 150s (a quarter of 10m, the longest lease)"
        )
    shared = SharedPolicy(
        redis=msg.redis,
        key_prefix=msg.key_prefix or d.key_prefix,
        lease_s=lease,
        timeout_s=timeout if timeout is not None else min(d.timeout_s, lease / 4),
        replicas=_set_or(msg, "replicas", d.replicas),
    )
    _url(check_redis_url, shared.redis, "pool.shared.redis")
    if not _KEY_PREFIX.match(shared.key_prefix):
        raise PolicyError(
            "pool.shared.key_prefix: 1-100 characters of A-Z, a-z, 0-9, '_', '.', ':' or '-'"
        )
    if not 0.5 <= shared.lease_s <= 600:
        raise PolicyError("pool.shared.lease: must be between 500ms and 10m")
    if shared.timeout_s <= 0:
        raise PolicyError("pool.shared.timeout: must be above 0")
    if shared.timeout_s > shared.lease_s / 4:  # both set: either follows the other
        timeout_text, lease_text = _duration(shared.timeout_s), _duration(shared.lease_s)
        raise PolicyError(
            f"pool.shared.timeout: {timeout_text} is above a quarter of pool.shared.lease "
            f"({lease_text}); set lease to at least {_duration(4 * shared.timeout_s)}, or "
            f"timeout to at most {_duration(shared.lease_s / 4)}"
        )
    if shared.replicas is not None and shared.replicas < 1:
        raise PolicyError("pool.shared.replicas: must be at least 1")
    return shared


def _client_deadline(msg: policy_pb2.ClientDeadline) -> ClientDeadlinePolicy:
    d = ClientDeadlinePolicy()
    where = "client_deadline.headers"
    headers = tuple(_header_name(h, f"{where}[{i}]") for i, h in enumerate(msg.headers))
    where = "client_deadline.seconds_headers"
    seconds = tuple(_header_name(h, f"{where}[{i}]") for i, h in enumerate(msg.seconds_headers))
    return ClientDeadlinePolicy(
        headers=headers or d.headers,
        seconds_headers=seconds or d.seconds_headers,
        margin_s=_duration_or(msg, "margin", d.margin_s),
    )


def _endpoints(names: Sequence[str]) -> tuple[str, ...]:
    if not names:
        return _default(Policy, "endpoints")  # type: ignore[no-any-return]
    for i, name in enumerate(names):
        if name not in APIS:
            raise PolicyError(f"endpoints[{i}]: {name!r} is not one of {', '.join(APIS)}")
    if len(set(names)) != len(names):
        raise PolicyError("endpoints: an API is listed twice")
    return tuple(names)


def _resolve(msg: policy_pb2.Policy) -> Policy:
    tokens = _tokens(msg.tokens)
    limits = _limits(msg.limits)
    retry_after = _retry_after(msg.retry_after)
    trusted_headers = tuple(
        _header_name(h, f"trusted_headers[{i}]") for i, h in enumerate(msg.trusted_headers)
    )
    pooled = msg.HasField("pool")
    buckets = _buckets(msg.buckets, pooled=pooled, trusted_headers=trusted_headers)
    backend = _backend(msg.backend)
    pool = _pool(msg.pool, backend) if pooled else None
    client_deadline = _client_deadline(msg.client_deadline)
    return Policy(
        mode=Mode.SHADOW if msg.mode == policy_pb2.SHADOW else _default(Policy, "mode"),
        endpoints=_endpoints(msg.endpoints),
        trusted_headers=trusted_headers,
        tokens=tokens,
        limits=limits,
        retry_after=retry_after,
        buckets=buckets,
        pool=pool,
        backend=backend,
        client_deadline=client_deadline,
    )


# --- the public entry points ----------------------------------------------------------------


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
        queue_timeout_s=_duration_or(msg, "queue_timeout", None),
        max_prompt_tokens=_set_or(msg, "max_prompt_tokens", None),
        max_output_tokens=_set_or(msg, "max_output_tokens", None),
        default_max_tokens=_set_or(msg, "default_max_tokens", None),
        timeout_s=_duration_or(msg, "timeout", None),
        model_buckets=tuple(sorted(msg.model_buckets.items())),
    )
    named = [("bucket", override.bucket)] if override.bucket is not None else []
    named += [(f"model_buckets[{m!r}]", b) for m, b in override.model_buckets]
    for key, bucket in named:
        if bucket not in names:
            raise PolicyError(
                f"{key}: {bucket!r} is not a bucket of the policy "
                f"(known: {', '.join(sorted(names))})"
            )
    if (override.max_concurrency is not None or override.max_queue is not None) and (
        override.bucket is None
    ):
        raise PolicyError("max_concurrency/max_queue: set `bucket` too, to say whose limits")
    if override.model_buckets and (
        override.max_concurrency is not None or override.max_queue is not None
    ):
        raise PolicyError(
            "model_buckets: not with max_concurrency/max_queue (a route's share is of `bucket`)"
        )
    if override.max_concurrency is not None and override.max_concurrency < 1:
        raise PolicyError("max_concurrency: must be at least 1")
    for name in ("max_prompt_tokens", "max_output_tokens", "default_max_tokens"):
        value = getattr(override, name)
        if value is not None and value < 1:
            raise PolicyError(f"{name}: must be at least 1")
    # One of the two alone follows the other (``classify.effective_limits``); both set out of
    # order is the route's own contradiction.
    default_max, max_output = override.default_max_tokens, override.max_output_tokens
    if default_max is not None and max_output is not None and default_max > max_output:
        raise _conflict(
            msg,
            "",
            "default_max_tokens",
            str(default_max),
            "above",
            "max_output_tokens",
            str(max_output),
        )
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
