"""The URLs a policy names, checked once, by the rules of the client that opens them.

Two kinds of URL reach the network from a policy: ``backend.metrics`` (the vLLM pages the
adaptive limit reads; ``extproc.backend.http`` GETs them) and ``pool.shared.redis`` (the
shared pool's Redis; redis-py's ``Redis.from_url`` opens it). ``extproc.config.policy.resolve``
checks both at load with the functions below, and ``http.Target.parse`` builds its request
from ``http_url``'s answer, so a URL that loads is one that connects: its error comes when the
policy is read, never later from a poller or a Redis client.

Rules of both kinds:

1. ASCII without blanks or control characters (``urlsplit`` would drop a tab or a newline
   without a word, and a request line cannot carry a space); a host is DNS letters, digits,
   ``-``, ``_`` and dots (a non-ASCII name in its ``xn--`` form), an IPv4 address, or an IPv6
   address in brackets; a port, when given, a number in 1-65535 (``urlsplit`` reads ``:0`` as
   no port, so redis-py would quietly use 6379);
2. no fragment: ``#`` ends a URL, so a ``#`` in a password would cut it there.

A metrics URL is ``http://host[:port][/path][?query]``: plain HTTP, a host, no user info
(nothing would send it). A Redis URL is redis-py's: ``redis://`` or ``rediss://`` with an
optional host (redis-py's default is localhost), an optional port and database path
(``/0``), or ``unix:///path``; user info and the query options below, each of which redis-py
must accept (it is asked: ``redis.asyncio.connection.parse_url``). The options the sidecar sets
itself (its timeouts, the client name, the reply decoding) cannot be overridden from the URL.

Every message is the URL as ``redact`` prints it, then why; the caller puts the key path in
front (``pool.shared.redis: 'redis://h:99999' has port 99999, not a number in 1-65535``).

``redact`` is the one place a URL is made printable (``SharedPolicy.redis_display``: logs,
``/debug/queues``, ``llm-extproc check``): every password redis-py reads is masked as
``***``, the user info's (``redis://user:***@host``) and any query option whose name holds
``password`` (``?password=``, ``?ssl_password=``); a user name is not secret and stays.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Final
from urllib.parse import SplitResult, unquote_plus, urlsplit

__all__ = ["HttpUrl", "UrlError", "check_redis_url", "http_url", "redact"]

_UNSAFE = re.compile(r"[^!-~]")  # anything but printable ASCII without the blank
_DNS_LABEL = r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST_NAME = re.compile(rf"({_DNS_LABEL}\.)*{_DNS_LABEL}\.?")  # an FQDN may end in a dot
_DIGITS = re.compile(r"[0-9]+")

_METRICS_FORM: Final = "must be http://host[:port][/path] (plain HTTP)"
_REDIS_FORM: Final = "must be redis://host[:port][/db], rediss://... or unix:///path"
# Query options redis-py turns into connection settings, that the sidecar passes on.
_REDIS_OPTIONS: Final = frozenset(
    {"db", "username", "password", "health_check_interval", "socket_keepalive"}
)
# ... and those that only TLS (rediss://) takes.
_TLS_OPTIONS: Final = frozenset(
    {
        "ssl_cert_reqs",
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_password",
        "ssl_check_hostname",
        "ssl_min_version",
        "ssl_ciphers",
    }
)
# The options the sidecar sets itself (extproc.pool.shared.client), with what sets them.
_SET_BY_SIDECAR: Final = {
    "socket_timeout": "pool.shared.timeout",
    "socket_connect_timeout": "pool.shared.timeout",
    "timeout": "pool.shared.timeout",
    "retry_on_timeout": "the sidecar (no retry)",
    "client_name": "the sidecar (llm-extproc:<replica>)",
    "decode_responses": "the sidecar (replies are read as bytes)",
    "encoding": "the sidecar (replies are read as bytes)",
}


class UrlError(ValueError):
    """A URL that the client opening it would refuse or misread; the text is the URL
    (``redact``'s form) and why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpUrl:
    """A checked metrics URL."""

    host: str  # lower-cased; an IPv6 address without its brackets
    port: int | None  # None: not written (80)
    target: str  # the path (at least "/") and the query, as the request line writes them


def http_url(url: str) -> HttpUrl:
    """The parts of a metrics URL; raises UrlError for one the scraper could not GET."""
    shown = repr(redact(url))
    parts = _split(url, shown)
    if parts.scheme != "http" or not parts.netloc:
        raise UrlError(f"{shown} {_METRICS_FORM}")
    _, at, hostport = parts.netloc.rpartition("@")
    if at:
        raise UrlError(f"{shown} has user info (user@); the scraper sends no credentials")
    host, port = _host_port(hostport, shown)
    if not host:
        raise UrlError(f"{shown} has no host")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return HttpUrl(host=host, port=port, target=target)


def check_redis_url(url: str) -> None:
    """Raises UrlError for a URL redis-py would refuse, misread, or that overrides what the
    sidecar sets (the rules above)."""
    shown = repr(redact(url))
    parts = _split(url, shown)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise UrlError(f"{shown} {_REDIS_FORM}")
    hostport = parts.netloc.rpartition("@")[2]
    if parts.scheme == "unix":
        if hostport:
            raise UrlError(f"{shown} names a host; a socket is unix:///path")
        if parts.path in ("", "/"):
            raise UrlError(f"{shown} has no socket path (unix:///path)")
    else:
        _host_port(hostport, shown)
        if parts.path not in ("", "/") and not _DIGITS.fullmatch(parts.path[1:]):
            raise UrlError(f"{shown} has path {parts.path!r}; the path is the database (/0)")
    for pair in filter(None, parts.query.split("&")):
        name = unquote_plus(pair.partition("=")[0])
        if name in _SET_BY_SIDECAR:
            raise UrlError(f"{shown} sets {name}, which {_SET_BY_SIDECAR[name]} sets")
        if name in _TLS_OPTIONS and parts.scheme != "rediss":
            raise UrlError(f"{shown} sets {name}, which only rediss:// (TLS) takes")
        if name not in _REDIS_OPTIONS | _TLS_OPTIONS:
            known = ", ".join(sorted(_REDIS_OPTIONS | _TLS_OPTIONS))
            raise UrlError(f"{shown} has option {name!r}, not one of: {known}")
    from redis.asyncio.connection import parse_url  # the values, by the client's own rules

    try:
        parse_url(url)
    except ValueError as e:
        raise UrlError(f"{shown}: {e}") from None


def redact(url: str) -> str:
    """``url`` with every password in it masked (``***``); the rest as written.

    The user info ends at the last ``@`` (a password may hold one); a ``@`` later in the URL
    can only make more of it masked, never less."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    at = rest.rfind("@")
    userinfo, after = (rest[:at], rest[at:]) if at != -1 else ("", rest)
    user, colon, _ = userinfo.partition(":")
    if colon:
        userinfo = f"{user}:***"
    location, question, query = after.partition("?")
    if question:
        query = "&".join(_redact_option(pair) for pair in query.split("&"))
    return f"{scheme}{sep}{userinfo}{location}{question}{query}"


def _redact_option(pair: str) -> str:
    name, eq, _ = pair.partition("=")
    return f"{name}=***" if eq and "password" in unquote_plus(name).lower() else pair


def _split(url: str, shown: str) -> SplitResult:
    """``urlsplit(url)`` of a URL with none of the characters rule 1 and 2 refuse."""
    bad = _UNSAFE.search(url)
    if bad is not None:
        what = "non-ASCII" if ord(bad.group()) > 127 else "a blank or control"
        raise UrlError(
            f"{shown} has {what} character {bad.group()!r} (write a host in its xn-- form, "
            "percent-encode the rest)"
        )
    if "#" in url:
        raise UrlError(f"{shown} has '#', which ends a URL (percent-encode it as %23)")
    try:
        return urlsplit(url)
    except ValueError as e:  # brackets that hold no IP address
        raise UrlError(f"{shown} cannot be read as a URL ({e})") from None


def _host_port(hostport: str, shown: str) -> tuple[str, int | None]:
    """(host, port) of ``host[:port]`` or ``[v6][:port]``; the host lower-cased, "" if none."""
    if hostport.startswith("["):
        host, bracket, rest = hostport[1:].partition("]")
        try:
            if not bracket or "%" in host:  # a zone (%25eth0) would not reach getaddrinfo
                raise ValueError(host)
            ipaddress.IPv6Address(host)
        except ValueError:
            raise UrlError(f"{shown} has host '[{host}]', not an IPv6 address") from None
        if rest and not rest.startswith(":"):
            raise UrlError(f"{shown} has {rest!r} after its host")
    else:
        host = hostport.partition(":")[0]
        rest = hostport[len(host) :]  # "" or ":port"
        if host and not _HOST_NAME.fullmatch(host):
            raise UrlError(f"{shown} has host {host!r}, not a DNS name or an IP address")
    if not rest:
        return host.lower(), None
    port = rest[1:]
    if not _DIGITS.fullmatch(port) or not 1 <= int(port) <= 65535:
        raise UrlError(f"{shown} has port {port!r}, not a number in 1-65535")
    return host.lower(), int(port)
