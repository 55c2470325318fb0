"""A policy file or route metadata -> the model, every default filled in, every rule checked.

``extproc.config.schema`` first reads the YAML data into the proto message (``Policy`` or
``RouteOverride``), checking every key and type. Each section of the message is then resolved
by a function of its own (``_tokens``, ``_limits``, ...; the buckets in ``buckets``, each
bucket's tenants in ``tenant``, the backend and the pool in ``pool``) that reads its defaults
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

from collections.abc import Sequence
from pathlib import Path

import yaml

from extproc._proto.llm_extproc.v1 import policy_pb2
from extproc.config.policy.buckets import bucket_policies
from extproc.config.policy.dump import duration as _duration
from extproc.config.policy.fields import conflict as _conflict
from extproc.config.policy.fields import default as _default
from extproc.config.policy.fields import duration_or as _duration_or
from extproc.config.policy.fields import header_name as _header_name
from extproc.config.policy.fields import set_or as _set_or
from extproc.config.policy.model import (
    ClientDeadlinePolicy,
    Limits,
    Mode,
    OnExcess,
    Policy,
    RetryAfterPolicy,
    RouteOverride,
    TokenPolicy,
)
from extproc.config.policy.pool import backend_policy, pool_policy
from extproc.config.schema import PolicyError, fill
from extproc.contract import APIS

__all__ = [
    "load_policy",
    "policy_from_mapping",
    "policy_from_yaml",
    "route_override_from_mapping",
]


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
    buckets = bucket_policies(msg.buckets, pooled=pooled, trusted_headers=trusted_headers)
    backend = backend_policy(msg.backend)
    pool = pool_policy(msg.pool, backend) if pooled else None
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
