"""Tests of the vLLM simulator: the pure scheduler core (no event loop, no sleeps) and the HTTP
server on 127.0.0.1 (random port, high speedup)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.sim.__main__ import config_from_args
from bench.sim.api import SimRequestError, count_prompt_tokens, parse_request
from bench.sim.metrics import ITL_BUCKETS, BulkHistogram
from bench.sim.profiles import PROFILES, EngineConfig, Profile
from bench.sim.scheduler import Scheduler, StepOutcome
from bench.sim.server import SimConfig, SimServer, start_server

H100 = PROFILES["h100"]
T = TypeVar("T")


def step(profile: Profile, prefill: int, decode: int) -> float:
    return profile.b0_s + profile.b1_s * prefill + profile.b2_s * decode


# ---------------------------------------------------------------------------------------------
# Pure core
# ---------------------------------------------------------------------------------------------


def test_profiles_step_time() -> None:
    assert H100.step_time_s(prefill_tokens=0, decode_tokens=0) == pytest.approx(5.753e-3)
    assert H100.step_time_s(prefill_tokens=8192, decode_tokens=0) == pytest.approx(
        5.753e-3 + 8192 * 17.25e-6
    )
    assert H100.step_time_s(prefill_tokens=100, decode_tokens=256) == pytest.approx(
        5.753e-3 + 100 * 17.25e-6 + 256 * 6.0e-6
    )
    a100 = PROFILES["a100"]
    assert a100.step_time_s(prefill_tokens=10, decode_tokens=10) == pytest.approx(
        16.442e-3 + 10 * 47.8e-6 + 10 * 18.2e-6
    )


def test_config_rejects_model_len_above_kv() -> None:
    with pytest.raises(ValueError):
        EngineConfig(kv_cache_tokens=1000, max_model_len=2000)


def test_single_request_timeline() -> None:
    s = Scheduler(EngineConfig())
    rid = s.add(prompt_tokens=100, max_tokens=3, arrival_s=1.0)
    plan = s.schedule(1.0)
    assert plan is not None
    assert (plan.prefill_tokens, plan.decode_tokens, plan.scheduled) == (100, 0, ((rid, 100),))
    assert plan.duration_s == pytest.approx(step(H100, 100, 0))
    assert s.kv_used == 100 and s.num_running == 1
    out = s.complete(plan)
    assert out.tokens == ((rid, 1),)
    assert out.first_tokens[0][1] == pytest.approx(step(H100, 100, 0))
    outs = s.run_until_idle(out.end_s)
    assert [(o.tokens) for o in outs] == [((rid, 2),), ((rid, 3),)]
    fin = outs[-1].finished[0]
    assert fin.output_tokens == 3 and fin.queue_s == 0.0
    assert fin.e2e_s == pytest.approx(step(H100, 100, 0) + 2 * step(H100, 0, 1))
    assert s.kv_used == 0 and not s.has_work
    assert (
        s.stats.prompt_tokens == 100
        and s.stats.generation_tokens == 3
        and s.stats.finished_requests == 1
    )


def test_chunked_prefill_shares_budget_with_decode() -> None:
    s = Scheduler(EngineConfig(max_num_batched_tokens=1000))
    a = s.add(prompt_tokens=10, max_tokens=50, arrival_s=0.0)
    s.complete(s.schedule(0.0))  # type: ignore[arg-type]  # a prefilled, now decoding
    b = s.add(prompt_tokens=2500, max_tokens=2, arrival_s=0.0)
    chunks = []
    t = 1.0
    for _ in range(3):
        plan = s.schedule(t)
        assert plan is not None
        chunks.append(dict(plan.scheduled))
        assert plan.decode_tokens == 1 and plan.prefill_tokens == plan.scheduled[1][1]
        assert plan.duration_s == pytest.approx(step(H100, plan.prefill_tokens, 1))
        out = s.complete(plan)
        t = out.end_s
    assert [c[b] for c in chunks] == [999, 999, 502]
    assert all(c[a] == 1 for c in chunks)
    assert out.first_tokens and out.first_tokens[0][0] == b  # the last chunk yields b's first token


def test_max_num_seqs_and_fcfs_queueing() -> None:
    s = Scheduler(EngineConfig(max_num_seqs=2))
    ids = [s.add(prompt_tokens=10, max_tokens=2, arrival_s=0.0) for _ in range(3)]
    plan = s.schedule(0.0)
    assert plan is not None and [r for r, _ in plan.scheduled] == ids[:2]
    assert s.num_running == 2 and s.num_waiting == 1
    outs: list[StepOutcome] = [s.complete(plan)]
    outs += s.run_until_idle(outs[0].end_s)
    finished = {f.rid: f for o in outs for f in o.finished}
    assert set(finished) == set(ids)
    assert finished[ids[2]].queue_s == pytest.approx(outs[1].end_s)  # admitted when a slot freed
    assert finished[ids[0]].queue_s == 0.0


def test_waiting_request_not_scheduled_before_arrival() -> None:
    s = Scheduler(EngineConfig())
    s.add(prompt_tokens=10, max_tokens=1, arrival_s=5.0)
    assert s.schedule(1.0) is None
    assert s.next_start_s(1.0) == 5.0
    plan = s.schedule(5.0)
    assert plan is not None


def test_kv_full_blocks_admission_head_of_line() -> None:
    s = Scheduler(EngineConfig(kv_cache_tokens=1000, max_model_len=1000))
    a = s.add(prompt_tokens=700, max_tokens=5, arrival_s=0.0)
    b = s.add(prompt_tokens=400, max_tokens=5, arrival_s=0.0)
    c = s.add(prompt_tokens=10, max_tokens=5, arrival_s=0.0)  # would fit, but FCFS: no skipping
    plan = s.schedule(0.0)
    assert plan is not None and plan.scheduled == ((a, 700),)
    assert s.num_waiting == 2
    outs = [s.complete(plan), *s.run_until_idle(plan.end_s)]
    order = [f.rid for o in outs for f in o.finished]
    assert order[0] == a and set(order) == {a, b, c}
    assert s.stats.preemptions == 0


def test_recompute_preemption_of_most_recent() -> None:
    s = Scheduler(EngineConfig(kv_cache_tokens=100, max_model_len=100))
    a = s.add(prompt_tokens=40, max_tokens=30, arrival_s=0.0)
    b = s.add(prompt_tokens=40, max_tokens=30, arrival_s=0.0)
    outs = s.run_until_idle(0.0)
    assert s.stats.preemptions == 1
    finished = {f.rid: f for o in outs for f in o.finished}
    assert finished[a].output_tokens == 30 and finished[b].output_tokens == 30
    assert finished[a].finish_s < finished[b].finish_s
    # After 10 decode steps both hold 50 tokens of KV (full at 100) and have sampled 11 tokens
    # each; at the next step a needs one more slot, so b (admitted last) is preempted. b then
    # recomputes its prompt plus its 11 tokens, which are not generated again.
    assert s.stats.prefill_tokens_computed == 40 + 40 + (40 + 11)
    assert s.stats.generation_tokens == 60
    assert s.kv_used == 0


def test_preempting_step_admits_no_waiting() -> None:
    s = Scheduler(EngineConfig(kv_cache_tokens=100, max_model_len=100))
    s.add(prompt_tokens=40, max_tokens=30, arrival_s=0.0)
    s.add(prompt_tokens=40, max_tokens=30, arrival_s=0.0)
    t = 0.0
    while True:
        plan = s.schedule(t)
        assert plan is not None
        if plan.preempted:
            assert plan.admitted == ()
            assert s.num_waiting == 1 and s.num_running == 1
            break
        t = s.complete(plan).end_s


def test_abort_frees_slot_and_counts_waste() -> None:
    s = Scheduler(EngineConfig(max_num_seqs=1))
    a = s.add(prompt_tokens=100, max_tokens=1000, arrival_s=0.0)
    b = s.add(prompt_tokens=10, max_tokens=1, arrival_s=0.0)
    t = 0.0
    for _ in range(5):
        t = s.complete(s.schedule(t)).end_s  # type: ignore[arg-type]
    plan = s.schedule(t)
    assert plan is not None and plan.scheduled == ((a, 1),)
    info = s.abort(a)  # the client disconnects while the step runs
    assert info is not None and info.was_running and info.generated_tokens == 5
    assert s.kv_used == 0 and s.num_running == 0
    out = s.complete(plan)
    assert out.tokens == ()  # the aborted request's output is dropped
    assert s.stats.aborted_requests == 1
    assert s.stats.aborted_generation_tokens == 5 and s.stats.aborted_prefill_tokens == 100
    plan = s.schedule(out.end_s)
    assert plan is not None and plan.scheduled == ((b, 10),)
    assert s.abort(12345) is None


def test_abort_waiting_request_wastes_nothing() -> None:
    s = Scheduler(EngineConfig())
    rid = s.add(prompt_tokens=10, max_tokens=5, arrival_s=0.0)
    assert s.abort(rid) is not None
    assert s.stats.aborted_requests == 1 and s.stats.aborted_generation_tokens == 0
    assert not s.has_work


def test_token_gaps_one_per_token_after_the_first() -> None:
    s = Scheduler(EngineConfig())
    s.add(prompt_tokens=100, max_tokens=4, arrival_s=0.0)
    s.add(prompt_tokens=50, max_tokens=2, arrival_s=0.0)
    outs = s.run_until_idle()
    assert outs[0].first_tokens and outs[0].token_gaps == ()  # the prefill step: first tokens
    # Both decode in the next step, which is one gap of that step's length for each of them.
    ((gap, n),) = outs[1].token_gaps
    assert gap == pytest.approx(step(H100, 0, 2)) and n == 2
    for out in outs[2:]:
        ((gap, n),) = out.token_gaps
        assert gap == pytest.approx(step(H100, 0, 1)) and n == 1
    assert len(outs) == 4
    assert sum(n for o in outs for _, n in o.token_gaps) == (4 - 1) + (2 - 1)


def test_token_gap_after_preemption_spans_the_recompute() -> None:
    s = Scheduler(EngineConfig(kv_cache_tokens=100, max_model_len=100))
    s.add(prompt_tokens=40, max_tokens=30, arrival_s=0.0)
    s.add(prompt_tokens=40, max_tokens=30, arrival_s=0.0)
    outs = s.run_until_idle()
    gaps = [(gap, n) for o in outs for gap, n in o.token_gaps]
    assert s.stats.preemptions == 1 and sum(n for _, n in gaps) == 2 * (30 - 1)
    # The preempted request waits for the other to finish (19 more decode steps), then
    # recomputes its prompt and 11 tokens: that one gap is the longest by far.
    longest = max(gap for gap, _ in gaps)
    assert longest > 19 * step(H100, 0, 1) + step(H100, 51, 0)
    assert sorted(gap for gap, _ in gaps)[-2] < 2 * step(H100, 0, 2)


def test_speed_factor_applies_from_the_next_step() -> None:
    s = Scheduler(EngineConfig())
    s.add(prompt_tokens=100, max_tokens=3, arrival_s=0.0)
    plan = s.schedule(0.0)
    assert plan is not None and plan.duration_s == pytest.approx(step(H100, 100, 0))
    s.set_speed_factor(0.5)  # while the step runs: it keeps its duration
    out = s.complete(plan)
    assert out.end_s == pytest.approx(step(H100, 100, 0))
    plan = s.schedule(out.end_s)
    assert plan is not None and plan.duration_s == pytest.approx(2 * step(H100, 0, 1))
    s.set_speed_factor(10)
    s.complete(plan)
    plan = s.schedule(out.end_s)
    assert plan is not None and plan.duration_s == pytest.approx(step(H100, 0, 1) / 10)
    for bad in (0.0, -1.0, 10.01, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="speed factor must be > 0 and <= 10"):
            s.set_speed_factor(bad)
    assert s.speed_factor == 10


def test_bulk_histogram_buckets() -> None:
    h = BulkHistogram((0.01, 0.1))
    h.observe(0.01, 3)  # on a bound: counted in that bucket (le means <=)
    h.observe(0.05)
    h.observe(7.0, 2)
    assert h.cumulative() == [("0.01", 3.0), ("0.1", 4.0), ("+Inf", 6.0)]
    assert h.count == 6 and h.sum == pytest.approx(0.03 + 0.05 + 14.0)


# ---------------------------------------------------------------------------------------------
# Request parsing
# ---------------------------------------------------------------------------------------------


def test_prompt_token_counting() -> None:
    chat = {
        "messages": [
            {"role": "system", "content": "x" * 8},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "y" * 5},
                    {"type": "image_url", "image_url": {"url": "u"}},
                ],
            },
        ]
    }
    assert count_prompt_tokens(chat, chat=True) == 4  # ceil(13 / 4)
    assert count_prompt_tokens({"prompt": "abcd" * 10}, chat=False) == 10
    assert count_prompt_tokens({"prompt": [1, 2, 3]}, chat=False) == 3
    assert count_prompt_tokens({"prompt": [[1, 2], [3]]}, chat=False) == 3
    assert count_prompt_tokens({"prompt": ""}, chat=False) == 1
    with pytest.raises(SimRequestError):
        count_prompt_tokens({"messages": []}, chat=True)


def test_parse_request_fields() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 7,
        "max_completion_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    p = parse_request(body, chat=True, max_model_len=8192)
    assert (p.prompt_tokens, p.max_tokens, p.stream, p.include_usage) == (1, 9, True, True)
    p = parse_request({"prompt": "hi"}, chat=False, max_model_len=8192, prompt_tokens_header="500")
    assert (p.prompt_tokens, p.max_tokens, p.stream, p.include_usage) == (500, 16, False, False)
    with pytest.raises(SimRequestError):
        parse_request({"prompt": "hi", "max_tokens": 0}, chat=False, max_model_len=8192)
    with pytest.raises(SimRequestError):
        parse_request({"prompt": "hi"}, chat=False, max_model_len=8192, prompt_tokens_header="x")


def test_context_length_error_message() -> None:
    with pytest.raises(SimRequestError) as ei:
        parse_request({"prompt": "a" * 400, "max_tokens": 2000}, chat=False, max_model_len=2048)
    assert ei.value.status == 400
    assert ei.value.body() == {
        "error": {
            "message": "This model's maximum context length is 2048 tokens. However, you requested "
            "2100 tokens (100 in the messages, 2000 in the completion). Please reduce the "
            "length of the messages or completion.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }


# ---------------------------------------------------------------------------------------------
# HTTP server
# ---------------------------------------------------------------------------------------------


def run(factory: Callable[[], Awaitable[T]], timeout: float = 20.0) -> T:
    async def main() -> T:
        return await asyncio.wait_for(factory(), timeout)

    return asyncio.run(main())


async def with_server(
    config: SimConfig, body: Callable[[SimServer, aiohttp.ClientSession], Awaitable[T]]
) -> T:
    server = await start_server(config, host="127.0.0.1", port=0)
    try:
        async with aiohttp.ClientSession() as session:
            return await body(server, session)
    finally:
        await server.close()


def parse_sse(raw: bytes) -> list[Any]:
    assert raw.endswith(b"\n\n")
    events = raw.split(b"\n\n")[:-1]
    out: list[Any] = []
    for ev in events:
        assert ev.startswith(b"data: "), ev
        payload = ev[len(b"data: ") :]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


FAST = SimConfig(speedup=200.0)


def test_http_non_streaming_chat() -> None:
    async def body(server: SimServer, session: aiohttp.ClientSession) -> None:
        req = {"model": "m", "messages": [{"role": "user", "content": "a" * 400}], "max_tokens": 5}
        async with session.post(server.url + "/v1/chat/completions", json=req) as resp:
            assert resp.status == 200
            data = await resp.json()
            ttft = float(resp.headers["x-sim-ttft-s"])
            e2e = float(resp.headers["x-sim-e2e-s"])
        assert data["object"] == "chat.completion"
        assert data["choices"][0]["message"] == {"role": "assistant", "content": " tok" * 5}
        assert data["choices"][0]["finish_reason"] == "length"
        assert data["usage"] == {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105}
        assert ttft == pytest.approx(step(H100, 100, 0), abs=1e-6)
        assert e2e == pytest.approx(step(H100, 100, 0) + 4 * step(H100, 0, 1), abs=1e-6)

    run(lambda: with_server(FAST, body))


def test_http_streaming_chat_with_usage() -> None:
    async def body(server: SimServer, session: aiohttp.ClientSession) -> None:
        req = {
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with session.post(server.url + "/v1/chat/completions", json=req) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = parse_sse(await resp.read())
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert len({c["id"] for c in chunks}) == 1
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
        assert len(content) == 4
        assert [c["choices"][0]["finish_reason"] for c in content] == [None, None, None, "length"]
        usage = chunks[-1]
        assert usage["choices"] == [] and usage["usage"] == {
            "prompt_tokens": 2,
            "completion_tokens": 4,
            "total_tokens": 6,
        }

    run(lambda: with_server(FAST, body))


def test_http_streaming_completions_without_usage() -> None:
    async def body(server: SimServer, session: aiohttp.ClientSession) -> None:
        req = {"prompt": [1, 2, 3], "max_tokens": 3, "stream": True}
        async with session.post(server.url + "/v1/completions", json=req) as resp:
            events = parse_sse(await resp.read())
        assert events[-1] == "[DONE]"
        texts = [e["choices"][0]["text"] for e in events[:-1]]
        assert texts == [" tok"] * 3
        assert all("usage" not in e for e in events[:-1])
        assert events[-2]["choices"][0]["finish_reason"] == "length"

    run(lambda: with_server(FAST, body))


def test_http_errors() -> None:
    cfg = SimConfig(engine=EngineConfig(max_model_len=1024), speedup=200.0)

    async def body(server: SimServer, session: aiohttp.ClientSession) -> None:
        req = {
            "messages": [{"role": "user", "content": "a" * 4000}],
            "max_tokens": 100,
            "stream": True,
        }
        async with session.post(server.url + "/v1/chat/completions", json=req) as resp:
            assert resp.status == 400
            err = (await resp.json())["error"]
        assert err["type"] == "BadRequestError" and err["code"] == 400
        assert err["message"].startswith(
            "This model's maximum context length is 1024 tokens. However, "
            "you requested 1100 tokens (1000 in the messages, 100 in the"
        )
        async with session.post(server.url + "/v1/completions", data=b"{not json") as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == 400
        async with session.get(server.url + "/sim/stats") as resp:
            stats = await resp.json()
        assert stats["rejected_requests"] == 2 and stats["requests_added"] == 0

    run(lambda: with_server(cfg, body))


def test_http_models_health_metrics() -> None:
    async def body(server: SimServer, session: aiohttp.ClientSession) -> None:
        async with session.get(server.url + "/health") as resp:
            assert resp.status == 200
        async with session.get(server.url + "/v1/models") as resp:
            models = await resp.json()
        assert models["data"][0]["id"] == FAST.model_name
        async with session.post(
            server.url + "/v1/completions", json={"prompt": "abcd", "max_tokens": 2}
        ) as resp:
            assert resp.status == 200
        async with session.get(server.url + "/metrics") as resp:
            text = await resp.text()
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:time_to_first_token_seconds_bucket",
            "vllm:e2e_request_latency_seconds_count",
            "vllm:request_queue_time_seconds_sum",
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm_sim:aborted_requests_total",
            "vllm_sim:aborted_generation_tokens_total",
            "vllm_sim:finished_requests_total",
        ):
            assert name in text, name
        assert (
            f'vllm:generation_tokens_total{{engine="0",model_name="{FAST.model_name}"}} 2.0' in text
        )

    run(lambda: with_server(FAST, body))


async def _poll_stats(
    server: SimServer, session: aiohttp.ClientSession, pred: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    stats: dict[str, Any] = {}
    for _ in range(200):
        async with session.get(server.url + "/sim/stats") as resp:
            stats = await resp.json()
        if pred(stats):
            return stats
        await asyncio.sleep(0.01)
    raise AssertionError(f"condition not reached: {stats}")


def test_stream_disconnect_aborts_and_frees_slot() -> None:
    # One sequence slot: a second request can only run once the first one's slot is freed.
    cfg = SimConfig(engine=EngineConfig(max_num_seqs=1), speedup=10.0)

    async def body(server: SimServer, session: aiohttp.ClientSession) -> None:
        long_req = {
            "messages": [{"role": "user", "content": "a" * 400}],
            "max_tokens": 8000,
            "stream": True,
        }
        resp = await session.post(server.url + "/v1/chat/completions", json=long_req)
        seen = 0
        async for _ in resp.content.iter_any():
            seen += 1
            if seen >= 3:
                break
        waiter = asyncio.create_task(
            session.post(server.url + "/v1/completions", json={"prompt": "abcd", "max_tokens": 2})
        )
        await _poll_stats(server, session, lambda s: s["num_requests_waiting"] == 1)
        resp.close()  # client disconnects mid-stream
        stats = await _poll_stats(server, session, lambda s: s["aborted_requests"] == 1)
        assert stats["aborted_generation_tokens"] > 0
        assert stats["aborted_prefill_tokens"] == 100
        second = await waiter
        assert second.status == 200
        await second.read()
        stats = await _poll_stats(server, session, lambda s: s["finished_requests"] == 1)
        assert stats["num_requests_running"] == 0 and stats["kv_cache_used_tokens"] == 0

    run(lambda: with_server(cfg, body))


def test_non_streaming_client_timeout_aborts() -> None:
    cfg = SimConfig(speedup=20.0)

    async def body(server: SimServer, session: aiohttp.ClientSession) -> None:
        req = {"prompt": "abcd" * 10, "max_tokens": 5000}
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(
                server.url + "/v1/completions", json=req, timeout=aiohttp.ClientTimeout(total=0.2)
            ) as resp:
                await resp.read()
        stats = await _poll_stats(server, session, lambda s: s["aborted_requests"] == 1)
        assert stats["num_requests_running"] == 0 and stats["kv_cache_used_tokens"] == 0
        assert 0 < stats["aborted_generation_tokens"] < 5000
        assert stats["finished_requests"] == 0

    run(lambda: with_server(cfg, body))


def test_speedup_reports_simulated_time() -> None:
    # 200 decode steps of a single request take ~1.2 simulated seconds; at speedup 100 that is
    # ~12 ms of wall time, and the simulated timings must not depend on the speedup.
    cfg = SimConfig(speedup=100.0)

    async def body(server: SimServer, session: aiohttp.ClientSession) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with session.post(
            server.url + "/v1/completions", json={"prompt": "abcd", "max_tokens": 200}
        ) as resp:
            e2e = float(resp.headers["x-sim-e2e-s"])
            await resp.read()
        wall = loop.time() - t0
        assert e2e == pytest.approx(step(H100, 1, 0) + 199 * step(H100, 0, 1), abs=1e-6)
        assert wall < e2e  # faster than real time
        async with session.get(server.url + "/sim/stats") as r:
            stats = await r.json()
        assert stats["speedup"] == 100.0 and stats["lag_s_max"] >= 0.0

    run(lambda: with_server(cfg, body))


def histogram(text: str, name: str) -> dict[str, float]:
    """``{"count": ..., "sum": ..., "le=<bound>": ...}`` of one histogram in a /metrics body."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                out[f"le={sample.labels['le']}"] = sample.value
            elif sample.name.endswith(("_count", "_sum")):
                out[sample.name.rsplit("_", 1)[1]] = sample.value
    return out


