"""The policy's URLs (extproc.config.urls): what loads is what the client opening it reads,
every refusal says why, and no password is ever printed. Pure, table-driven."""

from __future__ import annotations

import pytest
from redis.asyncio.connection import parse_url

from extproc.backend.http import Target
from extproc.config.urls import HttpUrl, UrlError, check_redis_url, http_url, redact

HTTP_GOOD = [
    ("http://vllm:8000/metrics", HttpUrl(host="vllm", port=8000, target="/metrics")),
    ("http://vllm/metrics", HttpUrl(host="vllm", port=None, target="/metrics")),
    ("http://VLLM.ns.svc:8000", HttpUrl(host="vllm.ns.svc", port=8000, target="/")),
    ("http://v:1/m?a=1&b=2", HttpUrl(host="v", port=1, target="/m?a=1&b=2")),
    ("http://[::1]:8000/metrics", HttpUrl(host="::1", port=8000, target="/metrics")),
    ("http://[2001:DB8::1]/m", HttpUrl(host="2001:db8::1", port=None, target="/m")),
    ("http://10.0.0.7:65535/m", HttpUrl(host="10.0.0.7", port=65535, target="/m")),
    ("http://vllm_backend:8000/m", HttpUrl(host="vllm_backend", port=8000, target="/m")),
    (
        "http://vllm.ns.svc.cluster.local./m",
        HttpUrl(host="vllm.ns.svc.cluster.local.", port=None, target="/m"),
    ),
    ("HTTP://v/m%20x", HttpUrl(host="v", port=None, target="/m%20x")),
]

HTTP_BAD = [
    ("https://a:8000/metrics", "'https://a:8000/metrics' must be http://host[:port][/path]"),
    ("ftp://a/x", "must be http://host[:port][/path] (plain HTTP)"),
    ("http:///metrics", "'http:///metrics' must be http://host[:port][/path]"),
    ("a:8000/metrics", "must be http://"),
    ("http://a:99999/", "'http://a:99999/' has port '99999', not a number in 1-65535"),
    ("http://a:0/", "has port '0', not a number in 1-65535"),
    ("http://a:x/", "has port 'x', not a number in 1-65535"),
    ("http://a:/", "has port '', not a number in 1-65535"),
    ("http://u:pw@a/m", "'http://u:***@a/m' has user info (user@); the scraper sends no"),
    ("http://bücher.example/m", "has non-ASCII character 'ü' (write a host in its xn-- form"),
    ("http://a/mé", "has non-ASCII character 'é'"),
    ("http://a/m x", "has a blank or control character ' '"),
    ("http://a/m\r\nX: y", "has a blank or control character '\\r'"),
    ("http://a/m#top", "has '#', which ends a URL (percent-encode it as %23)"),
    ("http://-a/m", "has host '-a', not a DNS name or an IP address"),
    ("http://a..b/m", "has host 'a..b', not a DNS name or an IP address"),
    ("http://a%2Fb/m", "has host 'a%2Fb', not a DNS name"),
    ("http://[::1/m", "cannot be read as a URL"),
    ("http://[zz]/m", "cannot be read as a URL"),
    ("http://[::1]x/m", "has 'x' after its host"),
    ("http://[fe80::1%25eth0]/m", "not an IPv6 address"),
]


@pytest.mark.parametrize(("url", "parts"), HTTP_GOOD)
def test_http_url(url: str, parts: HttpUrl) -> None:
    assert http_url(url) == parts
    t = Target.parse(url)  # the scraper's request is built from the same parts
    assert (t.host, t.port, t.path) == (parts.host, parts.port or 80, parts.target)


@pytest.mark.parametrize(("url", "message"), HTTP_BAD)
def test_http_url_refused(url: str, message: str) -> None:
    with pytest.raises(UrlError) as info:
        http_url(url)
    assert message in str(info.value)
    with pytest.raises(ValueError) as scraper:
        Target.parse(url)
    assert str(scraper.value) == str(info.value)  # the scraper refuses it in the same words


REDIS_GOOD = [
    "redis://h",
    "redis://",  # redis-py's default: localhost:6379
    "redis://u:p@h:1/0",
    "redis://:pw@redis:6379/2",
    "redis://h:6379/",
    "redis://h:6379/0?password=pw",
    "redis://h?db=3&username=u&password=pw&health_check_interval=5&socket_keepalive=yes",
    "redis://[::1]:6379/1",
    "redis://:p%40ss@h:1",
    "redis://:p@ss@h:1",  # the user info ends at the last @
    "rediss://h:6380",
    "rediss://h?ssl_cert_reqs=none&ssl_ca_certs=/ca.pem&ssl_password=k",
    "unix:///run/redis.sock",
    "unix://:pw@/run/redis.sock?db=2",
    "REDIS://H:1",
]

