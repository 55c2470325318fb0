"""The load generator's runs: a :class:`LoadConfig`, request bodies, the OpenAI SDK's retries
around :func:`.client.attempt`, and :func:`run_load`, which sends a whole open-loop schedule
with :func:`.client.send_all`, as records."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp

from .client import CHAT_PATH, COMPLETIONS_PATH, Call, attempt, send_all, session
from .retry import retry_delay_s, should_retry
from .summary import LoadResult, RequestRecord
from .workload import ClassSpec, PlannedRequest, build_schedule

DEFAULT_MODEL: Final = "meta-llama/Llama-3.1-8B-Instruct"
CLASS_HEADER: Final = "x-llm-class"
# The tenant of a request with one (ClassSpec.tenants): in front of a real gateway an auth
# layer would set it; here the client plays that part.
TENANT_HEADER: Final = "x-tenant-id"
# What the OpenAI SDKs (Stainless-generated) send on every attempt: the retries taken so far,
# "0" on the first (openai-python ``_build_headers``).
RETRY_COUNT_HEADER: Final = "x-stainless-retry-count"
# And the attempt's timeout, in seconds (the JS SDK's ``buildHeaders``: ``X-Stainless-Timeout``,
# whole seconds); here the wall seconds the client waits before it closes its connection.
TIMEOUT_HEADER: Final = "x-stainless-timeout"


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadConfig:
    """A load-generator run. Durations are simulated seconds."""

    url: str  # base URL, e.g. http://127.0.0.1:10000
    classes: tuple[ClassSpec, ...]
    duration_s: float = 60.0  # arrival window
    max_requests: int = 10_000
    speedup: float = 1.0
    seed: int = 0
    max_retries: int = 0  # 2 = the OpenAI SDK default
    traces_dir: str | None = None  # default: <repo>/data/traces
    model: str = DEFAULT_MODEL
    max_run_s: float | None = None  # hard cap on the whole run; default derived from timeouts
    body_extra: Mapping[str, Any] = field(default_factory=dict)  # e.g. vLLM's ignore_eos

    def schedule(self) -> tuple[PlannedRequest, ...]:
        """The arrivals this config describes (``build_schedule`` of its classes and seed)."""
        return build_schedule(
            self.classes,
            duration_s=self.duration_s,
            max_requests=self.max_requests,
            seed=self.seed,
            traces_dir=self.traces_dir,
        )

    def hard_cap_s(self) -> float:
        """The run's hard cap: ``max_run_s``, else the arrivals plus the slowest request's
        attempts and retry waits (at most 60 s each), plus 5 s."""
        if self.max_run_s is not None:
            return self.max_run_s
        worst = (
            max(c.timeout_s for c in self.classes) * (self.max_retries + 1)
            + 60.0 * self.max_retries
        )
        return self.duration_s + worst + 5.0


_FILLER: Final = (
    "The quick brown fox jumps over the lazy dog while the scheduler batches tokens. " * 64
)


def prompt_text(index: int, tokens: int) -> str:
    """``4 * tokens`` characters of text (the simulator counts 4 characters per token)."""
    n = 4 * tokens
    text = f"[{index}] "
    while len(text) < n:
        text += _FILLER
    return text[:n]


def request_payload(spec: ClassSpec, pr: PlannedRequest, model: str) -> dict[str, Any]:
    text = prompt_text(pr.index, pr.prompt_tokens)
    body: dict[str, Any] = {"model": model, "max_tokens": pr.output_tokens, "stream": spec.stream}
    if spec.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _run_request(
    session: aiohttp.ClientSession, cfg: LoadConfig, spec: ClassSpec, pr: PlannedRequest, at: float
) -> RequestRecord:
    """One planned request, arrived at ``at`` (loop time): attempts and SDK-style retries
    until an answer the SDK would not retry, or ``max_retries``."""
    path = CHAT_PATH if spec.endpoint == "chat" else COMPLETIONS_PATH
    body = json.dumps({**request_payload(spec, pr, cfg.model), **cfg.body_extra}).encode()
    headers = {CLASS_HEADER: spec.name}
    if pr.tenant is not None:
        headers[TENANT_HEADER] = pr.tenant
    rng = random.Random(f"{cfg.seed}:retry:{pr.index}")
    give_up = spec.timeout_s / cfg.speedup
    attempts = 0
    while True:
        attempts += 1
        call = Call(
            body=body,
            headers={
                **headers,
                RETRY_COUNT_HEADER: str(attempts - 1),
                TIMEOUT_HEADER: f"{give_up:g}",
            },
            path=path,
            stream=spec.stream,
            give_up_s=give_up,
        )
        reply = await attempt(session, cfg.url, call)
        if reply.outcome == "ok" or attempts > cfg.max_retries:
            break
        if not should_retry(reply.status if reply.outcome == "http_error" else None, reply.headers):
            break
        await asyncio.sleep(
            retry_delay_s(attempts - 1, reply.headers, rand=rng.random()) / cfg.speedup
        )
    e2e = (reply.done_at - at) * cfg.speedup
    ttft = None
    if spec.stream and reply.first_token_at is not None and reply.outcome == "ok":
        ttft = (reply.first_token_at - at) * cfg.speedup
    return _record(
        pr,
        outcome=reply.outcome,
        status=reply.status if reply.outcome in ("ok", "http_error") else None,
        ttft_s=ttft,
        e2e_s=e2e,
        output_tokens=reply.tokens,
        attempts=attempts,
        gave_up=reply.outcome == "timeout",
        good=reply.outcome == "ok" and e2e <= spec.timeout_s,
    )


async def run_load(cfg: LoadConfig, schedule: Sequence[PlannedRequest] | None = None) -> LoadResult:
    """Run the open-loop load of ``cfg`` (or an explicit ``schedule``): its records."""
    if cfg.speedup <= 0:
        raise ValueError("speedup must be > 0")
    if schedule is None:
        schedule = cfg.schedule()
    specs = {c.name: c for c in cfg.classes}
    loop = asyncio.get_running_loop()
    arrived = itertools.takewhile(lambda pr: pr.t_s < cfg.duration_s, schedule[: cfg.max_requests])
    due = [(pr.t_s, pr) for pr in arrived]

    async with session() as http:
        t0 = loop.time()

        async def send(pr: PlannedRequest, at: float) -> RequestRecord:
            return await _run_request(http, cfg, specs[pr.cls], pr, at)

        sent = await send_all(due, send, speedup=cfg.speedup, hard_cap_s=cfg.hard_cap_s())
        records = [record for _, record in sent.done]
        for pr, _, exc in sent.unfinished:
            if exc is not None:
                print(f"bench.load: request {pr.index} failed: {exc!r}", file=sys.stderr)
            records.append(_cancelled(pr, (loop.time() - t0) * cfg.speedup - pr.t_s))
    records.sort(key=lambda r: r.index)
    return LoadResult(loadgen_lag_s_max=sent.lag_max_s * cfg.speedup, records=tuple(records))


def _record(pr: PlannedRequest, **what: Any) -> RequestRecord:
    """The record of planned request ``pr``: what happened to it."""
    return RequestRecord(
        index=pr.index,
        cls=pr.cls,
        arrival_s=pr.t_s,
        prompt_tokens=pr.prompt_tokens,
        max_tokens=pr.output_tokens,
        tenant=pr.tenant,
        **what,
    )


def _cancelled(pr: PlannedRequest, e2e_s: float) -> RequestRecord:
    """The record of a request the hard cap cut (or whose task failed)."""
    return _record(
        pr,
        outcome="cancelled",
        status=None,
        ttft_s=None,
        e2e_s=e2e_s,
        output_tokens=0,
        attempts=1,
        gave_up=True,
        good=False,
    )