ITL = "vllm:inter_token_latency_seconds"
TPOT = "vllm:time_per_output_token_seconds"
TTFT = "vllm:time_to_first_token_seconds"


def test_http_inter_token_latency_histograms() -> None:
    async def body(server: SimServer, session: aiohttp.ClientSession) -> None:
        async def metrics() -> str:
            async with session.get(server.url + "/metrics") as resp:
                return await resp.text()

        assert histogram(await metrics(), ITL)["count"] == 0
        k = 7
        req = {"prompt": "abcd" * 100, "max_tokens": k, "stream": True}
        async with session.post(server.url + "/v1/completions", json=req) as resp:
            events = parse_sse(await resp.read())
        assert len(events) == k + 1  # k tokens and [DONE]
        text = await metrics()
        itl, tpot, ttft = histogram(text, ITL), histogram(text, TPOT), histogram(text, TTFT)
        assert itl == tpot  # the same observations under both names
        assert itl["count"] == k - 1
        # Simulated seconds, not wall ones (200x less): each gap is one decode step of one token.
        assert itl["sum"] == pytest.approx((k - 1) * step(H100, 0, 1))
        assert [b for b in itl if b.startswith("le=")] == [
            *(f"le={b}" for b in ITL_BUCKETS),
            "le=+Inf",
        ]
        assert itl["le=0.01"] == k - 1  # an H100 decode step of one request is ~6 ms
        # TTFT is observed once, when the prefill step (100 prompt tokens) yields the token.
        assert ttft["count"] == 1 and ttft["sum"] == pytest.approx(step(H100, 100, 0))
        req = {"prompt": "abcd", "max_tokens": 1}  # a single token has no gap
        async with session.post(server.url + "/v1/completions", json=req) as resp:
            assert resp.status == 200
        assert histogram(await metrics(), ITL)["count"] == k - 1

    run(lambda: with_server(FAST, body))


