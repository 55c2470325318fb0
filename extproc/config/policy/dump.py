"""The resolved policy in the policy file's own shape: what ``llm-extproc check`` prints.

Each section is its dataclass's fields, in order, so a field added to the model is printed
without an edit here. A field's key in the file is its name, with the ``_s`` of a duration
taken off (the value printed as ``250ms`` below a second, ``5s`` from one up), unless
``_KEYS`` gives another key path (the adaptive limit's names and its ``slo`` section). Left
out:

1. a value that is None (unset), except the ones in ``_NULL_SHOWN``, printed as null;
2. a bucket's pool settings (priority, shares, order, tenant, relegate_to) when there is no
   pool: a file without one may not state them;
3. an SLO quantile whose objective is unset;
4. a match's headers when it has none, a tenant's weights and ``authorization`` unless set
   (``_SHOWN_AS``, which also prints the Redis URL with
   its passwords masked, ``extproc.config.urls.redact``).

What is printed is itself a policy file that resolves to the same policy
(tests/unit/test_policy.py, ``test_round_trip_of_check_output``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any, Final

from extproc.config.policy.model import (
    BucketPolicy,
    MatchRule,
    Policy,
    SharedPolicy,
    TenantPolicy,
)

__all__ = ["duration", "policy_to_dict"]

# Fields whose key in the file is not their own name (a path: the first keys name sections).
_KEYS: Final[Mapping[str, tuple[str, ...]]] = {
    "min_limit": ("min",),
    "max_limit": ("max",),
    "ttft_slo_s": ("slo", "ttft"),
    "ttft_quantile": ("slo", "ttft_quantile"),
    "itl_slo_s": ("slo", "inter_token"),
    "itl_quantile": ("slo", "inter_token_quantile"),
    "tpot_slo_s": ("slo", "tpot"),
    "tpot_quantile": ("slo", "tpot_quantile"),
    "queue_time_slo_s": ("slo", "queue_time"),
    "queue_time_quantile": ("slo", "queue_time_quantile"),
    "abandoned_max": ("slo", "abandoned"),
}
# A quantile is printed only beside its objective.
_SHOWN_WITH: Final[Mapping[str, str]] = {
    "ttft_quantile": "ttft_slo_s",
    "itl_quantile": "itl_slo_s",
    "tpot_quantile": "tpot_slo_s",
    "queue_time_quantile": "queue_time_slo_s",
}
_NULL_SHOWN: Final = frozenset({"tokenizer", "max_tokens_in_flight"})
_POOL_ONLY: Final = frozenset(
    {"priority", "min_share", "max_share", "order", "tenant", "relegate_to"}
)
# Values printed as something other than the field's own value (None: left out).
_SHOWN_AS: Final[Mapping[tuple[type, str], Callable[[Any], object]]] = {
    (MatchRule, "headers"): lambda match: dict(match.headers) or None,
    (MatchRule, "models"): lambda match: list(match.models) or None,
    (SharedPolicy, "redis"): lambda shared: shared.redis_display,
    (TenantPolicy, "weights"): lambda tenant: dict(tenant.weights) or None,
    (TenantPolicy, "authorization"): lambda tenant: tenant.authorization or None,
}


def duration(seconds: float) -> str:
    """Seconds as the file writes them: ``250ms``, ``5s``, ``120s``."""
    return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"


def policy_to_dict(policy: Policy) -> dict[str, Any]:
    """The resolved policy as plain data in the file's shape (``yaml.safe_dump`` prints it)."""
    return _section(policy, pooled=policy.pool is not None)


def _section(obj: Any, *, pooled: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(obj):
        name = f.name
        *sections, key = _KEYS.get(name) or (name.removesuffix("_s"),)
        target = out
        for section in sections:
            target = target.setdefault(section, {})
        if not pooled and name in _POOL_ONLY and isinstance(obj, BucketPolicy):
            continue
        if name in _SHOWN_WITH and getattr(obj, _SHOWN_WITH[name]) is None:
            continue
        shown_as = _SHOWN_AS.get((type(obj), name))
        value = getattr(obj, name) if shown_as is None else shown_as(obj)
        if value is None:
            if name in _NULL_SHOWN:
                target[key] = None
            continue
        if name.endswith("_s") and isinstance(value, (int, float)):
            target[key] = duration(value)
        else:
            target[key] = _value(value, pooled)
    return out


def _value(value: object, pooled: bool) -> object:
    if is_dataclass(value):
        return _section(value, pooled=pooled)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return [_value(v, pooled) for v in value]
    return value
