"""The GET's request, from a URL: pure, table-driven (the GET itself: test_backend_scrape)."""

from __future__ import annotations

import pytest

from extproc.backend.http import Target

TARGETS = [
    ("http://vllm:8000/metrics", "vllm", 8000, "/metrics", "vllm:8000"),
    ("http://vllm/metrics", "vllm", 80, "/metrics", "vllm"),  # no port: none in Host either
    ("http://vllm:8000", "vllm", 8000, "/", "vllm:8000"),
    ("http://vllm:8000/m?a=1&b=2", "vllm", 8000, "/m?a=1&b=2", "vllm:8000"),
    ("http://VLLM.ns.svc:8000/m", "vllm.ns.svc", 8000, "/m", "vllm.ns.svc:8000"),
    ("http://[::1]:8000/metrics", "::1", 8000, "/metrics", "[::1]:8000"),
]


@pytest.mark.parametrize(("url", "host", "port", "path", "authority"), TARGETS)
def test_target(url: str, host: str, port: int, path: str, authority: str) -> None:
    t = Target.parse(url)
    assert (t.host, t.port, t.path) == (host, port, path)
    request = (
        f"GET {path} HTTP/1.1\r\nHost: {authority}\r\nAccept: text/plain\r\n"
        "User-Agent: llm-extproc\r\nConnection: close\r\n\r\n"
    )
    assert t.request == request.encode()


@pytest.mark.parametrize(
    "url",
    ["https://a:8000/metrics", "ftp://a/x", "http:///metrics", "http://a:99999/", "http://a:x/"],
)
def test_only_plain_http_urls_with_a_host_and_a_port_in_range(url: str) -> None:
    with pytest.raises(ValueError):
        Target.parse(url)
