"""``bench.overhead``'s sidecar+redis way, pure: where it is sent and whose CPU it is, its
policy, the Envoy listener and cluster, Redis's script calls, and how the report puts it next
to the local sidecar. The benchmark itself (``python -m bench.overhead``) is not run here."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from bench.overhead.meters import CpuMeter
from bench.overhead.openloop import OpenLoop, Samples, summarise
from bench.overhead.procs import script_calls
from bench.overhead.report import report, targets
from bench.overhead.ways import (
    FLOOR,
    NAIVE,
    REDIS,
    SERVERS,
    SIDECAR,
    SIDECAR_POLICY,
    SIDECAR_REDIS,
    SIDECAR_RW,
    SIDECAR_SHARED,
    WAYS,
    Ports,
    envoy_config,
    listener_of,
    metered_of,
    server_of,
    shared_policy,
)
from extproc.config.policy import policy_from_yaml


def test_the_way_its_listener_its_server_and_whose_cpu() -> None:
    assert WAYS[-1] == SIDECAR_REDIS and SIDECAR_SHARED in SERVERS
    assert listener_of(SIDECAR_REDIS) == SIDECAR_SHARED == server_of(SIDECAR_REDIS)
    assert metered_of(SIDECAR_REDIS) == (SIDECAR_SHARED, REDIS)
    # The other ways are as they were.
    assert (listener_of(SIDECAR_RW), server_of(SIDECAR_RW)) == (SIDECAR, SIDECAR)
    assert metered_of(SIDECAR) == (SIDECAR,) and metered_of(FLOOR) == ()
    assert listener_of(NAIVE) == NAIVE and server_of(FLOOR) is None


def test_shared_policy_is_the_sidecar_policy_as_a_shared_pool() -> None:
    local = policy_from_yaml(SIDECAR_POLICY, source="test")
    shared = policy_from_yaml(shared_policy("redis://127.0.0.1:6390/0"), source="test")
    assert shared.pool is not None and shared.pool.adaptive is None
    assert shared.pool.max_concurrency == sum(b.max_concurrency for b in local.buckets)
    s = shared.pool.shared
    assert s is not None and s.redis == "redis://127.0.0.1:6390/0"
    assert (s.lease_s, s.timeout_s, s.replicas) == (10.0, 0.25, 1)  # the policy's defaults
    assert [b.name for b in shared.buckets] == [b.name for b in local.buckets]
    for a, b in zip(shared.buckets, local.buckets, strict=True):
        assert (a.match, a.queue_timeout_s, a.max_queue) == (
            b.match,
            b.queue_timeout_s,
            b.max_queue,
        )
    assert (shared.limits, shared.tokens, shared.retry_after) == (
        local.limits,
        local.tokens,
        local.retry_after,
    )


def test_envoy_config_has_the_shared_sidecars_listener_and_cluster() -> None:
    ports = Ports.pick()
    assert SIDECAR_SHARED in ports.listeners and SIDECAR_SHARED in ports.grpc
    assert SIDECAR_SHARED in ports.metrics and NAIVE not in ports.metrics
    assert len(set(ports.listeners.values()) | set(ports.grpc.values())) == len(
        ports.listeners
    ) + len(ports.grpc)
    cfg = yaml.safe_load(envoy_config(ports))
    listeners = {x["name"]: x for x in cfg["static_resources"]["listeners"]}
    assert set(listeners) == {FLOOR, NAIVE, SIDECAR, SIDECAR_SHARED, "held"}
    port = listeners[SIDECAR_SHARED]["address"]["socket_address"]["port_value"]
    assert port == ports.listeners[SIDECAR_SHARED]
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    assert "sidecar_shared_extproc" in clusters
    assert str(ports.grpc[SIDECAR_SHARED]) in yaml.safe_dump(clusters["sidecar_shared_extproc"])


def test_script_calls_from_commandstats() -> None:
    stats: dict[str, Any] = {
        "cmdstat_evalsha": {"calls": 120, "usec": 900, "usec_per_call": 7.5},
        "cmdstat_eval": {"calls": 3, "usec": 60},
        "cmdstat_script|load": {"calls": 5},
        "cmdstat_zadd": {"calls": 400},  # called from inside the scripts: not a round trip
        "cmdstat_info": {"calls": 9},
        "cmdstat_weird": "calls=1",
    }
    assert script_calls(stats) == 123
    assert script_calls({}) == 0


def _samples(latency_ms: float, *, cpu: dict[str, float], redis_calls: int | None) -> Samples:
    """One run of 100 requests in 1 s, every answer ``latency_ms``."""
    gen = OpenLoop(port=1, request=b"", rate=100.0, count=100)
    for i in range(100):
        gen.sched[i] = gen.sent[i] = i / 100
        gen.done[i] = gen.sent[i] + latency_ms / 1e3
        gen.status[i] = 200
    meter = CpuMeter({})
    meter.delta = dict(cpu)
    meter.system_s = sum(cpu.values()) + 0.05
    s = Samples()
    s.add(gen, 1.0, 0.01, meter, redis_calls)
    return s


def test_summarise_counts_redis_with_the_sidecar() -> None:
    cpu = {"envoy": 0.02, SIDECAR: 0.01, SIDECAR_SHARED: 0.012, REDIS: 0.003}
    shared = summarise(SIDECAR_REDIS, _samples(1.2, cpu=cpu, redis_calls=4))
    assert shared["server_cpu_us"] == pytest.approx(150.0)  # (12 + 3) ms over 100 requests
    assert shared["redis_cpu_us"] == pytest.approx(30.0)
    assert shared["redis_calls_per_request"] == pytest.approx(0.04)
    assert shared["other_cores"] == pytest.approx(0.04)  # 0.05 - the generator's 0.01
    local = summarise(SIDECAR, _samples(1.0, cpu=cpu, redis_calls=None))
    assert local["server_cpu_us"] == pytest.approx(100.0)
    assert local["redis_cpu_us"] is None and local["redis_calls_per_request"] is None


def test_report_shows_the_shared_pool_next_to_local() -> None:
    cpu = {"envoy": 0.02, NAIVE: 0.01, SIDECAR: 0.01}
    cpu |= {SIDECAR_SHARED: 0.012, REDIS: 0.003}
    latency = {FLOOR: 0.5, NAIVE: 0.9, SIDECAR: 0.8, SIDECAR_RW: 0.85}
    latency[SIDECAR_REDIS] = 1.1
    ways = {
        w: summarise(w, _samples(ms, cpu=cpu, redis_calls=4 if w == SIDECAR_REDIS else None))
        for w, ms in latency.items()
    }
    res: dict[str, Any] = {
        "config": {"body_bytes": 1100, "body_bytes_rw": 1080},
        "open_loop": {"500": ways},
    }
    rows = {t["target"]: t for t in targets(res)}
    shared = rows["added latency at 500 req/s (sidecar+redis): p50 <= 0.5 ms, p99 <= 2 ms"]
    assert shared["verdict"] == "MISS"  # +0.60 ms at p50
    assert "+0.60 ms" in shared["measured"] and "Redis over local: +0.30 ms" in shared["measured"]
    assert rows["added latency at 500 req/s (sidecar): p50 <= 0.5 ms, p99 <= 2 ms"]["verdict"] == (
        "PASS"
    )
    text = report(res)
    (line,) = [x for x in text.splitlines() if x.strip().startswith("sidecar+redis over sidecar")]
    assert "p50 +0.30 ms" in line and "script calls per request 0.040" in line
    assert "150 us (sidecar 120 + redis-server 30) vs 100" in line
