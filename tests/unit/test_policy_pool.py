"""The pool's part of the policy: defaults, what resolves, and every rule with its message."""

from __future__ import annotations

import pytest
import yaml

from extproc.config.policy import Order, PolicyError, policy_from_yaml

BUCKETS = """
buckets:
  - {name: chat, match: {headers: {x-llm-class: interactive}}, priority: 0, min_share: 0.5,
     queue_timeout: 2s, max_queue: 10}
  - {name: batch, priority: 10, max_share: 0.9, order: cost, vllm_priority: 3,
     queue_timeout: 60s, max_queue: 10}
"""


def test_a_static_pool_resolves_with_its_defaults() -> None:
    p = policy_from_yaml("pool: {max_concurrency: 64}" + BUCKETS)
    assert p.pool is not None
    assert (p.pool.max_concurrency, p.pool.max_tokens_in_flight, p.pool.fail_fast) == (
        64,
        None,
        True,
    )
    assert p.pool.adaptive is None
    assert p.pool.overload.enabled and p.pool.overload.step_hold_s == 120.0
    chat, batch = p.buckets
    assert (chat.priority, chat.min_share, chat.max_share, chat.order) == (0, 0.5, 1.0, Order.FIFO)
    assert (batch.priority, batch.max_share, batch.order, batch.vllm_priority) == (
        10,
        0.9,
        Order.COST,
        3,
    )
    assert chat.max_concurrency == 0  # optional with a pool
    assert p.client_deadline.headers == ("x-envoy-expected-rq-timeout-ms",)
    assert p.client_deadline.seconds_headers == ("x-stainless-timeout",)


def test_an_adaptive_pool_resolves_and_falls_back_to_its_initial_limit() -> None:
    p = policy_from_yaml(
        """
pool:
  adaptive:
    {min: 2, max: 100, initial: 10,
     slo: {ttft: 1500ms, inter_token: 50ms, tpot: 40ms,
           queue_time: 500ms, queue_time_quantile: 0.8}}
backend: {metrics: ["http://vllm-headless.llm.svc:8000/metrics"]}
"""
        + BUCKETS
    )
    assert p.pool is not None and p.pool.adaptive is not None
    a = p.pool.adaptive
    assert (a.min_limit, a.max_limit, a.initial) == (2, 100, 10)
    assert a.slo_s == {"ttft": 1.5, "itl": 0.05, "tpot": 0.04, "queue_time": 0.5}
    assert a.quantiles == {"ttft": 0.9, "itl": 0.9, "tpot": 0.9, "queue_time": 0.8}
    assert p.pool.max_concurrency == 10  # the fallback: the initial limit unless stated
    assert p.to_dict()["pool"]["adaptive"]["slo"] == {
        "ttft": "1.5s",
        "ttft_quantile": 0.9,
        "inter_token": "50ms",
        "inter_token_quantile": 0.9,
        "tpot": "40ms",
        "tpot_quantile": 0.9,
        "queue_time": "500ms",
        "queue_time_quantile": 0.8,
    }