def test_http_gauges_are_live() -> None:
    # One sequence slot: a long stream runs, a second request waits behind it.
    cfg = SimConfig(engine=EngineConfig(max_num_seqs=1), speedup=10.0)

    async def body(server: SimServer, session: aiohttp.ClientSession) -> None:
        def gauge(text: str, name: str) -> float:
            (family,) = [f for f in text_string_to_metric_families(text) if f.name == name]
            (sample,) = family.samples
            return sample.value

        req = {"prompt": "abcd" * 100, "max_tokens": 8000, "stream": True}
        resp = await session.post(server.url + "/v1/completions", json=req)
        await resp.content.readany()
        waiter = asyncio.create_task(
            session.post(server.url + "/v1/completions", json={"prompt": "abcd", "max_tokens": 2})
        )
        await _poll_stats(server, session, lambda s: s["num_requests_waiting"] == 1)
        async with session.get(server.url + "/metrics") as r:
            text = await r.text()
        assert gauge(text, "vllm:num_requests_running") == 1
        assert gauge(text, "vllm:num_requests_waiting") == 1
        # The running request holds its prompt and the tokens generated so far.
        assert 101 / 440_000 <= gauge(text, "vllm:kv_cache_usage_perc") < 8100 / 440_000
        resp.close()
        await (await waiter).read()
        await _poll_stats(server, session, lambda s: s["finished_requests"] == 1)
        async with session.get(server.url + "/metrics") as r:
            text = await r.text()
        assert gauge(text, "vllm:num_requests_running") == 0
        assert gauge(text, "vllm:num_requests_waiting") == 0
        assert gauge(text, "vllm:kv_cache_usage_perc") == 0

    run(lambda: with_server(cfg, body))


