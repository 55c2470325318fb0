"""``bench.micro``: each micro-benchmark runs as ``python -m bench.micro.<name>`` would, a few
operations only, and prints its figures (shape, not values)."""

from __future__ import annotations

import pytest

from bench.micro import admission_cost, redis_rtt, tenant_cost


def test_admission_cost(capsys: pytest.CaptureFixture[str]) -> None:
    costs = admission_cost.admission_costs(20)
    assert set(costs) == set(admission_cost.LEVELS) == {"gate", "core"}
    for level in costs.values():
        assert list(level) == [str(n) for n in admission_cost.QUEUE_LENGTHS]
        for ops in level.values():
            assert set(ops) == {"admit", "enter", "cancel", "evict"}
            assert all(0 < op["p50_us"] <= op["p99_us"] <= op["max_us"] for op in ops.values())
    admission_cost.main(["--ops", "20"])
    out = capsys.readouterr().out
    assert out.count("admission cost against queue length") == 2 and "10,000" in out


def test_tenant_cost(capsys: pytest.CaptureFixture[str]) -> None:
    costs = tenant_cost.tenant_costs(20)
    assert list(costs) == list(tenant_cost.POPULATIONS)
    # Each population is what it says: the fair order held that many tenants at the end.
    assert [c["tracked"]["tenants"] for c in costs.values()] == [1, 10_000, 10_000]
    for c in costs.values():
        assert all(0 < c[op]["p50_us"] <= c[op]["p99_us"] for op in ("enter", "admit"))
        assert c["request"]["p50_us"] >= c["enter"]["p50_us"]
    tenant_cost.main(["--ops", "20"])
    out = capsys.readouterr().out
    assert "admission cost against tenants tracked" in out and "10,000 tracked" in out


@pytest.mark.redis  # a throwaway redis-server of its own
def test_redis_rtt(capsys: pytest.CaptureFixture[str]) -> None:
    redis_rtt.main(["--n", "20"])
    out = capsys.readouterr().out
    for line in ("ACQUIRE 1 lease:", "RETURN 1 lease:", "RENEW 64 leases:", "hand-over B -> A:"):
        assert line in out and "median" in out and "p99" in out


def test_the_prompt_estimate_is_safe_on_natural_text_of_every_script() -> None:
    """Against two real tokenizers (bench.micro.prompt_estimate): never below 0.9x the larger
    real count on prose of fourteen scripts, code and mixed text, never above 3x."""
    from bench.micro.prompt_estimate import ABSURD, ADVERSARIAL, NATURAL, SAFE, measure

    rows = measure(NATURAL)
    assert {r.name for r in rows} == set(NATURAL)
    for r in rows:
        assert SAFE <= r.ratio <= ABSURD, r
        assert r.old <= r.estimate  # never below the old characters / 4
    emoji = next(r for r in measure(ADVERSARIAL) if r.name == "emoji")
    assert emoji.ratio >= 1.0 and emoji.old * 4 <= emoji.estimate  # issue 22's hole
