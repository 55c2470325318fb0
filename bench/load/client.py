"""The one HTTP client every benchmark sends with: one attempt at one request, and an open-loop
sender that keeps to a schedule.

* :func:`attempt` posts one :class:`Call` and reads its whole answer: a streamed 200 as
  server-sent events (the first content chunk's time, one token per content chunk or the usage
  chunk's count, complete at ``[DONE]``), an unstreamed 200 as JSON (``usage``), anything else
  as an OpenAI-style error body (its ``error.code``). A client that gives up
  (``Call.give_up_s``) closes its connection, which Envoy, the sidecar and the backend see as a
  disconnect. It returns a :class:`Reply` with the outcome and never raises for what the
  network or the server does.
* :func:`send_all` sends arrivals at their times (open loop), optionally at most
  ``concurrency`` at once, stops sending at ``stop_after_s`` and cuts what is still open at
  ``hard_cap_s``. No task it starts outlives the call.

What to send is :mod:`.presets`'; retries and per-request records are :mod:`.runner`'s.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Generic, Literal, TypeVar

import aiohttp

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "Call",
    "Outcome",
    "Reply",
    "Sent",
    "attempt",
    "error_code",
    "send_all",
    "session",
]

CHAT_PATH: Final = "/v1/chat/completions"
COMPLETIONS_PATH: Final = "/v1/completions"
_JSON: Final = {"content-type": "application/json"}

# How one attempt (or, in the runner's records, one request) ended: a complete 200, another
# status, the client gave up, the connection or the answer broke, or the run's hard cap cut it.
Outcome = Literal["ok", "http_error", "timeout", "conn_error", "cancelled"]

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, slots=True, kw_only=True)
class Call:
    """One request to send."""

    body: bytes  # JSON
    headers: Mapping[str, str] = field(default_factory=dict)  # besides content-type
    path: str = CHAT_PATH
    stream: bool = False  # read the answer as server-sent events
    give_up_s: float | None = None  # wall seconds; then the client closes its connection
    aborts: bool = False  # give_up_s is a planned abort (a disconnect storm's), not a timeout
    label: str = ""  # the kind of request, for the caller's tables


@dataclass(slots=True, kw_only=True)
class Reply:
    """What one attempt got. Times are the event loop's clock (``loop.time()``)."""

    outcome: Outcome = "conn_error"
    status: int | None = None
    headers: Mapping[str, str] | None = None  # the answer's, case-insensitive
    code: str | None = None  # error.code of a refused request's body
    error: str | None = None  # the exception that ended the attempt, by type name
    sent_at: float = 0.0
    done_at: float = 0.0
    first_token_at: float | None = None
    tokens: int = 0
    complete: bool = False

    @property
    def seconds(self) -> float:
        """From the request's send to the end of its answer (or of the attempt)."""
        return self.done_at - self.sent_at

    @property
    def retry_after(self) -> str | None:
        return None if self.headers is None else self.headers.get("retry-after")


def error_code(body: bytes) -> str | None:
    """``error.code`` of an OpenAI-style error body; None when there is none."""
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


