"""The gateway's HTTP side (aiohttp): parse just enough of the body to size the request, wait for
a worker of the :class:`~.core.PriorityPool`, proxy the request to a backend and stream the
answer back; the worker is released in ``finally``, whatever ends the request.

Served with ``handler_cancellation=True``: a client that disconnects cancels its handler, which
drops its ticket if it is still queued, or closes the upstream connection (the backend aborts
the request) and frees the worker if it was running.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Final, Literal

import aiohttp
from aiohttp import web

from bench.sim.api import SimRequestError, count_prompt_tokens

from .core import Grants, PriorityPool, Ticket

__all__ = ["CLASS_HEADER", "Gateway", "GatewayConfig", "create_app"]

CLASS_HEADER: Final = "x-llm-class"
Verdict = Literal["run", "expired", "rejected"]
# Hop-by-hop or recomputed by aiohttp when the answer is streamed back.
_SKIP_HEADERS: Final = frozenset(
    {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}
)


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayConfig:
    """Durations are wall-clock seconds."""

    upstreams: tuple[str, ...]  # base URLs, used round robin
    workers: int
    short_prompt: int  # a request is short if prompt < this and max_tokens < short_output
    short_output: int
    queue_timeout_s: float  # default queue timeout
    class_queue_timeout_s: Mapping[str, float] = field(default_factory=dict)  # by x-llm-class
    max_queue: int = 10_000


@dataclass(slots=True)
class Counters:
    admitted: int = 0
    admitted_short: int = 0
    expired: int = 0  # 503 at dequeue: waited past the queue timeout
    rejected_full: int = 0  # 503 at once: the queue was full
    cancelled_queued: int = 0  # the client left while queued
    bad_request: int = 0
    upstream_error: int = 0


class Gateway:
    """The pool and the futures of the requests waiting on it."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.pool = PriorityPool(config.workers, config.max_queue)
        self.counters = Counters()
        self._ids = itertools.count()
        self._waiters: dict[int, asyncio.Future[Verdict]] = {}
        self._upstreams = itertools.cycle(config.upstreams)

    def is_short(self, prompt_tokens: int, max_tokens: object) -> bool:
        """Both under their thresholds; a request without ``max_tokens`` is not short."""
        return (
            prompt_tokens < self.config.short_prompt
            and isinstance(max_tokens, int)
            and max_tokens < self.config.short_output
        )

    def queue_timeout_s(self, cls: str | None) -> float:
        return self.config.class_queue_timeout_s.get(cls or "", self.config.queue_timeout_s)

    async def acquire(self, *, short: bool, queue_timeout_s: float) -> Verdict:
        """Wait for a worker. On ``"run"`` the caller holds one and must :meth:`release` it."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        ticket = Ticket(id=next(self._ids), short=short, deadline_s=now + queue_timeout_s)
        fut: asyncio.Future[Verdict] = loop.create_future()
        self._waiters[ticket.id] = fut
        try:
            self._apply(self.pool.enqueue(ticket, now))
            verdict = await fut
        except asyncio.CancelledError:
            if self.pool.cancel(ticket.id):
                self.counters.cancelled_queued += 1
            elif fut.done() and not fut.cancelled() and fut.result() == "run":
                self.release()  # woken, then cancelled before it could run: pass the worker on
            raise
        finally:
            self._waiters.pop(ticket.id, None)
        if verdict == "run":
            self.counters.admitted += 1
            self.counters.admitted_short += short
        return verdict

    def release(self) -> None:
        self._apply(self.pool.release(asyncio.get_running_loop().time()))

    def _apply(self, grants: Grants) -> None:
        for tid in grants.run:
            fut = self._waiters.get(tid)
            if fut is None or fut.done():
                # Its waiter was cancelled after the ticket was picked: nobody will release
                # this worker, so release it now (which may wake the next one).
                self.release()
            else:
                fut.set_result("run")
        answers: tuple[tuple[Verdict, tuple[int, ...]], ...] = (
            ("expired", grants.expired),
            ("rejected", grants.rejected),
        )
        for verdict, ids in answers:
            for tid in ids:
                fut = self._waiters.get(tid)
                if fut is not None and not fut.done():
                    fut.set_result(verdict)
                    if verdict == "expired":
                        self.counters.expired += 1
                    else:
                        self.counters.rejected_full += 1

    def next_upstream(self) -> str:
        return next(self._upstreams)

    def stats(self) -> dict[str, int]:
        return {**asdict(self.counters), **asdict(self.pool.statistics())}


GATEWAY_KEY: Final = web.AppKey("gateway", Gateway)
SESSION_KEY: Final = web.AppKey("session", aiohttp.ClientSession)


def _error(status: int, code: str, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return web.json_response(body, status=status)


async def _generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    gw = request.app[GATEWAY_KEY]
    raw = await request.read()
    try:
        body = json.loads(raw)
        prompt_tokens = count_prompt_tokens(body, chat=chat)
    except (ValueError, SimRequestError, AttributeError, TypeError):
        gw.counters.bad_request += 1
        return _error(400, "bad_request", "the request body is not a valid completion request")
    short = gw.is_short(prompt_tokens, body.get("max_tokens"))
    cls = request.headers.get(CLASS_HEADER)
    verdict = await gw.acquire(short=short, queue_timeout_s=gw.queue_timeout_s(cls))
    if verdict == "expired":
        return _error(503, "queue_timeout", "the request waited longer than its queue timeout")
    if verdict == "rejected":
        return _error(503, "queue_full", "the gateway's queue is full")
    try:
        return await _forward(request, raw, gw.next_upstream())
    except UpstreamUnreachable:
        gw.counters.upstream_error += 1
        return _error(502, "upstream_error", "the backend could not be reached")
    finally:
        gw.release()


class UpstreamUnreachable(Exception):
    """The backend refused or dropped the connection before answering."""


async def _forward(request: web.Request, raw: bytes, upstream: str) -> web.StreamResponse:
    """Send the request on and copy the answer back as it comes (a stream stays a stream)."""
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
    if CLASS_HEADER in request.headers:
        headers[CLASS_HEADER] = request.headers[CLASS_HEADER]
    session = request.app[SESSION_KEY]
    try:
        up = await session.post(upstream + request.path_qs, data=raw, headers=headers)
    except (aiohttp.ClientError, ConnectionError) as exc:
        raise UpstreamUnreachable from exc
    resp = web.StreamResponse(
        status=up.status,
        headers={k: v for k, v in up.headers.items() if k.lower() not in _SKIP_HEADERS},
    )
    try:
        await resp.prepare(request)
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
    except (ConnectionError, aiohttp.ClientError):
        up.close()  # the client or the backend went away mid-answer: drop both sides
    except BaseException:
        up.close()  # cancelled (client gone): closing tells the backend to abort
        raise
    finally:
        up.release()
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def gateway_stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[GATEWAY_KEY].stats())


def create_app(config: GatewayConfig) -> web.Application:
    """The gateway as an aiohttp app. Serve it with ``handler_cancellation=True``."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[GATEWAY_KEY] = Gateway(config)

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None)
        ) as session:
            app[SESSION_KEY] = session
            yield

    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/gateway/stats", gateway_stats)
    return app
