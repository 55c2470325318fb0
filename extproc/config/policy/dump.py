"""The resolved policy in the policy file's own shape: what ``llm-extproc check`` prints.

Each section is its dataclass's fields, in order, so a field added to the model is printed
without an edit here. A field's key in the file is its name, with the ``_s`` of a duration
taken off (the value printed as ``250ms`` below a second, ``5s`` from one up), unless
``_KEYS`` gives another key path (the adaptive limit's names and its ``slo`` section: each
latency objective's keys, ``extproc.objectives``, in the table's order). Left out:

1. a value that is None (unset), except the ones in ``_NULL_SHOWN``, printed as null;
2. a bucket's pool settings (priority, shares, order, tenant, relegate_to) when there is no
   pool: a file without one may not state them;
3. a latency objective's quantile when the objective is unset;
4. a match's headers when it has none, a tenant's weights and ``authorization`` unless set
   (``_SHOWN_AS``, which also prints the objectives, and the Redis URL with
   its passwords masked, ``extproc.config.urls.redact``).

What is printed is itself a policy file that resolves to the same policy
(tests/unit/test_policy.py, ``test_round_trip_of_check_output``).

The model's ``Policy.to_dict`` calls this module, so it does not import the model back: it
walks any dataclass, and its rules name a model class by its name (``_SHOWN_AS``, ``_BUCKET``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any, Final

from extproc.objectives import OBJECTIVES

__all__ = ["duration", "policy_to_dict"]

# Fields whose key in the file is not their own name (a path: the first keys name sections).
_KEYS: Final[Mapping[str, tuple[str, ...]]] = {
    "min_limit": ("min",),
    "max_limit": ("max",),
    "slo_s": ("slo",),
    "abandoned_max": ("slo", "abandoned"),
}
_NULL_SHOWN: Final = frozenset({"tokenizer", "max_tokens_in_flight"})
_POOL_ONLY: Final = frozenset(
    {"priority", "min_share", "max_share", "order", "tenant", "relegate_to"}
)
_BUCKET: Final = "BucketPolicy"  # the class whose ``_POOL_ONLY`` fields they are


def _objectives(adaptive: Any) -> dict[str, object]:
    """Each latency objective set, and its quantile beside it (rule 3)."""
    out: dict[str, object] = {}
    for o in OBJECTIVES:
        if o.name in adaptive.slo_s:
            seconds, quantile = adaptive.slo_s[o.name], adaptive.quantiles[o.name]
            out |= {o.key: duration(seconds), o.quantile_key: quantile}
    return out


# Values printed as something other than the field's own value (None: left out), by the
# model's class name and the field's.
_SHOWN_AS: Final[Mapping[tuple[str, str], Callable[[Any], object]]] = {
    ("AdaptivePolicy", "slo_s"): _objectives,
    ("AdaptivePolicy", "quantiles"): lambda adaptive: None,  # beside their objectives
    ("MatchRule", "headers"): lambda match: dict(match.headers) or None,
    ("MatchRule", "models"): lambda match: list(match.models) or None,
    ("SharedPolicy", "redis"): lambda shared: shared.redis_display,
    ("TenantPolicy", "weights"): lambda tenant: dict(tenant.weights) or None,
    ("TenantPolicy", "authorization"): lambda tenant: tenant.authorization or None,
}


def duration(seconds: float) -> str:
    """Seconds as the file writes them: ``250ms``, ``5s``, ``120s``."""
    return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"


def policy_to_dict(policy: Any) -> dict[str, Any]:
    """The resolved ``Policy`` as plain data in the file's shape (``yaml.safe_dump`` prints
    it)."""
    return _section(policy, pooled=policy.pool is not None)


def _section(obj: Any, *, pooled: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    kind = type(obj).__name__
    for f in fields(obj):
        name = f.name
        *sections, key = _KEYS.get(name) or (name.removesuffix("_s"),)
        target = out
        for section in sections:
            target = target.setdefault(section, {})
        if not pooled and name in _POOL_ONLY and kind == _BUCKET:
            continue
        shown_as = _SHOWN_AS.get((kind, name))
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
