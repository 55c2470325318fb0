"""Large bodies are parsed and classified in a worker process, off the event loop.

Parsing costs CPU in proportion to the number of JSON values, not bytes: a 4 MB body of tiny
``tools`` objects took 0.55 s of the event loop while every other request on the sidecar waited
(docs/performance.md, "Conclusions from earlier measurements"). Python threads would not help:
``json.loads`` and ``json.dumps`` hold the GIL for long stretches. So a body above
``INLINE_BODY_BYTES`` is parsed and classified by ``parse.parse_body`` and
``classify.classify`` in a separate process; smaller ones (almost every chat request) stay on
the loop, where they cost microseconds.

Bounds: one worker process (``workers``), at most ``max_pending`` large bodies being parsed or
waiting for the worker; beyond that a request is refused at once with ``Busy`` (the servicer
answers 429 with Retry-After). The client that leaves while its body is parsed is dropped as
usual; the worker finishes that job and its result is thrown away, and the count of pending
jobs comes down only when the worker is done with it, so the bound is on real work.

The worker is started on the first large body, with the ``spawn`` method (a fresh
interpreter: forking a process that runs an event loop and sockets is unsafe), at a lower CPU
priority than the event loop. If it dies,
the bodies it held are parsed on the loop instead (logged; a rare, slow path, never an error
for the client) and the next large body starts a new worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import os
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from extproc.config.policy import Policy, RouteOverride, TokenPolicy
from extproc.outcome import Outcome, RequestError
from extproc.request.classify import Classification, TokenCounter, classify, token_counter
from extproc.request.parse import Endpoint, parse_body

__all__ = ["INLINE_BODY_BYTES", "Busy", "Offload", "Parsed", "parse_and_classify"]

log = logging.getLogger("extproc.offload")

# Bodies up to this size are parsed on the event loop: the worst shape of this size (tiny
# objects) costs about 4 ms there (64 KiB: 7.3 ms, 3.8 MB: 0.51 s, measured by hand on the dev
# VM; no command in this repository measures it);
# a typical chat body is a few KB, a 8k-token prompt about 32 KB.
INLINE_BODY_BYTES = 32 * 1024


# The worker runs at a lower CPU priority than the event loop: when both want a core, the
# loop (every other request, and Envoy's 1 s message timeout) comes first.
_WORKER_NICENESS = 10


class Busy(Exception):
    """Too many large bodies are being parsed: refuse this one at once."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Parsed:
    """What the request path keeps of a parsed body."""

    classification: Classification
    stream: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class _Refusal:
    """A RequestError as plain data (exceptions with keyword arguments do not pickle)."""

    code: str
    message: str
    param: str | None
    outcome: Outcome
    status: int | None

    def error(self) -> RequestError:
        return RequestError(
            self.code, self.message, self.param, outcome=self.outcome, status=self.status
        )


def parse_and_classify(
    policy: Policy,
    count: TokenCounter,
    headers: Mapping[str, str],
    endpoint: Endpoint,
    body: bytes,
    route: RouteOverride | None,
) -> Parsed:
    """Stages 1 and 2 for one body; raises RequestError."""
    parsed = parse_body(endpoint, body)
    return Parsed(
        classification=classify(policy, count, headers, parsed, route), stream=parsed.stream
    )


@functools.lru_cache(maxsize=4)
def _counter(tokens: TokenPolicy) -> TokenCounter:
    return token_counter(tokens)


def _in_worker(
    policy: Policy,
    headers: dict[str, str],
    endpoint: Endpoint,
    body: bytes,
    route: RouteOverride | None,
) -> Parsed | _Refusal:
    try:
        return parse_and_classify(policy, _counter(policy.tokens), headers, endpoint, body, route)
    except RequestError as e:
        return _Refusal(
            code=e.code, message=e.message, param=e.param, outcome=e.outcome, status=e.status
        )


class Offload:
    """The worker process for large bodies, with its bound on pending jobs."""

    def __init__(self, *, workers: int = 1, max_pending: int = 8) -> None:
        self._workers = workers
        self.max_pending = max_pending
        self.pending = 0
        self._pool: ProcessPoolExecutor | None = None

    async def parse(
        self,
        policy: Policy,
        count: TokenCounter,
        headers: Mapping[str, str],
        endpoint: Endpoint,
        body: bytes,
        route: RouteOverride | None,
    ) -> Parsed:
        """``parse_and_classify`` in the worker; raises RequestError, or Busy at the bound."""
        if self.pending >= self.max_pending:
            raise Busy
        loop = asyncio.get_running_loop()
        try:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    self._workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=os.nice,
                    initargs=(_WORKER_NICENESS,),
                )
            job = self._pool.submit(_in_worker, policy, dict(headers), endpoint, body, route)
            self.pending += 1
            job.add_done_callback(lambda _: self._done_from_thread(loop))
            result = await asyncio.wrap_future(job)
        except BrokenProcessPool:
            log.warning("the body worker died; this body is parsed on the event loop")
            self._pool = None
            return parse_and_classify(policy, count, headers, endpoint, body, route)
        if isinstance(result, _Refusal):
            raise result.error()
        return result

    def _done_from_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        # The executor calls this from its own thread: count on the loop that owns the count.
        with contextlib.suppress(RuntimeError):  # the loop is gone: nothing left to count
            loop.call_soon_threadsafe(self._done)

    def _done(self) -> None:
        self.pending -= 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