async def _e2e(server: SimServer, session: aiohttp.ClientSession) -> float:
    """Simulated e2e latency of a 1-token prompt generating 5 tokens (header: 6 decimals)."""
    req = {"prompt": "abcd", "max_tokens": 5}
    async with session.post(server.url + "/v1/completions", json=req) as resp:
        assert resp.status == 200
        await resp.read()
        return float(resp.headers["x-sim-e2e-s"])


NORMAL_E2E = step(H100, 1, 0) + 4 * step(H100, 0, 1)


async def _speed(server: SimServer, session: aiohttp.ClientSession) -> float:
    async with session.get(server.url + "/sim/speed") as resp:
        assert resp.status == 200
        return float((await resp.json())["factor"])


def test_http_speed_change() -> None:
    async def body(server: SimServer, session: aiohttp.ClientSession) -> None:
        assert await _speed(server, session) == 1.0
        assert await _e2e(server, session) == pytest.approx(NORMAL_E2E, abs=1e-6)
        async with session.post(server.url + "/sim/speed", json={"factor": 0.5}) as resp:
            assert resp.status == 200 and await resp.json() == {"factor": 0.5}
        assert await _speed(server, session) == 0.5
        # Half as fast: every step takes twice as long.
        assert await _e2e(server, session) == pytest.approx(2 * NORMAL_E2E, abs=1e-6)
        async with session.get(server.url + "/sim/stats") as resp:
            assert (await resp.json())["speed_factor"] == 0.5
        async with session.post(server.url + "/sim/speed", json={"factor": 10}) as resp:
            assert resp.status == 200 and await resp.json() == {"factor": 10.0}
        assert await _e2e(server, session) == pytest.approx(NORMAL_E2E / 10, abs=1e-6)
        async with session.post(server.url + "/sim/speed", json={"factor": 1}) as resp:
            assert resp.status == 200
        assert await _e2e(server, session) == pytest.approx(NORMAL_E2E, abs=1e-6)

        for bad, message in (
            ({"factor": 0}, "speed factor must be > 0 and <= 10, got 0"),
            ({"factor": -1}, "speed factor must be > 0 and <= 10, got -1"),
            ({"factor": 10.5}, "speed factor must be > 0 and <= 10, got 10.5"),
            ({"factor": 10**400}, "speed factor must be > 0 and <= 10"),
            ({"factor": "fast"}, "factor must be a number"),
            ({"factor": True}, "factor must be a number"),
            ({"factor": None}, "factor must be a number"),
            ({"speed": 0.5}, 'body must be a JSON object {"factor": <number>}'),
            ([0.5], 'body must be a JSON object {"factor": <number>}'),
        ):
            async with session.post(server.url + "/sim/speed", json=bad) as resp:
                assert resp.status == 400, bad
                err = (await resp.json())["error"]
            assert err["message"].startswith(message) and err["code"] == 400, (bad, err)
        for raw in (b"{not json", b'{"factor": NaN}'):
            async with session.post(server.url + "/sim/speed", data=raw) as resp:
                assert resp.status == 400, raw
        assert await _speed(server, session) == 1.0  # nothing bad was applied

    run(lambda: with_server(FAST, body))


