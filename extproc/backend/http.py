"""A bounded HTTP/1.1 GET on asyncio streams, enough to read a Prometheus page.

The sidecar does not depend on an HTTP library for this: one request per connection, sent
with ``Connection: close`` and without ``Accept-Encoding`` (the body comes uncompressed). The
answer must be a 200 over HTTP/1.x; its body may come with Content-Length, chunked or until
EOF.

Bounds: the whole GET runs under ``timeout_s``; the headers and each chunk-size line must fit
in ``HEAD_LIMIT`` (asyncio's ``StreamReader`` limit); past ``max_body_bytes`` of body
(``MAX_BODY_BYTES``, 1 MiB, by default) or ``MAX_CHUNKS`` chunks the GET fails. The chunk
bound is one of time: a chunk already buffered is read without yielding to the event loop,
at several microseconds a chunk, so a body of one-byte chunks would hold the loop for as long
as its buffer lasts; the reader also yields every 64 chunks, so that many GETs reading at once
share the loop (docs/pool.md, "What the scraper trusts", has the measures).

A GET fails with ``HttpError`` (an answer we cannot use; its text is the short reason) or with
what the stream raises (``OSError``, ``TimeoutError``, ``asyncio.IncompleteReadError``,
``asyncio.LimitOverrunError``); the caller names them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from extproc.config.urls import http_url

__all__ = ["HEAD_LIMIT", "MAX_BODY_BYTES", "MAX_CHUNKS", "HttpError", "Target", "get"]

HEAD_LIMIT = 64 * 1024
# vLLM's page is about 40 KB an engine; 1 MiB holds 25 engines.
MAX_BODY_BYTES = 1024 * 1024
# A full 1 MiB page in chunks of 1 KiB (servers chunk by 4 KiB or more, Envoy by 16 KiB).
MAX_CHUNKS = 1024
# Chunks read between two yields to the event loop.
_CHUNKS_A_TURN = 64


class HttpError(Exception):
    """An endpoint answered, but not with a page we can use."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """A parsed ``http://`` URL and the request bytes that GET it."""

    host: str
    port: int
    path: str
    request: bytes

    @classmethod
    def parse(cls, url: str) -> Target:
        """Raises ``UrlError`` (a ValueError) for a URL that is not a plain ``http://`` URL
        the GET can send (``extproc.config.urls.http_url``: the rules the policy's
        ``backend.metrics`` is checked by when it loads)."""
        u = http_url(url)
        authority = f"[{u.host}]" if ":" in u.host else u.host
        if u.port is not None:
            authority += f":{u.port}"
        path = u.target
        request = (
            f"GET {path} HTTP/1.1\r\n"
            f"Host: {authority}\r\n"
            "Accept: text/plain\r\n"  # no Accept-Encoding: the body comes uncompressed
            "User-Agent: llm-extproc\r\n"
            "Connection: close\r\n\r\n"
        ).encode("ascii")
        return cls(host=u.host, port=u.port or 80, path=path, request=request)


async def get(
    address: str, port: int, request: bytes, *, timeout_s: float, max_body_bytes: int
) -> bytes:
    """Send ``request`` to ``address:port``; the body of a 200, within the bounds above."""
    async with asyncio.timeout(timeout_s):
        return await _get(address, port, request, max_body_bytes)


async def _get(address: str, port: int, request: bytes, max_body_bytes: int) -> bytes:
    reader, writer = await asyncio.open_connection(address, port, limit=HEAD_LIMIT)
    try:
        writer.write(request)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        version, _, rest = status_line.partition(" ")
        if not version.startswith("HTTP/1."):
            raise HttpError("not HTTP/1.x")
        status = rest[:3]
        if status != "200" or rest[3:4] not in ("", " "):
            raise HttpError(f"status {status or '?'}")
        headers: dict[str, str] = {}
        for h in header_lines:
            name, sep, value = h.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip().lower()
        if headers.get("content-encoding", "identity") != "identity":
            raise HttpError("compressed body")
        transfer = headers.get("transfer-encoding")
        if transfer is not None:
            if transfer != "chunked":
                raise HttpError(f"transfer-encoding {transfer}")
            return await _read_chunked(reader, max_body_bytes)
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise HttpError("bad content-length")
            n = int(length)
            if n > max_body_bytes:
                raise HttpError(f"body over {max_body_bytes} bytes")
            return await reader.readexactly(n)
        body = bytearray()
        while chunk := await reader.read(65536):
            body += chunk
            if len(body) > max_body_bytes:
                raise HttpError(f"body over {max_body_bytes} bytes")
        return bytes(body)
    finally:
        writer.close()


async def _read_chunked(reader: asyncio.StreamReader, max_body_bytes: int) -> bytes:
    body = bytearray()
    for n in range(MAX_CHUNKS + 1):  # the last: the zero-size chunk that ends the body
        if n % _CHUNKS_A_TURN == _CHUNKS_A_TURN - 1:
            await asyncio.sleep(0)  # buffered chunks are read without a yield: make one
        line = await reader.readuntil(b"\r\n")
        size_field = line.split(b";", 1)[0].strip()
        try:
            size = int(size_field, 16)
        except ValueError:
            raise HttpError("bad chunk size") from None
        if size < 0:
            raise HttpError("bad chunk size")
        if size == 0:
            return bytes(body)  # trailers, if any, are left unread: the connection closes
        if len(body) + size > max_body_bytes:
            raise HttpError(f"body over {max_body_bytes} bytes")
        body += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise HttpError("bad chunk")
    raise HttpError(f"over {MAX_CHUNKS} chunks")