REDIS_BAD = [
    ("", "'' must be redis://host[:port][/db], rediss://... or unix:///path"),
    ("http://x", "'http://x' must be redis://"),
    ("redis://h:abc", "'redis://h:abc' has port 'abc', not a number in 1-65535"),
    ("redis://h:99999/0", "'redis://h:99999/0' has port '99999', not a number in 1-65535"),
    ("redis://h:0", "has port '0', not a number in 1-65535"),
    ("redis://héllo:6379", "has non-ASCII character 'é' (write a host in its xn-- form"),
    ("redis://h/x", "'redis://h/x' has path '/x'; the path is the database (/0)"),
    ("redis://h/1/2", "has path '/1/2'; the path is the database (/0)"),
    ("redis://h?db=x", "Invalid value for 'db' in connection URL."),
    ("redis://h?socket_timeout=30", "sets socket_timeout, which pool.shared.timeout sets"),
    ("redis://h?decode_responses=1", "sets decode_responses, which the sidecar"),
    ("redis://h?client_name=x", "sets client_name, which the sidecar"),
    ("redis://h?bogus=1", "has option 'bogus', not one of: db, "),
    ("redis://h?ssl_ca_certs=/ca.pem", "sets ssl_ca_certs, which only rediss:// (TLS) takes"),
    ("redis://:s3#cret@h:1", "'redis://:***@h:1' has '#', which ends a URL"),
    ("redis://:s3 cret@h:1", "'redis://:***@h:1' has a blank or control character ' '"),
    ("unix://h/run/redis.sock", "names a host; a socket is unix:///path"),
    ("unix://", "has no socket path (unix:///path)"),
    ("redis://h_-/0", "has host 'h_-', not a DNS name or an IP address"),
]


@pytest.mark.parametrize("url", REDIS_GOOD)
def test_redis_url_accepted_is_one_redis_py_reads_as_written(url: str) -> None:
    check_redis_url(url)
    kwargs = parse_url(url)
    assert set(kwargs) <= {
        "host", "port", "db", "username", "password", "path", "connection_class",
        "health_check_interval", "socket_keepalive", "ssl_cert_reqs", "ssl_ca_certs",
        "ssl_password",
    }  # fmt: skip


@pytest.mark.parametrize(("url", "message"), REDIS_BAD)
def test_redis_url_refused(url: str, message: str) -> None:
    with pytest.raises(UrlError) as info:
        check_redis_url(url)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "url", ["redis://h:abc", "redis://h:99999/0", "redis://h?db=x", "redis://h?bogus=1"]
)
def test_what_is_refused_redis_py_would_refuse_at_run_time(url: str) -> None:
    """Not a stricter taste: each of these fails in redis-py, when the first command goes out
    (an unknown option is a TypeError of the connection's constructor)."""
    from redis.asyncio import Redis

    with pytest.raises((ValueError, TypeError)):
        Redis.from_url(url).connection_pool.make_connection()


REDACTED = [
    ("redis://:pw@redis:6379/2", "redis://:***@redis:6379/2"),
    ("redis://u:pw@cache:6379", "redis://u:***@cache:6379"),
    ("redis://u@h:1", "redis://u@h:1"),  # a user name alone is not secret
    ("redis://h:1/0?password=s3cret", "redis://h:1/0?password=***"),
    ("redis://h:1?username=u&password=s3cret&db=2", "redis://h:1?username=u&password=***&db=2"),
    ("redis://h?pass%77ord=s3cret", "redis://h?pass%77ord=***"),  # names are unquoted
    ("redis://h?PASSWORD=s3cret", "redis://h?PASSWORD=***"),
    ("rediss://h?ssl_password=k3y", "rediss://h?ssl_password=***"),
    ("redis://:p@ss@h:1", "redis://:***@h:1"),
    ("redis://:a/b@h:1", "redis://:***@h:1"),
    ("unix://:pw@/run/redis.sock?password=x", "unix://:***@/run/redis.sock?password=***"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("", ""),
]


@pytest.mark.parametrize(("url", "shown"), REDACTED)
def test_redact(url: str, shown: str) -> None:
    assert redact(url) == shown


@pytest.mark.parametrize("url", [u for u in REDIS_GOOD if "p" in u] + [u for u, _ in REDIS_BAD])
def test_no_password_redis_py_reads_is_ever_shown(url: str) -> None:
    try:
        kwargs = parse_url(url)
    except ValueError:
        return
    for secret in (kwargs.get("password"), kwargs.get("ssl_password")):
        if secret:
            assert secret not in redact(url).replace("password", "")
            try:
                check_redis_url(url)
            except UrlError as e:
                assert secret not in str(e).replace("password", "")
