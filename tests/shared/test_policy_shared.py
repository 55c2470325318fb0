"""``pool.shared`` in the policy: defaults, the password kept out of what is printed, and
every rule with its message."""

from __future__ import annotations

import pytest

from extproc.config.policy import PolicyError, policy_from_yaml

BUCKETS = "\nbuckets: [{name: a, queue_timeout: 1s}]\n"


def test_shared_resolves_with_its_defaults_and_hides_the_password() -> None:
    p = policy_from_yaml(
        'pool: {max_concurrency: 8, shared: {redis: "redis://:pw@redis:6379/2"}}' + BUCKETS
    )
    assert p.pool is not None and p.pool.shared is not None
    s = p.pool.shared
    assert (s.key_prefix, s.lease_s, s.timeout_s, s.replicas) == ("llm-extproc:pool", 10, 0.25, 1)
    assert p.to_dict()["pool"]["shared"] == {
        "redis": "redis://:***@redis:6379/2",
        "key_prefix": "llm-extproc:pool",
        "lease": "10s",
        "timeout": "250ms",
        "replicas": 1,
    }


def test_without_shared_the_pool_is_the_sidecars_own() -> None:
    p = policy_from_yaml("pool: {max_concurrency: 8}" + BUCKETS)
    assert p.pool is not None and p.pool.shared is None
    assert "shared" not in p.to_dict()["pool"]


@pytest.mark.parametrize(
    ("shared", "message"),
    [
        ("{redis: 'http://x'}", "pool.shared.redis: 'http://x' must be redis://"),
        ("{}", "pool.shared.redis: '' must be"),
        ("{redis: 'redis://r', key_prefix: 'a b'}", "pool.shared.key_prefix: 1-100"),
        ("{redis: 'redis://r', lease: 100ms}", "pool.shared.lease: must be between"),
        ("{redis: 'redis://r', lease: 1s, timeout: 300ms}", "pool.shared.timeout: must be"),
        ("{redis: 'redis://r', replicas: 0}", "pool.shared.replicas: must be at least 1"),
        ("{redis: 'redis://r', lease: 2s, bogus: 1}", "pool.shared.bogus"),
    ],
)
def test_bad_shared_settings_are_refused(shared: str, message: str) -> None:
    with pytest.raises(PolicyError, match=message.replace("(", r"\(")):
        policy_from_yaml(f"pool: {{max_concurrency: 8, shared: {shared}}}" + BUCKETS)


def test_the_url_forms() -> None:
    for url in ("redis://h", "redis://u:p@h:1/0", "rediss://h:6380", "unix:///run/redis.sock"):
        p = policy_from_yaml(f"pool: {{max_concurrency: 8, shared: {{redis: '{url}'}}}}" + BUCKETS)
        assert p.pool is not None and p.pool.shared is not None