def session() -> aiohttp.ClientSession:
    """A client session with no connection limit and no session-wide timeout (each
    :class:`Call` carries its own)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=False),
        timeout=aiohttp.ClientTimeout(total=None),
    )


async def _read_stream(
    resp: aiohttp.ClientResponse, reply: Reply, loop: asyncio.AbstractEventLoop
) -> None:
    buf = b""
    usage_tokens: int | None = None
    async for data in resp.content.iter_any():
        buf += data
        *events, buf = buf.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    reply.complete = True
                    continue
                chunk = json.loads(payload)
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta")
                    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
                    if text:
                        reply.tokens += 1
                        if reply.first_token_at is None:
                            reply.first_token_at = loop.time()
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    usage_tokens = usage.get("completion_tokens")
    if usage_tokens is not None and reply.complete:
        reply.tokens = int(usage_tokens)


async def attempt(session: aiohttp.ClientSession, base_url: str, call: Call) -> Reply:
    """Post ``call`` to ``base_url`` and read the answer (see the module docstring)."""
    loop = asyncio.get_running_loop()
    reply = Reply(sent_at=loop.time())
    url = base_url.rstrip("/") + call.path
    try:
        async with asyncio.timeout(call.give_up_s):
            async with session.post(url, data=call.body, headers={**_JSON, **call.headers}) as r:
                reply.status = r.status
                reply.headers = r.headers  # case-insensitive (aiohttp title-cases known names)
                if r.status != 200:
                    reply.code = error_code(await r.read())
                    reply.outcome = "http_error"
                else:
                    if call.stream:
                        await _read_stream(r, reply, loop)
                    else:
                        data: Any = await r.json(content_type=None)
                        reply.tokens = int((data.get("usage") or {}).get("completion_tokens", 0))
                        reply.complete = True
                    reply.outcome = "ok" if reply.complete else "conn_error"
    except TimeoutError:
        # Leaving the context closed the connection: the backend aborts the request.
        reply.outcome, reply.error = "timeout", "TimeoutError"
    except (aiohttp.ClientError, ConnectionError, ValueError, AttributeError, TypeError) as e:
        # A transport failure or a malformed answer.
        reply.outcome, reply.error = "conn_error", type(e).__name__
    reply.done_at = loop.time()
    return reply


async def _acquire(places: asyncio.Semaphore, stop: float | None) -> bool:
    """A free place, waiting no later than ``stop`` (loop time); False when none came."""
    if stop is None:
        await places.acquire()
        return True
    try:
        async with asyncio.timeout_at(stop):
            await places.acquire()
    except TimeoutError:
        return False
    return True


@dataclass(slots=True, kw_only=True)
class Sent(Generic[T, R]):
    """What :func:`send_all` did."""

    count: int = 0  # arrivals sent
    lag_max_s: float = 0.0  # the latest a send went out after its time, wall seconds
    done: list[tuple[T, R]] = field(default_factory=list)  # finished sends, if kept
    # (arrival, its wall time, the exception its send raised; None: cut at the hard cap)
    unfinished: list[tuple[T, float, BaseException | None]] = field(default_factory=list)


async def send_all(
    arrivals: Iterable[tuple[float, T]],
    send: Callable[[T, float], Coroutine[Any, Any, R]],
    *,
    speedup: float = 1.0,
    concurrency: int | None = None,
    stop_after_s: float | None = None,
    hard_cap_s: float | None = None,
    keep: bool = True,
) -> Sent[T, R]:
    """``send(item, at)`` for each ``(t, item)`` at ``t / speedup`` wall seconds from now
    (``at``: that instant on the loop's clock), each in a task of its own; then wait for them
    all. ``concurrency``: at most that many sends at once, an arrival waits for a free place;
    ``stop_after_s``: arrivals whose time or place comes later are not sent (an endless
    iterable of arrivals then ends); ``hard_cap_s``: sends still open then are cancelled (both
    in the arrivals' time units). ``keep=False`` keeps no results (a long soak), only the
    count."""
    loop = asyncio.get_running_loop()
    out: Sent[T, R] = Sent()
    places = asyncio.Semaphore(concurrency) if concurrency else None
    pending: dict[asyncio.Task[R], tuple[T, float]] = {}
    t0 = loop.time()
    stop = None if stop_after_s is None else t0 + stop_after_s / speedup

    def finished(task: asyncio.Task[R]) -> None:
        item, at = pending.pop(task)
        if places is not None:
            places.release()
        if task.cancelled():
            out.unfinished.append((item, at, None))
        elif (exc := task.exception()) is not None:
            out.unfinished.append((item, at, exc))
        elif keep:
            out.done.append((item, task.result()))

    try:
        for t_s, item in arrivals:
            at = t0 + t_s / speedup
            if (delay := at - loop.time()) > 0:
                await asyncio.sleep(delay)
            if places is not None and not await _acquire(places, stop):
                break  # no place before the stop
            now = loop.time()
            if stop is not None and now > stop:
                if places is not None:
                    places.release()
                break
            out.lag_max_s = max(out.lag_max_s, now - at)
            task = asyncio.create_task(send(item, at))
            pending[task] = (item, at)
            task.add_done_callback(finished)
            out.count += 1
        if pending:
            left = None if hard_cap_s is None else max(0.0, t0 + hard_cap_s / speedup - loop.time())
            await asyncio.wait(set(pending), timeout=left)
    finally:
        # Cut at the cap, or the caller was cancelled: nothing outlives this call.
        still = set(pending)
        for task in still:
            task.cancel()
        if still:
            await asyncio.wait(still)
    return out
