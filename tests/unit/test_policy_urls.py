"""``backend.metrics`` in the policy: a URL that loads is one the scraper can GET, and one it
cannot is refused at load with its key path and why."""

from __future__ import annotations

import pytest

from extproc.backend.scrape import Scraper
from extproc.config.policy import Policy, PolicyError, policy_from_yaml


def with_metrics(*urls: str) -> Policy:
    listed = ", ".join(f"'{u}'" for u in urls)
    return policy_from_yaml(
        "pool: {adaptive: {}}\n"
        f"backend: {{metrics: [{listed}]}}\n"
        "buckets: [{name: a, queue_timeout: 1s}]",
        "p.yaml",
    )


URLS = [
    "http://vllm:8000/metrics",
    "http://vllm.ns.svc.cluster.local:8000/metrics",
    "http://10.1.2.3/metrics",
    "http://[::1]:8000/metrics",  # refused by the old pattern, which Target.parse accepted
    "http://[fd00::7]/metrics",
    "http://vllm:99999/metrics",  # loaded by the old pattern; the poller then failed
    "http://vllm:0/metrics",  # loaded, and scraped port 80
    "http://vllm:8000/métrics",  # loaded; the request line cannot be ASCII
    "http://vllm:8000/a b",
    "http://user:pw@vllm:8000/metrics",
    "https://vllm:8000/metrics",
    "http://vllm:8000/metrics#x",
]


@pytest.mark.parametrize("url", URLS)
def test_a_metrics_url_loads_exactly_when_the_scraper_takes_it(url: str) -> None:
    try:
        policy = with_metrics(url)
    except PolicyError:
        loads = False
    else:
        loads = True
        assert policy.pool is not None and policy.pool.adaptive is not None
        Scraper.from_policy(policy.backend, policy.pool.adaptive)
    try:
        Scraper([url], timeout_s=0.5, window_s=10.0)
    except ValueError:
        assert not loads, f"{url} loads, and then the scraper refuses it"
    else:
        assert loads, f"{url} is refused, though the scraper takes it"


@pytest.mark.parametrize(
    ("urls", "message"),
    [
        (
            ["http://vllm:99999/metrics"],
            "p.yaml: backend.metrics[0]: 'http://vllm:99999/metrics' has port '99999', "
            "not a number in 1-65535",
        ),
        (
            ["http://a:8000/m", "http://b:x/m"],
            "p.yaml: backend.metrics[1]: 'http://b:x/m' has port 'x', not a number in 1-65535",
        ),
        (
            ["http://vllm.ñ.svc/m"],
            "p.yaml: backend.metrics[0]: 'http://vllm.ñ.svc/m' has non-ASCII character 'ñ'",
        ),
        (
            ["http://u:secret@vllm/m"],
            "p.yaml: backend.metrics[0]: 'http://u:***@vllm/m' has user info (user@)",
        ),
    ],
)
def test_a_bad_metrics_url_names_its_key_and_why(urls: list[str], message: str) -> None:
    with pytest.raises(PolicyError) as info:
        with_metrics(*urls)
    assert str(info.value).startswith(message)
    assert "secret" not in str(info.value)


def test_ipv6_literals_load() -> None:
    policy = with_metrics("http://[::1]:8000/metrics")
    assert policy.backend.metrics == ("http://[::1]:8000/metrics",)
