"""Open-loop load generator for OpenAI-compatible LLM endpoints (through Envoy or direct).

Design
------
* **Schedule first** (:mod:`bench.workload`): the whole arrival schedule is computed up front from
  the class specs and a seed, so runs are reproducible. Arrivals are *open loop*: each request is
  sent at its scheduled time whatever happens to earlier ones, and latencies are measured from
  the *scheduled* arrival (a late sender cannot hide queueing; the sender's own lateness is
  reported as ``loadgen_lag_s_max``).
* **Simulated time**: every duration in the configuration and the results (arrival times,
  client timeouts, retry backoffs, ``retry-after`` values, latencies) is in simulated seconds;
  on the wall clock they are divided by ``speedup``, matching ``bench.vllm_sim --speedup``.
* **Clients** behave like application clients: a request that exceeds its class's timeout is
  abandoned and its connection closed (the backend then aborts it); optional retries follow the
  OpenAI Python SDK (see :func:`should_retry`, :func:`retry_delay_s`). The timeout applies per
  attempt, like the SDK's; a request is *good* if its final answer is a complete 200 whose
  end-to-end time from the original arrival (retries included) is within the class timeout.
* **Wasted work**: if ``stats_url`` points at the simulator's ``/sim/stats``, counters are read
  before and after the run; tokens generated for requests that were later aborted measure the
  work the backend wasted on clients that had already given up.
* **Always terminates**: arrivals stop at ``duration_s`` or ``max_requests``; each request is
  bounded by its timeouts and retries; a hard cap cancels anything left after ``max_run_s``.

Pure pieces (retry policy, percentiles, summaries) are separate from the aiohttp I/O.

CLI: ``python -m bench.loadgen --url http://127.0.0.1:10000 --rate 5 --duration 60``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from email.utils import mktime_tz, parsedate_tz
from pathlib import Path
from typing import Any, Final, Literal

import aiohttp

from bench.workload import (
    DEFAULT_TRACES_DIR,
    ClassSpec,
    PlannedRequest,
    build_schedule,
    class_from_dict,
    default_classes,
)

DEFAULT_MODEL: Final = "meta-llama/Llama-3.1-8B-Instruct"
CLASS_HEADER: Final = "x-llm-class"

# --------------------------------------------------------------------------------------------
# Retry policy (OpenAI Python SDK semantics), pure
# --------------------------------------------------------------------------------------------

INITIAL_RETRY_DELAY_S: Final = 0.5
MAX_RETRY_DELAY_S: Final = 8.0
SDK_MAX_RETRIES: Final = 2


def should_retry(status: int | None, headers: Mapping[str, str] | None = None) -> bool:
    """Whether the SDK would retry: ``x-should-retry`` wins; else 408/409/429/5xx, and
    connection errors or timeouts (``status=None``)."""
    if headers is not None:
        hint = headers.get("x-should-retry")
        if hint == "true":
            return True
        if hint == "false":
            return False
    if status is None:
        return True
    return status in (408, 409, 429) or status >= 500


def retry_after_s(
    headers: Mapping[str, str] | None, *, now_epoch_s: float | None = None
) -> float | None:
    """Server-requested delay: ``retry-after-ms``, else ``retry-after`` (seconds or HTTP date)."""
    if not headers:
        return None
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return float(ms) / 1000.0
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    parsed = parsedate_tz(value)
    if parsed is None:
        return None
    if now_epoch_s is None:
        now_epoch_s = time.time()
    return float(mktime_tz(parsed) - now_epoch_s)


def retry_delay_s(
    retries_taken: int, headers: Mapping[str, str] | None = None, *, rand: float = 0.0
) -> float:
    """Delay before retry number ``retries_taken + 1``, as the SDK computes it.

    A ``retry-after(-ms)`` value in (0, 60] s is obeyed exactly; otherwise
    ``min(0.5 * 2**retries_taken, 8) * (1 - 0.25 * rand)`` with ``rand`` uniform in [0, 1).
    """
    hinted = retry_after_s(headers)
    if hinted is not None and 0 < hinted <= 60:
        return hinted
    base = min(INITIAL_RETRY_DELAY_S * 2.0 ** min(retries_taken, 1000), MAX_RETRY_DELAY_S)
    return max(0.0, base * (1 - 0.25 * rand))


# --------------------------------------------------------------------------------------------
# Configuration and results
# --------------------------------------------------------------------------------------------


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

    def hard_cap_s(self) -> float:
        if self.max_run_s is not None:
            return self.max_run_s
        worst = (
            max(c.timeout_s for c in self.classes) * (self.max_retries + 1)
            + 60.0 * self.max_retries
        )
        return self.duration_s + worst + 5.0


Outcome = Literal["ok", "http_error", "timeout", "conn_error", "cancelled"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRecord:
    """What happened to one planned request (times in simulated seconds from its arrival)."""

    index: int
    cls: str
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    outcome: Outcome
    status: int | None  # final HTTP status; None for timeout / connection error / cancelled
    ttft_s: float | None  # streamed requests: first content chunk of the final attempt
    e2e_s: float  # arrival to the end of the final attempt (retries and backoffs included)
    output_tokens: int  # tokens received by the final attempt
    attempts: int
    gave_up: bool  # the client timed out and disconnected on its final attempt
    good: bool  # complete 200 within the class timeout


@dataclass(frozen=True, slots=True, kw_only=True)
class ClassSummary:
    """Aggregates over one class (or all: ``cls == "all"``)."""

    cls: str
    requests: int
    ok: int
    good: int
    offered_rps: float
    goodput_rps: float
    goodput_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p95_s: float | None
    e2e_p99_s: float | None
    status_413: int
    status_429: int
    status_5xx: int
    timeouts: int
    other: int
    retries: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendWork:
    """Simulator counter deltas over the run (from /sim/stats)."""

    generation_tokens: int
    aborted_generation_tokens: int
    wasted_generation_frac: float
    prefill_tokens_computed: int
    aborted_prefill_tokens: int
    wasted_prefill_frac: float
    finished_requests: int
    aborted_requests: int
    preemptions: int
    sim_lag_s_max: float


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadResult:
    """Everything a run produced. ``to_dict()`` is JSON-ready."""

    window_s: float
    elapsed_s: float
    speedup: float
    seed: int
    loadgen_lag_s_max: float
    overall: ClassSummary
    per_class: dict[str, ClassSummary]
    backend: BackendWork | None
    records: tuple[RequestRecord, ...] = field(repr=False)

    def to_dict(self, *, include_records: bool = False) -> dict[str, Any]:
        out = asdict(self)
        if not include_records:
            del out["records"]
        return out


# --------------------------------------------------------------------------------------------
# Summaries (pure)
# --------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(cls: str, records: Sequence[RequestRecord], window_s: float) -> ClassSummary:
    ok = [r for r in records if r.outcome == "ok"]
    good = [r for r in ok if r.good]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2es = [r.e2e_s for r in ok]
    statuses = [r.status for r in records if r.outcome == "http_error"]
    n413 = sum(1 for s in statuses if s == 413)
    n429 = sum(1 for s in statuses if s == 429)
    n5xx = sum(1 for s in statuses if s is not None and s >= 500)
    timeouts = sum(1 for r in records if r.outcome == "timeout")
    other = len(records) - len(ok) - n413 - n429 - n5xx - timeouts
    w = window_s if window_s > 0 else float("nan")
    return ClassSummary(
        cls=cls,
        requests=len(records),
        ok=len(ok),
        good=len(good),
        offered_rps=len(records) / w,
        goodput_rps=len(good) / w,
        goodput_tokens_per_s=sum(r.output_tokens for r in good) / w,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        ttft_p99_s=percentile(ttfts, 99),
        e2e_p50_s=percentile(e2es, 50),
        e2e_p95_s=percentile(e2es, 95),
        e2e_p99_s=percentile(e2es, 99),
        status_413=n413,
        status_429=n429,
        status_5xx=n5xx,
        timeouts=timeouts,
        other=other,
        retries=sum(r.attempts - 1 for r in records),
    )


def backend_work(before: Mapping[str, Any], after: Mapping[str, Any]) -> BackendWork:
    def d(key: str) -> int:
        return int(after.get(key, 0)) - int(before.get(key, 0))

    gen, prefill = d("generation_tokens"), d("prefill_tokens_computed")
    aborted_gen, aborted_prefill = d("aborted_generation_tokens"), d("aborted_prefill_tokens")
    return BackendWork(
        generation_tokens=gen,
        aborted_generation_tokens=aborted_gen,
        wasted_generation_frac=aborted_gen / gen if gen else 0.0,
        prefill_tokens_computed=prefill,
        aborted_prefill_tokens=aborted_prefill,
        wasted_prefill_frac=aborted_prefill / prefill if prefill else 0.0,
        finished_requests=d("finished_requests"),
        aborted_requests=d("aborted_requests"),
        preemptions=d("preemptions"),
        sim_lag_s_max=float(after.get("lag_s_max", 0.0)),
    )


def _fmt(x: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def _row(s: ClassSummary) -> str:
    return (
        f"{s.cls:<12}{s.requests:>7}{s.ok:>7}{s.good:>7}{s.goodput_rps:>8.2f}"
        f"{s.goodput_tokens_per_s:>9.0f}{_fmt(s.ttft_p50_s):>8}{_fmt(s.ttft_p99_s):>8}"
        f"{_fmt(s.e2e_p50_s):>8}{_fmt(s.e2e_p99_s):>8}{s.status_413:>5}{s.status_429:>6}"
        f"{s.status_5xx:>5}{s.timeouts:>6}{s.other:>5}{s.retries:>6}"
    )


def format_table(result: LoadResult) -> str:
    """Human-readable summary of a run."""
    head = (
        f"{'class':<12}{'req':>7}{'ok':>7}{'good':>7}{'good/s':>8}{'tok/s':>9}"
        f"{'ttft50':>8}{'ttft99':>8}{'e2e50':>8}{'e2e99':>8}{'413':>5}{'429':>6}{'5xx':>5}"
        f"{'tmo':>6}{'oth':>5}{'retry':>6}"
    )
    title = (
        f"window {result.window_s:.1f}s (sim), elapsed {result.elapsed_s:.1f}s, speedup "
        f"{result.speedup:g}, loadgen lag max {result.loadgen_lag_s_max:.3f}s; times in s"
    )
    lines = [title, head]
    lines.extend(_row(s) for s in [*result.per_class.values(), result.overall])
    b = result.backend
    if b is not None:
        lines.append(
            f"backend: generated {b.generation_tokens} tokens, "
            f"{b.aborted_generation_tokens} for aborted requests "
            f"({b.wasted_generation_frac:.1%}); prefill wasted {b.wasted_prefill_frac:.1%}; "
            f"finished {b.finished_requests}, aborted {b.aborted_requests}, "
            f"preemptions {b.preemptions}, sim lag max {b.sim_lag_s_max:.3f}s"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# HTTP client
# --------------------------------------------------------------------------------------------

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
        att.outcome = "conn_error"  # transport failure or a malformed response body"
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
        att = await _attempt(session, url, body, headers, spec.timeout_s / cfg.speedup, spec.stream)
        if att.outcome in ("ok",) or attempts > cfg.max_retries:
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
        schedule = build_schedule(
            cfg.classes,
            duration_s=cfg.duration_s,
            max_requests=cfg.max_requests,
            seed=cfg.seed,
            traces_dir=cfg.traces_dir,
        )
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
                            f"loadgen: request {pr.index} failed: {task.exception()!r}",
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


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> tuple[LoadConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(
        prog="python -m bench.loadgen",
        description="Open-loop LLM load generator (times in simulated seconds).",
    )
    p.add_argument("--url", default="http://127.0.0.1:10000", help="base URL of the endpoint")
    p.add_argument(
        "--stats-url",
        default=None,
        help="simulator stats URL for wasted-work accounting, e.g. http://127.0.0.1:8000/sim/stats",
    )
    p.add_argument("--rate", type=float, default=5.0, help="total arrivals per simulated second")
    p.add_argument("--duration", type=float, default=60.0, help="arrival window, simulated seconds")
    p.add_argument("--max-requests", type=int, default=10_000)
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--arrivals",
        choices=("poisson", "trace"),
        default="poisson",
        help="Poisson arrivals, or replay each class's trace scaled to its rate",
    )
    p.add_argument(
        "--interactive-share",
        type=float,
        default=0.8,
        help="share of the rate for the interactive class (rest: batch)",
    )
    p.add_argument(
        "--classes",
        default=None,
        help="JSON list of class objects (ClassSpec fields), replaces the default mix; "
        "a path to a JSON file also works",
    )
    p.add_argument("--traces-dir", default=None, help=f"default {DEFAULT_TRACES_DIR}")
    p.add_argument(
        "--max-retries", type=int, default=0, help="OpenAI-SDK-style retries (SDK default 2)"
    )
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompt-tokens-header", action="store_true", help="send x-sim-prompt-tokens")
    p.add_argument(
        "--max-run", type=float, default=None, help="hard cap on the run, simulated seconds"
    )
    p.add_argument(
        "--json-out", default=None, help="write the result as JSON here ('-' for stdout)"
    )
    p.add_argument("--records", action="store_true", help="include per-request records in the JSON")
    args = p.parse_args(argv)
    if args.classes:
        raw = args.classes
        if not raw.lstrip().startswith("[") and Path(raw).exists():
            raw = Path(raw).read_text()
        classes = tuple(class_from_dict(d) for d in json.loads(raw))
    else:
        classes = default_classes(
            args.rate, interactive_share=args.interactive_share, arrivals=args.arrivals
        )
    cfg = LoadConfig(
        url=args.url,
        classes=classes,
        duration_s=args.duration,
        max_requests=args.max_requests,
        speedup=args.speedup,
        seed=args.seed,
        max_retries=args.max_retries,
        stats_url=args.stats_url,
        traces_dir=args.traces_dir,
        model=args.model,
        prompt_tokens_header=args.prompt_tokens_header,
        max_run_s=args.max_run,
    )
    return cfg, args


def main(argv: list[str] | None = None) -> None:
    cfg, args = _parse_args(argv)
    result = asyncio.run(run_load(cfg))
    print(format_table(result), file=sys.stderr if args.json_out == "-" else sys.stdout)
    if args.json_out:
        text = json.dumps(result.to_dict(include_records=args.records), indent=2)
        if args.json_out == "-":
            print(text)
        else:
            Path(args.json_out).write_text(text + "\n")


if __name__ == "__main__":
    main()
