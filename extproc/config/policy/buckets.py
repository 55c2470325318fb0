"""The ``buckets`` section -> ``BucketPolicy`` per bucket, each bucket's rules and the rules
between them checked (names unique, one catch-all and last, the guaranteed shares fit in the
pool, relegations lead somewhere); a bucket's ``tenant`` section is ``tenant``'s.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from extproc._proto.llm_extproc.v1 import policy_pb2
from extproc.config.policy.fields import default as _default
from extproc.config.policy.fields import duration_or as _duration_or
from extproc.config.policy.fields import header_name as _header_name
from extproc.config.policy.fields import set_or as _set_or
from extproc.config.policy.model import BucketPolicy, MatchRule, Order
from extproc.config.policy.tenant import tenant_policy
from extproc.config.schema import PolicyError

__all__ = ["bucket_policies"]

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_ORDERS = {policy_pb2.COST: Order.COST, policy_pb2.FAIR: Order.FAIR}


def bucket_policies(
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
