"""The ``backend`` and ``pool`` sections -> ``BackendPolicy`` and ``PoolPolicy`` (with its
``adaptive``, ``overload`` and ``shared`` parts), their rules checked.

Rules 3 to 6 of ``resolve`` (a default follows the values the file set) are the pool's: they
are applied here, each where its section is read.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from extproc._proto.llm_extproc.v1 import policy_pb2
from extproc.config.policy.dump import duration as _duration
from extproc.config.policy.fields import conflict as _conflict
from extproc.config.policy.fields import default as _default
from extproc.config.policy.fields import duration_or as _duration_or
from extproc.config.policy.fields import set_or as _set_or
from extproc.config.policy.model import (
    AdaptivePolicy,
    BackendPolicy,
    OverloadPolicy,
    PoolPolicy,
    SharedPolicy,
)
from extproc.config.schema import PolicyError
from extproc.config.urls import UrlError, check_redis_url, http_url
from extproc.objectives import OBJECTIVES

__all__ = ["backend_policy", "pool_policy"]

_KEY_PREFIX = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")


def _url(check: Callable[[str], object], url: str, where: str) -> None:
    """``check(url)`` (``extproc.config.urls``), its UrlError a PolicyError at ``where``."""
    try:
        check(url)
    except UrlError as e:
        raise PolicyError(f"{where}: {e}") from None


def backend_policy(msg: policy_pb2.Backend) -> BackendPolicy:
    for i, url in enumerate(msg.metrics):
        _url(http_url, url, f"backend.metrics[{i}]")
    timeout = _duration_or(msg, "scrape_timeout", BackendPolicy().scrape_timeout_s)
    if not 0 < timeout <= 10:
        raise PolicyError("backend.scrape_timeout: must be above 0 and at most 10s")
    return BackendPolicy(metrics=tuple(msg.metrics), scrape_timeout_s=timeout)


def pool_policy(msg: policy_pb2.Pool, backend: BackendPolicy) -> PoolPolicy:
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
