"""Tests of the load generator: arrival schedules (deterministic, no network), the SDK-style retry
policy (pure), and short end-to-end runs against the simulator on 127.0.0.1."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
from aiohttp import web

from bench.common.stats import percentile
from bench.load.presets import default_classes
from bench.load.retry import retry_after_s, retry_delay_s, should_retry
from bench.load.runner import LoadConfig, prompt_text, request_payload, run_load
from bench.load.summary import LoadResult
from bench.load.workload import (
    DEFAULT_TRACES_DIR,
    ClassSpec,
    Fixed,
    LogNormal,
    PlannedRequest,
    Uniform,
    build_schedule,
    load_trace,
    piecewise_poisson_arrivals,
    poisson_arrivals,
)
from bench.sim.api import count_prompt_tokens
from bench.sim.server import SimConfig, start_server

T = TypeVar("T")


def run(factory: Callable[[], Awaitable[T]], timeout: float = 25.0) -> T:
    async def main() -> T:
        return await asyncio.wait_for(factory(), timeout)

    return asyncio.run(main())


# ---------------------------------------------------------------------------------------------
# Arrivals and schedules
# ---------------------------------------------------------------------------------------------


def test_poisson_arrivals_deterministic_and_bounded() -> None:
    a = poisson_arrivals(10.0, duration_s=100.0, rng=random.Random(1), max_n=10_000)
    b = poisson_arrivals(10.0, duration_s=100.0, rng=random.Random(1), max_n=10_000)
    c = poisson_arrivals(10.0, duration_s=100.0, rng=random.Random(2), max_n=10_000)
    assert a == b and a != c
    assert all(0 <= x < 100.0 for x in a) and a == sorted(a)
    assert 900 < len(a) < 1100  # ~1000 expected, sd ~32
    gaps = [y - x for x, y in itertools.pairwise(a)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)
    assert len(poisson_arrivals(10.0, duration_s=100.0, rng=random.Random(1), max_n=7)) == 7


def test_piecewise_poisson_arrivals() -> None:
    # One piece from 0 is the constant-rate process itself, draw for draw.
    assert piecewise_poisson_arrivals(
        [(0.0, 50.0, 4.0)], rng=random.Random(3), max_n=10_000
    ) == poisson_arrivals(4.0, duration_s=50.0, rng=random.Random(3), max_n=10_000)
    pieces = [(0.0, 100.0, 2.0), (100.0, 200.0, 0.0), (200.0, 300.0, 20.0)]
    a = piecewise_poisson_arrivals(pieces, rng=random.Random(1), max_n=100_000)
    assert a == piecewise_poisson_arrivals(pieces, rng=random.Random(1), max_n=100_000)
    assert a == sorted(a) and not any(100.0 <= x < 200.0 for x in a)  # the quiet piece is quiet
    assert sum(1 for x in a if x < 100) == pytest.approx(200, rel=0.25)
    assert sum(1 for x in a if x >= 200) == pytest.approx(2000, rel=0.1)
    assert len(piecewise_poisson_arrivals(pieces, rng=random.Random(1), max_n=7)) == 7


def test_rate_schedule_in_class_and_schedule() -> None:
    spec = ClassSpec(name="i", rate=5.0, rate_schedule=((0.0, 0.0), (10.0, 30.0), (20.0, 5.0)))
    assert spec.rate_pieces(30.0) == [(0.0, 10.0, 0.0), (10.0, 20.0, 30.0), (20.0, 30.0, 5.0)]
    assert ClassSpec(name="i", rate=2.0).rate_pieces(9.0) == [(0.0, 9.0, 2.0)]
    sched = build_schedule([spec], duration_s=30.0, max_requests=10_000, seed=1)
    times = [p.t_s for p in sched]
    assert min(times) >= 10.0 and sum(1 for t in times if t < 20) == pytest.approx(300, rel=0.2)
    # Starting at the old rate with a later change keeps the arrivals before it identical.
    steady = build_schedule([ClassSpec(name="b", rate=3.0)], duration_s=30.0, max_requests=9999)
    changed = build_schedule(
        [ClassSpec(name="b", rate=3.0, rate_schedule=((15.0, 9.0),))],
        duration_s=30.0,
        max_requests=9999,
    )
    assert [p for p in steady if p.t_s < 15] == [p for p in changed if p.t_s < 15]
    for bad in (((5.0, 1.0), (2.0, 1.0)), ((-1.0, 1.0),), ((0.0, -1.0),)):
        with pytest.raises(ValueError):
            ClassSpec(name="x", rate=1.0, rate_schedule=bad)


def test_tenants_split_a_class() -> None:
    """Each tenant is a stream of its own: a light tenant's requests are the same with or
    without a heavy one beside it, and the shares follow the weights."""
    light = (("a", 0.2), ("b", 0.2))
    flood = ClassSpec(name="i", rate=54.0, tenants=(("heavy", 5.0), *light))
    alone = ClassSpec(name="i", rate=4.0, tenants=light)
    assert alone.tenant_shares() == (("a", 0.5), ("b", 0.5))
    assert ClassSpec(name="i", rate=1.0).tenant_shares() == ((None, 1.0),)
    both = build_schedule([flood], duration_s=50.0, max_requests=100_000, seed=2)
    only = build_schedule([alone], duration_s=50.0, max_requests=100_000, seed=2)
    assert [p.index for p in both] == list(range(len(both)))  # one time order, reindexed
    assert {p.tenant for p in only} == {"a", "b"}

    def mine(sched: tuple[PlannedRequest, ...], t: str) -> list[tuple[float, int, int]]:
        return [(p.t_s, p.prompt_tokens, p.output_tokens) for p in sched if p.tenant == t]

    assert mine(both, "a") == mine(only, "a") and mine(both, "b") == mine(only, "b")
    assert len(mine(both, "heavy")) == pytest.approx(50 * 50.0, rel=0.1)
    assert len(mine(both, "a")) == pytest.approx(50 * 2.0, rel=0.3)
    # Without tenants, no request has one (and no x-tenant-id is sent).
    plain = build_schedule([ClassSpec(name="i", rate=4.0)], duration_s=50.0, max_requests=9999)
    assert {p.tenant for p in plain} == {None}
    for bad in ((("a", 1.0), ("a", 2.0)), (("a", 0.0),)):
        with pytest.raises(ValueError):
            ClassSpec(name="x", rate=1.0, tenants=bad)


def _write_trace(path: Path, rows: list[tuple[float, int, int]]) -> Path:
    path.write_text(
        "arrived_at,num_prefill_tokens,num_decode_tokens\n"
        + "".join(f"{t},{p},{o}\n" for t, p, o in rows)
    )
    return path


def test_schedule_with_trace_lengths(tmp_path: Path) -> None:
    _write_trace(tmp_path / "t.csv", [(0.0, 5, 1), (1.0, 6, 2), (2.0, 7, 3), (3.0, 8, 4)])
    spec = ClassSpec(name="x", rate=50.0, trace="t.csv")  # Poisson arrivals, lengths from rows
    sched = build_schedule([spec], duration_s=10.0, max_requests=1000, seed=3, traces_dir=tmp_path)
    assert {(p.prompt_tokens, p.output_tokens) for p in sched} == {(5, 1), (6, 2), (7, 3), (8, 4)}


def test_build_schedule_mix_is_deterministic() -> None:
    classes = [
        ClassSpec(
            name="interactive",
            rate=8.0,
            prompt=LogNormal(median=200, sigma=0.5),
            output=Fixed(n=32),
        ),
        ClassSpec(name="batch", rate=2.0, prompt=Uniform(lo=1000, hi=2000), output=Fixed(n=500)),
    ]
    s1 = build_schedule(classes, duration_s=50.0, max_requests=10_000, seed=7)
    s2 = build_schedule(classes, duration_s=50.0, max_requests=10_000, seed=7)
    s3 = build_schedule(classes, duration_s=50.0, max_requests=10_000, seed=8)
    assert s1 == s2 and s1 != s3
    assert [p.index for p in s1] == list(range(len(s1)))
    assert [p.t_s for p in s1] == sorted(p.t_s for p in s1)
    n_int = sum(1 for p in s1 if p.cls == "interactive")
    n_batch = sum(1 for p in s1 if p.cls == "batch")
    assert 300 < n_int < 500 and 60 < n_batch < 140
    assert all(
        1000 <= p.prompt_tokens <= 2000 and p.output_tokens == 500 for p in s1 if p.cls == "batch"
    )
    # A class's requests do not depend on the other classes (per-class random streams).
    alone = build_schedule(classes[1:], duration_s=50.0, max_requests=10_000, seed=7)
    assert [(p.t_s, p.prompt_tokens) for p in alone] == [
        (p.t_s, p.prompt_tokens) for p in s1 if p.cls == "batch"
    ]
    capped = build_schedule(classes, duration_s=50.0, max_requests=25, seed=7)
    assert capped == s1[:25]


def test_default_classes_and_lengths() -> None:
    classes = default_classes(4.0, interactive_share=0.5)
    assert [(c.name, c.rate) for c in classes] == [("interactive", 2.0), ("batch", 2.0)]
    assert len(load_trace(DEFAULT_TRACES_DIR / "azure_conv.csv")) == 19366
    d = LogNormal(median=100, sigma=1.0, lo=10, hi=300)
    rng = random.Random(0)
    assert all(10 <= d.sample(rng) <= 300 for _ in range(1000))


def test_prompt_text_matches_simulator_count() -> None:
    for n in (1, 7, 100, 9000):
        text = prompt_text(3, n)
        assert len(text) == 4 * n
        assert (
            count_prompt_tokens({"messages": [{"role": "user", "content": text}]}, chat=True) == n
        )
    spec = ClassSpec(name="i", rate=1.0, stream=True, endpoint="completions")
    body = request_payload(
        spec, PlannedRequest(index=0, t_s=0.0, cls="i", prompt_tokens=10, output_tokens=7), "m"
    )
    assert (
        body["max_tokens"] == 7
        and body["stream"]
        and body["stream_options"] == {"include_usage": True}
    )
    assert len(body["prompt"]) == 40


# ---------------------------------------------------------------------------------------------
# Retry policy
# ---------------------------------------------------------------------------------------------


def test_should_retry_like_sdk() -> None:
    for status in (408, 409, 429, 500, 502, 503, 504):
        assert should_retry(status)
    for status in (400, 401, 404, 413, 422):
        assert not should_retry(status)
    assert should_retry(None)  # connection error / timeout
    assert should_retry(400, {"x-should-retry": "true"})
    assert not should_retry(503, {"x-should-retry": "false"})


def test_retry_backoff_schedule() -> None:
    assert [retry_delay_s(n, rand=0.0) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert retry_delay_s(0, rand=0.5) == pytest.approx(0.5 * 0.875)
    assert retry_delay_s(3, rand=0.999) == pytest.approx(4.0 * (1 - 0.25 * 0.999))
    assert retry_delay_s(40, rand=0.0) == 8.0


def test_retry_after_headers() -> None:
    assert retry_delay_s(0, {"retry-after-ms": "250", "retry-after": "3"}) == 0.25
    assert retry_delay_s(0, {"retry-after": "3"}, rand=0.9) == 3.0
    assert retry_delay_s(0, {"retry-after": "1.5"}) == 1.5
    assert retry_delay_s(1, {"retry-after": "61"}, rand=0.0) == 1.0  # out of (0, 60]: backoff
    assert retry_delay_s(1, {"retry-after": "0"}, rand=0.0) == 1.0
    assert retry_delay_s(2, {"retry-after": "soon"}, rand=0.0) == 2.0
    date = "Wed, 21 Oct 2015 07:28:30 GMT"
    assert retry_after_s({"retry-after": date}, now_epoch_s=1445412500.0) == pytest.approx(10.0)
    assert retry_after_s(None) is None and retry_after_s({}) is None


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 95) == pytest.approx(95.0)


# ---------------------------------------------------------------------------------------------
# End to end (127.0.0.1, random ports, high speedup)
# ---------------------------------------------------------------------------------------------


def test_end_to_end_against_simulator() -> None:
    speedup = 20.0
    classes = (
        ClassSpec(
            name="interactive",
            rate=6.0,
            prompt=Fixed(n=200),
            output=Fixed(n=20),
            stream=True,
            timeout_s=30.0,
        ),
        ClassSpec(
            name="batch",
            rate=2.0,
            prompt=Fixed(n=1000),
            output=Fixed(n=50),
            stream=False,
            timeout_s=300.0,
            endpoint="completions",
        ),
        # Wants 3000 tokens (~18 simulated s of decode) but gives up after 2 s: pure waste.
        ClassSpec(
            name="impatient",
            rate=1.0,
            prompt=Fixed(n=100),
            output=Fixed(n=3000),
            stream=True,
            timeout_s=2.0,
        ),
    )

    async def go() -> LoadResult:
        server = await start_server(SimConfig(speedup=speedup), host="127.0.0.1", port=0)
        try:
            cfg = LoadConfig(
                url=server.url,
                classes=classes,
                duration_s=6.0,
                max_requests=200,
                speedup=speedup,
                seed=1,
            )
            return await run_load(cfg)
        finally:
            await server.close()

    result = run(go)
    by_class = {c.name: [r for r in result.records if r.cls == c.name] for c in classes}
    n = {k: len(v) for k, v in by_class.items()}
    assert n["interactive"] > 15 and n["batch"] > 3 and n["impatient"] >= 1
    assert len(result.records) == sum(n.values())
    for name in ("interactive", "batch"):
        assert all(r.outcome == "ok" and r.good for r in by_class[name])
    assert all(
        r.output_tokens == 20 and r.ttft_s is not None
        for r in result.records
        if r.cls == "interactive"
    )
    assert all(
        r.output_tokens == 50 and r.ttft_s is None for r in result.records if r.cls == "batch"
    )
    ttft_p50 = percentile([r.ttft_s for r in by_class["interactive"] if r.ttft_s is not None], 50)
    assert ttft_p50 is not None and 0 < ttft_p50 < 1.0
    imp = by_class["impatient"]
    assert all(r.gave_up and r.outcome == "timeout" and not r.good for r in imp)
    assert all(r.output_tokens < 3000 for r in imp)  # partial stream at most, then disconnect


def test_retries_honour_retry_after() -> None:
    """A stub that answers 429 (retry-after-ms) twice, then 200; and one that always fails.
    Each attempt says how many retries came before it, as the OpenAI SDK does."""
    hits: dict[str, int] = {}
    counts: dict[str, list[str]] = {}
    tenants: dict[str, set[str]] = {}

    async def handler(request: web.Request) -> web.StreamResponse:
        cls = request.headers["x-llm-class"]
        hits[cls] = hits.get(cls, 0) + 1
        tenants.setdefault(cls, set()).add(request.headers.get("x-tenant-id", "-"))
        counts.setdefault(cls, []).append(request.headers.get("x-stainless-retry-count", "-"))
        if cls == "flaky" and hits[cls] <= 2:
            return web.json_response({"error": {}}, status=429, headers={"retry-after-ms": "500"})
        if cls == "down":
            return web.json_response({"error": {}}, status=503)
        return web.json_response({"usage": {"completion_tokens": 4}})

    async def go() -> LoadResult:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
        schedule = [
            PlannedRequest(index=0, t_s=0.0, cls="flaky", prompt_tokens=3, output_tokens=4),
            PlannedRequest(
                index=1, t_s=0.0, cls="down", prompt_tokens=3, output_tokens=4, tenant="t-7"
            ),
        ]
        classes = (
            ClassSpec(name="flaky", rate=1.0, timeout_s=10.0),
            ClassSpec(name="down", rate=1.0, timeout_s=10.0),
        )
        try:
            cfg = LoadConfig(
                url=f"http://127.0.0.1:{port}",
                classes=classes,
                duration_s=1.0,
                speedup=10.0,
                max_retries=2,
                seed=0,
            )
            return await run_load(cfg, schedule)
        finally:
            await runner.cleanup()

    result = run(go)
    flaky, down = result.records
    assert hits == {"flaky": 3, "down": 3}
    assert counts == {"flaky": ["0", "1", "2"], "down": ["0", "1", "2"]}
    # A request's tenant goes with every attempt and into its record; none: no header.
    assert tenants == {"flaky": {"-"}, "down": {"t-7"}}
    assert (flaky.tenant, down.tenant) == (None, "t-7")
    assert flaky.outcome == "ok" and flaky.attempts == 3 and flaky.good
    assert flaky.e2e_s >= 1.0  # two 0.5 s (simulated) retry-after waits
    assert down.outcome == "http_error" and down.status == 503 and down.attempts == 3
    # Backoff without retry-after: 0.5 * jitter + 1.0 * jitter, jitter in (0.75, 1].
    assert 1.1 <= down.e2e_s