def test_a_policy_without_a_pool_keeps_the_first_design() -> None:
    p = policy_from_yaml("buckets: [{name: a, max_concurrency: 3, queue_timeout: 1s}]")
    assert p.pool is None and p.buckets[0].max_concurrency == 3
    assert "pool" not in p.to_dict()


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("buckets: [{name: a, queue_timeout: 1s}]", "max_concurrency: must be at least 1 (or use"),
        (
            "buckets: [{name: a, max_concurrency: 1, priority: 2, queue_timeout: 1s}]",
            "buckets[0].priority: needs a `pool`",
        ),
        (
            "buckets: [{name: a, max_concurrency: 1, order: cost, queue_timeout: 1s}]",
            "buckets[0].order: needs a `pool`",
        ),
        ("pool: {}\nbuckets: [{name: a, queue_timeout: 1s}]", "pool.max_concurrency: required"),
        (
            "pool: {max_concurrency: 4}\nbuckets: [{name: a, min_share: 0.6, max_share: 0.5, "
            "queue_timeout: 1s}]",
            "min_share and max_share must satisfy",
        ),
        (
            "pool: {max_concurrency: 4}\nbuckets: [{name: a, match: {headers: {x: y}}, "
            "min_share: 0.6, queue_timeout: 1s}, {name: b, min_share: 0.6, queue_timeout: 1s}]",
            "min_share values add up to more than 1",
        ),
        (
            "pool: {adaptive: {slo: {ttft: 1s}}}\nbuckets: [{name: a, queue_timeout: 1s}]",
            "pool.adaptive: needs backend.metrics",
        ),
        (
            "pool: {adaptive: {min: 10, initial: 5}}\nbackend: {metrics: [http://h/m]}\n"
            "buckets: [{name: a, queue_timeout: 1s}]",
            "pool.adaptive.initial: 5 is below pool.adaptive.min (10)",
        ),
        (
            "pool: {adaptive: {slo: {ttft_quantile: 1.5}}}\nbackend: {metrics: [http://h/m]}\n"
            "buckets: [{name: a, queue_timeout: 1s}]",
            "quantiles must be between 0 and 1",
        ),
        (
            "pool: {adaptive: {slo: {tpot_quantile: 0}}}\nbackend: {metrics: [http://h/m]}\n"
            "buckets: [{name: a, queue_timeout: 1s}]",
            "quantiles must be between 0 and 1",
        ),
        (
            "pool: {adaptive: {slo: {queue_time: 0s}}}\nbackend: {metrics: [http://h/m]}\n"
            "buckets: [{name: a, queue_timeout: 1s}]",
            "an objective must be above 0",
        ),
        (
            "pool: {max_concurrency: 4}\nbackend: {metrics: ['https://h/m']}\n"
            "buckets: [{name: a, queue_timeout: 1s}]",
            "must be http://host[:port][/path]",
        ),
        (
            "pool: {max_concurrency: 4, overload: {tighten_eviction_rate: 2}}\n"
            "buckets: [{name: a, queue_timeout: 1s}]",
            "tighten_eviction_rate: must be between 0 and 1",
        ),
        (
            "pool: {adaptive: {slo: {abandoned: 1}}}\nbackend: {metrics: [http://h/m]}\n"
            "buckets: [{name: a, queue_timeout: 1s}]",
            "slo.abandoned: must be a share between 0 and 1",
        ),
        (
            "client_deadline: {seconds_headers: ['bad header']}\n"
            "buckets: [{name: a, max_concurrency: 1, queue_timeout: 1s}]",
            "client_deadline.seconds_headers[0]",
        ),
        (
            "client_deadline: {headers: ['bad header']}\n"
            "buckets: [{name: a, max_concurrency: 1, queue_timeout: 1s}]",
            "client_deadline.headers[0]",
        ),
    ],
)
def test_bad_pool_settings_name_the_key_and_why(text: str, error: str) -> None:
    with pytest.raises(PolicyError) as info:
        policy_from_yaml(text, "p.yaml")
    assert error in str(info.value)
    assert str(info.value).startswith("p.yaml: ")


RELEGATING = """
pool: {max_concurrency: 4}
buckets:
  - {name: chat, match: {headers: {x: chat}}, queue_timeout: 1s, relegate_to: late}
  - {name: late, match: {headers: {x: late}}, priority: 1, queue_timeout: 3s}
  - {name: batch, priority: 10, queue_timeout: 60s}
"""


def test_a_relegation_resolves_and_lengthens_the_longest_wait() -> None:
    p = policy_from_yaml(RELEGATING)
    chat, late, batch = p.buckets
    assert (chat.relegate_to, late.relegate_to, batch.relegate_to) == ("late", None, None)
    assert (p.relegation_s(chat), p.relegation_s(late), p.longest_relegation_s) == (3.0, 0.0, 3.0)
    assert p.to_dict()["buckets"][0]["relegate_to"] == "late"
    assert "relegate_to" not in p.to_dict()["buckets"][1]
    assert policy_from_yaml(yaml.safe_dump(p.to_dict())) == p
    # 60 s of batch, or 1 s + 3 s of chat; a 30 s chat timeout would wait 33 s in all.
    assert p.longest_queue_timeout_s == 60.0
    longer = policy_from_yaml(RELEGATING.replace("queue_timeout: 1s", "queue_timeout: 58s"))
    assert longer.longest_queue_timeout_s == 61.0


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (("relegate_to: late", "relegate_to: nope"), "buckets[0].relegate_to: 'nope' is not"),
        (("relegate_to: late", "relegate_to: chat"), "'chat' is not another bucket"),
        (("priority: 1,", "priority: 0, relegate_to: batch,"), "'late' relegates too"),
        (("relegate_to: late", "relegate_to: late, priority: 1"), None),  # its own band
        (("relegate_to: late", "relegate_to: late, priority: 2"), "'late' is more urgent"),
        (("pool: {max_concurrency: 4}\n", ""), "buckets[0].relegate_to: needs a `pool`"),
    ],
)
def test_bad_relegations_name_the_key_and_why(change: tuple[str, str], error: str | None) -> None:
    text = RELEGATING.replace(*change)
    if "pool" not in text:
        text = text.replace("queue_timeout", "max_concurrency: 1, queue_timeout")
    if error is None:
        policy_from_yaml(text)
        return
    with pytest.raises(PolicyError) as info:
        policy_from_yaml(text, "p.yaml")
    assert error in str(info.value)
