"""``pool.shared`` in the policy: defaults, the password kept out of what is printed, and
every rule with its message."""

from __future__ import annotations

import asyncio

import pytest

from extproc.config.policy import Policy, PolicyError, policy_from_yaml
from extproc.ops.metrics import Metrics
from extproc.pool.control.wiring import PoolControl
from extproc.pool.gate import Gate

BUCKETS = "\nbuckets: [{name: a, queue_timeout: 1s}]\n"


def test_shared_resolves_with_its_defaults_and_hides_the_password() -> None:
    p = policy_from_yaml(
        'pool: {max_concurrency: 8, shared: {redis: "redis://:pw@redis:6379/2"}}' + BUCKETS
    )
    assert p.pool is not None and p.pool.shared is not None
    s = p.pool.shared
    assert (s.key_prefix, s.lease_s, s.timeout_s, s.replicas) == (
        "llm-extproc:pool",
        10,
        0.25,
        None,
    )
    assert p.to_dict()["pool"]["shared"] == {
        "redis": "redis://:***@redis:6379/2",
        "key_prefix": "llm-extproc:pool",
        "lease": "10s",
        "timeout": "250ms",
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
        (
            "{redis: 'redis://r', lease: 1s, timeout: 300ms}",
            "pool.shared.timeout: 300ms is above a quarter of pool.shared.lease",
        ),
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


def shared_policy(url: str) -> Policy:
    return policy_from_yaml(f"pool: {{max_concurrency: 8, shared: {{redis: '{url}'}}}}" + BUCKETS)


def test_more_of_the_forms_redis_py_reads() -> None:
    for url in ("redis://h:1/0?password=pw", "redis://[::1]:6379/2", "unix://:pw@/run/r.sock"):
        p = shared_policy(url)
        assert p.pool is not None and p.pool.shared is not None


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://h:abc", "pool.shared.redis: 'redis://h:abc' has port 'abc', not a number in"),
        ("redis://h:99999/0", "pool.shared.redis: 'redis://h:99999/0' has port '99999', not a"),
        ("redis://réd:6379", "pool.shared.redis: 'redis://réd:6379' has non-ASCII character"),
        ("redis://h:1/x", "pool.shared.redis: 'redis://h:1/x' has path '/x'; the path is the"),
        ("redis://h?socket_timeout=9", "pool.shared.redis: 'redis://h?socket_timeout=9' sets"),
    ],
)
def test_a_redis_url_redis_py_would_refuse_is_refused_at_load(url: str, message: str) -> None:
    """Each of these loaded before, and in shared mode failed only when the pool first called
    Redis (ValueError), or was misread (the path as database 0, a timeout overridden)."""
    with pytest.raises(PolicyError) as info:
        shared_policy(url)
    assert str(info.value).startswith("<policy>: " + message)


def test_a_password_in_the_query_is_never_printed() -> None:
    """redis-py reads ``?password=`` as the password: masked in `check`, in the policy's repr
    (what a log line would print), in a refusal, and in /debug/queues."""
    p = shared_policy("redis://u:s3cret1@127.0.0.1:9?password=s3cret2&db=1")
    assert p.pool is not None and p.pool.shared is not None
    shown = "redis://u:***@127.0.0.1:9?password=***&db=1"
    assert p.to_dict()["pool"]["shared"]["redis"] == shown
    assert shown in repr(p) and "s3cret" not in repr(p)
    with pytest.raises(PolicyError) as info:
        shared_policy("redis://h:1/x?password=s3cret")
    assert "s3cret" not in str(info.value) and "password=***" in str(info.value)

    async def debug_queues() -> object:
        gate = Gate(p)
        control = PoolControl(gate, Metrics(gate.statistics))
        control.apply(p)
        try:
            return control.debug()["shared"]["redis"]  # type: ignore[index]
        finally:
            await control.close()

    assert asyncio.run(debug_queues()) == shown
