"""``bench.common``: generated policies are validated by the product's loader when they are
built (a bad key or value fails there), written as YAML that loads back to the same policy,
with the Redis placeholder kept for the harness to fill in."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.common.policy import REDIS_PLACEHOLDER, policy_yaml, validated, wall_ms
from bench.compare.capacity import Capacity, ClosedLoopPoint
from bench.compare.options import Options
from bench.compare.strategies import pool_policy
from extproc.config.policy import PolicyError, policy_from_yaml

DATA = {
    "pool": {"max_concurrency": 8, "shared": {"redis": REDIS_PLACEHOLDER, "key_prefix": "t"}},
    "buckets": [
        {"name": "a", "match": {"headers": {"x-c": "a"}}, "queue_timeout": wall_ms(3, 3)},
        {"name": "rest", "min_share": 0.25, "queue_timeout": "1s"},
    ],
}


def test_policy_yaml_round_trips_and_keeps_the_placeholder() -> None:
    text = policy_yaml(DATA, source="test", comment="first line\nsecond")
    assert text.startswith("# first line\n# second\n")
    assert f'redis: "{REDIS_PLACEHOLDER}"' in text and "queue_timeout: 1000ms" in text
    loaded = policy_from_yaml(text.replace(REDIS_PLACEHOLDER, "redis://127.0.0.1:1/0"))
    assert loaded == validated(DATA, "test", {REDIS_PLACEHOLDER: "redis://127.0.0.1:1/0"})
    assert loaded.pool is not None and loaded.pool.max_concurrency == 8


def test_a_bad_policy_fails_when_built() -> None:
    with pytest.raises(PolicyError, match=r"test.*bukets"):
        policy_yaml({"bukets": []}, source="test")
    with pytest.raises(PolicyError, match="max_share"):
        policy_yaml({**DATA, "buckets": [{"name": "a", "max_share": 1.5}]}, source="test")
    # The adaptive pool's interval is 0.5 s simulated on the wall clock: at speedup 40 that is
    # 12 ms, under the 50 ms the policy allows, and the strategy fails as it is built.
    point = ClosedLoopPoint(concurrency=8, throughput_rps=1.0, tokens_per_s=1.0, class_rps={},
                            in_flight={}, ttft_p99_s={}, e2e_p99_s={})  # fmt: skip
    cap = Capacity(profile="a100", capacity_rps=1.0, saturation=point, concurrency=8,
                   at_concurrency=point, concurrency_rule="test", sweep=())  # fmt: skip
    pool_policy(cap, Options(), ["http://127.0.0.1:9/metrics"])
    with pytest.raises(PolicyError, match="interval"):
        pool_policy(cap, replace(Options(), speedup=40.0), ["http://127.0.0.1:9/metrics"])


def test_wall_ms() -> None:
    assert wall_ms(1.0, 3.0) == "333ms" and wall_ms(240.0, 3.0) == "80000ms"
    assert wall_ms(0.0001) == "1ms"  # never 0
