"""The clients the end-to-end tests and ``bench.bounds`` share, so that a test and the benchmark
that times it run the same scenario.

- ``post`` sends one request with aiohttp and keeps when it was sent and how long it took
  (:class:`Reply`); ``chat`` and ``slow_stream`` build its body and the test backend's headers
  (``testing/backend.py``: ``x-test-chunks`` SSE chunks, each after ``x-test-delay-ms``).
- :class:`SlowClient` sends its headers at once and then its body at one byte a second, as a
  client that holds a connection open cheaply would; :func:`honest_load` runs closed-loop
  clients beside it and returns each answer's status, seconds and error code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

__all__ = ["HonestAnswer", "Reply", "SlowClient", "chat", "honest_load", "post", "slow_stream"]


def chat(content: str = "hello", **fields: Any) -> bytes:
    """A chat completion request body (model ``m``, one user message, ``fields`` added)."""
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": content}], **fields}
    ).encode()


def slow_stream(chunks: int, delay_ms: int, **extra: str) -> dict[str, str]:
    """Headers for the test backend: ``chunks`` SSE chunks, ``delay_ms`` before each."""
    return {"x-test-chunks": str(chunks), "x-test-delay-ms": str(delay_ms), **extra}


class Reply:
    """An answer, with when it was sent and how long it took (``time.monotonic``)."""

    def __init__(
        self, status: int, headers: dict[str, str], body: bytes, sent_at: float, elapsed: float
    ):
        self.status, self.headers, self.body = status, headers, body
        self.sent_at, self.elapsed = sent_at, elapsed

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def echo(self) -> dict[str, Any]:
        """What the test backend received (a non-streamed answer's ``echo``)."""
        return self.json()["echo"]  # type: ignore[no-any-return]


async def post(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str] | None = None,
    *,
    limit_s: float = 20,
) -> Reply:
    """POST ``body`` as JSON; the whole answer, read to its end, within ``limit_s``."""
    t0 = time.monotonic()
    async with session.post(
        url,
        data=body,
        headers={"content-type": "application/json", **(headers or {})},
        timeout=aiohttp.ClientTimeout(total=limit_s),
    ) as r:
        data = await r.read()
        answer_headers = {k.lower(): v for k, v in r.headers.items()}
        return Reply(r.status, answer_headers, data, t0, time.monotonic() - t0)


class SlowClient:
    """Headers at once, then a ``body_bytes`` body at 1 byte/s until told to stop (raw
    HTTP/1.1 to Envoy's listener)."""

    def __init__(self, body_bytes: int) -> None:
        self.body_bytes = body_bytes
        self.sent = 0
        self.answer = b""
        self.trickling = asyncio.Event()  # a few bytes into its body

    async def run(self, port: int, stop: asyncio.Event) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % self.body_bytes
            )
            body = b'{"messages": [{"role": "user", "content": "' + b"x" * self.body_bytes
            while not stop.is_set() and self.sent < self.body_bytes - 1:
                writer.write(body[self.sent : self.sent + 1])
                await writer.drain()
                self.sent += 1
                if self.sent == 3:
                    self.trickling.set()
                with contextlib.suppress(TimeoutError):
                    # The subject: one byte a second. An answer (the old config's 500) or a
                    # close before the body is complete ends it.
                    self.answer = await asyncio.wait_for(reader.read(65536), 1.0) or b"closed"
                    break
        except (ConnectionError, OSError):
            pass
        finally:
            self.trickling.set()  # or done: nobody waits for it in vain
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()


@dataclass(frozen=True, slots=True, kw_only=True)
class HonestAnswer:
    status: int | str  # the HTTP status, or the client error's name
    seconds: float
    code: str  # the error body's code ("" for 200)


def _error_code(status: int | str, body: bytes) -> str:
    if status == 200:
        return ""
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return repr(body[:100])


async def honest_load(
    url: str, body: bytes, stop: asyncio.Event, *, workers: int, pace_s: float
) -> list[HonestAnswer]:
    """``workers`` clients in closed loops, ``pace_s`` between one worker's requests, until
    ``stop``."""
    results: list[HonestAnswer] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:

        async def worker() -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    async with session.post(
                        url, data=body, headers={"content-type": "application/json"}
                    ) as r:
                        answer = await r.read()
                        status: int | str = r.status
                except (aiohttp.ClientError, TimeoutError) as e:
                    answer, status = b"", type(e).__name__
                seconds = time.monotonic() - t0
                results.append(
                    HonestAnswer(status=status, seconds=seconds, code=_error_code(status, answer))
                )
                await asyncio.sleep(pace_s)  # the subject: a steady load, not a saturation

        await asyncio.gather(*(worker() for _ in range(workers)))
    return results
