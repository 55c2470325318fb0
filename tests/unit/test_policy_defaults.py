"""A default follows the values the file set (``extproc.config.policy.resolve``'s rules 1-6);
two values out of order are an error naming both, which one is a default, and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config.policy import (
    Policy,
    PolicyError,
    policy_from_yaml,
    route_override_from_mapping,
)
from testing.stack import cli

REPO = Path(__file__).resolve().parents[2]

ONE_BUCKET = "buckets: [{name: all, max_concurrency: 4, queue_timeout: 5s, max_queue: 10}]\n"
IN_POOL = "buckets: [{name: a, queue_timeout: 1s}]\n"
ADAPTIVE = "backend: {metrics: [http://h/m]}\n" + IN_POOL


def limits(p: Policy) -> tuple[int, int]:
    return p.limits.default_max_tokens, p.limits.max_output_tokens


def retry(p: Policy) -> tuple[float, float]:
    return p.retry_after.min_s, p.retry_after.max_s


def adaptive(p: Policy) -> tuple[Any, ...]:
    assert p.pool is not None and p.pool.adaptive is not None
    a = p.pool.adaptive
    return (
        a.min_limit,
        a.initial,
        a.max_limit,
        a.interval_s,
        a.window_s,
        a.stale_after_s,
        a.fallback_after_s,
    )


def shared(p: Policy) -> tuple[float, float]:
    assert p.pool is not None and p.pool.shared is not None
    return p.pool.shared.lease_s, p.pool.shared.timeout_s


# (the policy, what it resolves to, that value): the unset key's default moved to meet the set
# one; the first row of each group is the defaults alone.
FOLLOWS = [
    (ONE_BUCKET, limits, (256, 1024)),
    ("limits: {max_output_tokens: 64}\n" + ONE_BUCKET, limits, (64, 64)),
    ("limits: {max_output_tokens: 300}\n" + ONE_BUCKET, limits, (256, 300)),
    ("limits: {default_max_tokens: 1000}\n" + ONE_BUCKET, limits, (1000, 1024)),
    (ONE_BUCKET, retry, (1.0, 60.0)),
    ("retry_after: {min: 90s}\n" + ONE_BUCKET, retry, (90.0, 90.0)),
    ("retry_after: {max: 5s}\n" + ONE_BUCKET, retry, (1.0, 5.0)),
    ("pool: {adaptive: {}}\n" + ADAPTIVE, adaptive, (4, 32, 512, 0.5, 10.0, 5.0, 30.0)),
    ("pool: {adaptive: {max: 2}}\n" + ADAPTIVE, adaptive, (2, 2, 2, 0.5, 10.0, 5.0, 30.0)),
    ("pool: {adaptive: {max: 16}}\n" + ADAPTIVE, adaptive, (4, 16, 16, 0.5, 10.0, 5.0, 30.0)),
    ("pool: {adaptive: {initial: 2}}\n" + ADAPTIVE, adaptive, (2, 2, 512, 0.5, 10.0, 5.0, 30.0)),
    ("pool: {adaptive: {min: 64}}\n" + ADAPTIVE, adaptive, (64, 64, 512, 0.5, 10.0, 5.0, 30.0)),
    (
        "pool: {adaptive: {interval: 20s}}\n" + ADAPTIVE,
        adaptive,
        (4, 32, 512, 20.0, 20.0, 5.0, 30.0),
    ),
    (
        "pool: {adaptive: {window: 200ms}}\n" + ADAPTIVE,
        adaptive,
        (4, 32, 512, 0.2, 0.2, 5.0, 30.0),
    ),
    (
        "pool: {adaptive: {stale_after: 1m}}\n" + ADAPTIVE,
        adaptive,
        (4, 32, 512, 0.5, 10.0, 60.0, 60.0),
    ),
    (
        "pool: {adaptive: {fallback_after: 1s}}\n" + ADAPTIVE,
        adaptive,
        (4, 32, 512, 0.5, 10.0, 1.0, 1.0),
    ),
    (
        "pool: {max_concurrency: 4, shared: {redis: 'redis://h'}}\n" + IN_POOL,
        shared,
        (10.0, 0.25),
    ),
    (
        "pool: {max_concurrency: 4, shared: {redis: 'redis://h', lease: 600ms}}\n" + IN_POOL,
        shared,
        (0.6, 0.15),
    ),
    (
        "pool: {max_concurrency: 4, shared: {redis: 'redis://h', timeout: 5s}}\n" + IN_POOL,
        shared,
        (20.0, 5.0),
    ),
]


@pytest.mark.parametrize(("text", "read", "expected"), FOLLOWS)
def test_an_unset_default_follows_the_value_the_file_set(
    text: str, read: Any, expected: tuple[Any, ...]
) -> None:
    p = policy_from_yaml(text, "p.yaml")
    assert read(p) == expected
    # What `check` prints spells the followed value out, and resolves to the same policy.
    assert policy_from_yaml(yaml.safe_dump(p.to_dict())) == p


# (the policy, the whole error after the file name).
CONFLICTS = [
    (
        "limits: {default_max_tokens: 2000}\n" + ONE_BUCKET,
        "limits.default_max_tokens: 2000 is above limits.max_output_tokens (1024, the default); "
        "set max_output_tokens to at least 2000, or default_max_tokens to at most 1024",
    ),
    (
        "limits: {default_max_tokens: 2000, max_output_tokens: 1000}\n" + ONE_BUCKET,
        "limits.default_max_tokens: 2000 is above limits.max_output_tokens (1000); "
        "set max_output_tokens to at least 2000, or default_max_tokens to at most 1000",
    ),
    (
        "retry_after: {min: 10s, max: 5s}\n" + ONE_BUCKET,
        "retry_after.max: 5s is below retry_after.min (10s); "
        "set min to at most 5s, or max to at least 10s",
    ),
    (
        "retry_after: {max: 500ms}\n" + ONE_BUCKET,
        "retry_after.max: must be at least 1s (Retry-After is whole seconds)",
    ),
    (
        "pool: {adaptive: {initial: 600}}\n" + ADAPTIVE,
        "pool.adaptive.initial: 600 is above pool.adaptive.max (512, the default); "
        "set max to at least 600, or initial to at most 512",
    ),
    (
        "pool: {adaptive: {min: 600}}\n" + ADAPTIVE,
        "pool.adaptive.min: 600 is above pool.adaptive.max (512, the default); "
        "set max to at least 600, or min to at most 512",
    ),
    (
        "pool: {adaptive: {min: 10, max: 5}}\n" + ADAPTIVE,
        "pool.adaptive.min: 10 is above pool.adaptive.max (5); "
        "set max to at least 10, or min to at most 5",
    ),
    (
        "pool: {adaptive: {min: 10, initial: 5}}\n" + ADAPTIVE,
        "pool.adaptive.initial: 5 is below pool.adaptive.min (10); "
        "set min to at most 5, or initial to at least 10",
    ),
    ("pool: {adaptive: {max: 0}}\n" + ADAPTIVE, "pool.adaptive.max: must be at least 1"),
    (
        "pool: {adaptive: {window: 1s, interval: 2s}}\n" + ADAPTIVE,
        "pool.adaptive.window: 1s is below pool.adaptive.interval (2s); "
        "set interval to at most 1s, or window to at least 2s",
    ),
    (
        "pool: {adaptive: {window: 20ms}}\n" + ADAPTIVE,
        "pool.adaptive.window: must be at least 50ms (the shortest interval)",
    ),
    (
        "pool: {adaptive: {fallback_after: 1s, stale_after: 2s}}\n" + ADAPTIVE,
        "pool.adaptive.fallback_after: 1s is below pool.adaptive.stale_after (2s); "
        "set stale_after to at most 1s, or fallback_after to at least 2s",
    ),
    (
        "pool: {max_concurrency: 4, shared: {redis: 'redis://h', timeout: 5s, lease: 10s}}\n"
        + IN_POOL,
        "pool.shared.timeout: 5s is above a quarter of pool.shared.lease (10s); "
        "set lease to at least 20s, or timeout to at most 2.5s",
    ),
    (
        "pool: {max_concurrency: 4, shared: {redis: 'redis://h', timeout: 200s}}\n" + IN_POOL,
        "pool.shared.timeout: must be at most 150s (a quarter of 10m, the longest lease)",
    ),
]


@pytest.mark.parametrize(("text", "message"), CONFLICTS)
def test_values_out_of_order_name_both_and_the_fix(text: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        policy_from_yaml(text, "p.yaml")
    assert str(info.value) == f"p.yaml: {message}"


def test_a_route_that_sets_both_token_limits_out_of_order_is_refused() -> None:
    policy = policy_from_yaml(ONE_BUCKET)
    assert route_override_from_mapping({"max_output_tokens": 64}, policy).max_output_tokens == 64
    with pytest.raises(PolicyError) as info:
        route_override_from_mapping({"default_max_tokens": 200, "max_output_tokens": 100}, policy)
    assert str(info.value) == (
        "default_max_tokens: 200 is above max_output_tokens (100); "
        "set max_output_tokens to at least 200, or default_max_tokens to at most 100"
    )


@pytest.mark.slow  # a CLI process
def test_check_accepts_a_cap_below_the_default_and_prints_the_default_it_follows(
    tmp_path: Path,
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("limits: {max_output_tokens: 64}\n" + ONE_BUCKET)
    out = cli("check", "--policy", str(path))
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)["limits"]
    assert (printed["default_max_tokens"], printed["max_output_tokens"]) == (64, 64)
