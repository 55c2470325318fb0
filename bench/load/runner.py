"""The client side: a :class:`LoadConfig`, request bodies, one HTTP attempt, retries, and
:func:`run_load`, which sends a whole open-loop schedule and summarizes it."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import aiohttp

from .retry import retry_delay_s, should_retry
from .summary import LoadResult, Outcome, RequestRecord, backend_work, summarize
from .workload import ClassSpec, PlannedRequest, build_schedule

DEFAULT_MODEL: Final = "meta-llama/Llama-3.1-8B-Instruct"
CLASS_HEADER: Final = "x-llm-class"
# What the OpenAI SDKs (Stainless-generated) send on every attempt: the retries taken so far,
# "0" on the first (openai-python ``_build_headers``).
RETRY_COUNT_HEADER: Final = "x-stainless-retry-count"


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
    stats_url: str | None = None  # the simulator's /sim/stats, for wasted-work accounting
    traces_dir: str | None = None  # default: <repo>/data/traces
    model: str = DEFAULT_MODEL
    prompt_tokens_header: bool = False  # also send x-sim-prompt-tokens
    max_run_s: float | None = None  # hard cap on the whole run; default derived from timeouts

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


@dataclass(slots=True, kw_only=True)
class _Attempt:
    """Mutable progress of one HTTP attempt (survives a timeout cancellation)."""

    status: int | None = None
    headers: Mapping[str, str] | None = None
    first_token_wall: float | None = None
    tokens: int = 0
    complete: bool = False
    outcome: Outcome = "conn_error"


async def _read_stream(
    resp: aiohttp.ClientResponse, att: _Attempt, loop: asyncio.AbstractEventLoop
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
                    att.complete = True
                    continue
                chunk = json.loads(payload)
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta")
                    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
                    if text:
                        att.tokens += 1
                        if att.first_token_wall is None:
                            att.first_token_wall = loop.time()
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    usage_tokens = usage.get("completion_tokens")
    if usage_tokens is not None and att.complete:
        att.tokens = int(usage_tokens)


async def _attempt(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    timeout_wall_s: float,
    stream: bool,
) -> _Attempt:
    loop = asyncio.get_running_loop()
    att = _Attempt()
    try:
        async with asyncio.timeout(timeout_wall_s):
            async with session.post(url, json=body, headers=headers) as resp:
                att.status = resp.status
                att.headers = dict(resp.headers)
                if resp.status != 200:
                    await resp.read()
                    att.outcome = "http_error"
                    return att
                if stream:
                    await _read_stream(resp, att, loop)
                else:
                    data = await resp.json(content_type=None)
                    att.tokens = int((data.get("usage") or {}).get("completion_tokens", 0))
                    att.complete = True
                att.outcome = "ok" if att.complete else "conn_error"
    except TimeoutError:
        att.outcome = "timeout"  # leaving the context closed the connection: the backend aborts
    except (aiohttp.ClientError, ConnectionError, ValueError, AttributeError, TypeError):
        att.outcome = "conn_error"  # transport failure or a malformed response body
    return att


async def _run_request(
    session: aiohttp.ClientSession,
    cfg: LoadConfig,
    spec: ClassSpec,
    pr: PlannedRequest,
    arrival_wall: float,
) -> RequestRecord:
    loop = asyncio.get_running_loop()
    url = cfg.url.rstrip("/") + (
        "/v1/chat/completions" if spec.endpoint == "chat" else "/v1/completions"
    )
    body = request_payload(spec, pr, cfg.model)
    headers = {CLASS_HEADER: spec.name}
    if cfg.prompt_tokens_header:
        headers["x-sim-prompt-tokens"] = str(pr.prompt_tokens)
    rng = random.Random(f"{cfg.seed}:retry:{pr.index}")
    attempts = 0
    while True:
        attempts += 1
        headers[RETRY_COUNT_HEADER] = str(attempts - 1)
        att = await _attempt(session, url, body, headers, spec.timeout_s / cfg.speedup, spec.stream)
        if att.outcome == "ok" or attempts > cfg.max_retries:
            break
        if not should_retry(att.status if att.outcome == "http_error" else None, att.headers):
            break
        await asyncio.sleep(
            retry_delay_s(attempts - 1, att.headers, rand=rng.random()) / cfg.speedup
        )
    end_wall = loop.time()
    e2e = (end_wall - arrival_wall) * cfg.speedup
    ttft = None
    if spec.stream and att.first_token_wall is not None and att.outcome == "ok":
        ttft = (att.first_token_wall - arrival_wall) * cfg.speedup
    return RequestRecord(
        index=pr.index,
        cls=pr.cls,
        arrival_s=pr.t_s,
        prompt_tokens=pr.prompt_tokens,
        max_tokens=pr.output_tokens,
        outcome=att.outcome,
        status=att.status if att.outcome in ("ok", "http_error") else None,
        ttft_s=ttft,
        e2e_s=e2e,
        output_tokens=att.tokens,
        attempts=attempts,
        gave_up=att.outcome == "timeout",
        good=att.outcome == "ok" and e2e <= spec.timeout_s,
    )


async def _get_stats(session: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status == 200:
                data = await resp.json(content_type=None)
                return data if isinstance(data, dict) else None
    except (TimeoutError, aiohttp.ClientError, ValueError):
        pass
    return None


async def run_load(cfg: LoadConfig, schedule: Sequence[PlannedRequest] | None = None) -> LoadResult:
    """Run the open-loop load of ``cfg`` (or an explicit ``schedule``) and summarize it."""
    if cfg.speedup <= 0:
        raise ValueError("speedup must be > 0")
    if schedule is None:
        schedule = cfg.schedule()
    specs = {c.name: c for c in cfg.classes}
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        before = await _get_stats(session, cfg.stats_url) if cfg.stats_url else None
        t0 = loop.time()
        hard_deadline = t0 + cfg.hard_cap_s() / cfg.speedup
        tasks: dict[asyncio.Task[RequestRecord], PlannedRequest] = {}
        lag_max = 0.0
        for pr in schedule[: cfg.max_requests]:
            if pr.t_s >= cfg.duration_s:
                break
            at = t0 + pr.t_s / cfg.speedup
            delay = at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            lag_max = max(lag_max, (loop.time() - at) * cfg.speedup)
            task = asyncio.create_task(_run_request(session, cfg, specs[pr.cls], pr, at))
            tasks[task] = pr
        records: list[RequestRecord] = []
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=max(0.0, hard_deadline - loop.time()))
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
            for task, pr in tasks.items():
                if task in done and not task.cancelled() and task.exception() is None:
                    records.append(task.result())
                else:
                    if task in done and not task.cancelled():
                        print(
                            f"bench.load: request {pr.index} failed: {task.exception()!r}",
                            file=sys.stderr,
                        )
                    records.append(
                        RequestRecord(
                            index=pr.index,
                            cls=pr.cls,
                            arrival_s=pr.t_s,
                            prompt_tokens=pr.prompt_tokens,
                            max_tokens=pr.output_tokens,
                            outcome="cancelled",
                            status=None,
                            ttft_s=None,
                            e2e_s=(loop.time() - t0) * cfg.speedup - pr.t_s,
                            output_tokens=0,
                            attempts=1,
                            gave_up=True,
                            good=False,
                        )
                    )
        elapsed = (loop.time() - t0) * cfg.speedup
        backend = None
        if cfg.stats_url and before is not None:
            await asyncio.sleep(0.05)  # let the backend process the last disconnects
            after = await _get_stats(session, cfg.stats_url)
            if after is not None:
                backend = backend_work(before, after)
    records.sort(key=lambda r: r.index)
    sent = len(records)
    window = cfg.duration_s if sent < cfg.max_requests or not records else records[-1].arrival_s
    per_class = {
        name: summarize(name, [r for r in records if r.cls == name], window) for name in specs
    }
    return LoadResult(
        window_s=window,
        elapsed_s=elapsed,
        speedup=cfg.speedup,
        seed=cfg.seed,
        loadgen_lag_s_max=lag_max,
        overall=summarize("all", records, window),
        per_class=per_class,
        backend=backend,
        records=tuple(records),
    )