def test_speed_schedule_option() -> None:
    # Half as fast from the start, twice as fast from simulated second 60 (0.6 s of wall time at
    # speedup 100); the changes may be given in any order.
    config, _, _ = config_from_args(["--speedup", "100", "--speed-schedule", "60:2, 0:0.5"])
    assert config.speed_schedule == ((0.0, 0.5), (60.0, 2.0))

    async def body(server: SimServer, session: aiohttp.ClientSession) -> None:
        assert await _speed(server, session) == 0.5
        assert await _e2e(server, session) == pytest.approx(2 * NORMAL_E2E, abs=1e-6)
        async with session.get(server.url + "/sim/stats") as resp:
            stats = await resp.json()
        assert stats["sim_time_s"] < 60 and stats["speed_factor"] == 0.5
        for _ in range(300):  # at most ~3 s of wall time
            if await _speed(server, session) == 2.0:
                break
            await asyncio.sleep(0.01)
        assert await _speed(server, session) == 2.0
        # The engine was idle at second 60: the change applies to the next step started.
        assert await _e2e(server, session) == pytest.approx(NORMAL_E2E / 2, abs=1e-6)

    run(lambda: with_server(config, body))


@pytest.mark.parametrize("schedule", ["10:0", "10:11", "-1:1", "10", "x:1", "10:nan", "1:1,"])
def test_speed_schedule_option_rejects(schedule: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        config_from_args([f"--speed-schedule={schedule}"])
    assert "bad speed change" in capsys.readouterr().err
