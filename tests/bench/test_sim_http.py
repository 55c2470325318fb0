"""Tests of the vLLM simulator's HTTP server on 127.0.0.1 (random port, high speedup): the
OpenAI endpoints, streaming, errors, metrics and gauges, disconnects, speed changes. The pure
scheduler core is tests/bench/test_sim.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.sim.metrics import ITL_BUCKETS
from bench.sim.profiles import PROFILES, EngineConfig, Profile
from bench.sim.server import SimConfig, SimServer, start_server
from testing.wait import until_async

H100 = PROFILES["h100"]
T = TypeVar("T")


def step(profile: Profile, prefill: int, decode: int) -> float:
    return profile.b0_s + profile.b1_s * prefill + profile.b2_s * decode


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


async def _stats_when(server: SimServer, key: str, want: int) -> dict[str, Any]:
    """The simulator's stats (what /sim/stats serves, read in this process) once ``key`` is
    ``want``."""

    def check() -> dict[str, Any] | None:
        stats = server.engine.stats_dict()
        return stats if stats[key] == want else None

    found: dict[str, Any] = await until_async(check, f"the simulator's {key} at {want}")
    return found


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
        await _stats_when(server, "num_requests_waiting", 1)
        resp.close()  # client disconnects mid-stream
        stats = await _stats_when(server, "aborted_requests", 1)
        assert stats["aborted_generation_tokens"] > 0
        assert stats["aborted_prefill_tokens"] == 100
        second = await waiter
        assert second.status == 200
        await second.read()
        stats = await _stats_when(server, "finished_requests", 1)
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
        stats = await _stats_when(server, "aborted_requests", 1)
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
PER_REQUEST = "vllm:request_time_per_output_token_seconds"


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
        # Each finished request's mean gap, once per request (vLLM's decode time over the
        # tokens after the first), on the same buckets.
        per_request = histogram(text, PER_REQUEST)
        assert per_request["count"] == 1
        assert per_request["sum"] == pytest.approx(itl["sum"] / (k - 1))
        assert [b for b in per_request if b.startswith("le=")] == [
            b for b in itl if b.startswith("le=")
        ]
        req = {"prompt": "abcd", "max_tokens": 1}  # a single token has no gap
        async with session.post(server.url + "/v1/completions", json=req) as resp:
            assert resp.status == 200
        text = await metrics()
        assert histogram(text, ITL)["count"] == k - 1
        assert histogram(text, PER_REQUEST)["count"] == 2  # vLLM observes 0 for it
        assert histogram(text, PER_REQUEST)["le=0.01"] == 2

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
        await _stats_when(server, "num_requests_waiting", 1)
        async with session.get(server.url + "/metrics") as r:
            text = await r.text()
        assert gauge(text, "vllm:num_requests_running") == 1
        assert gauge(text, "vllm:num_requests_waiting") == 1
        # The running request holds its prompt and the tokens generated so far.
        assert 101 / 440_000 <= gauge(text, "vllm:kv_cache_usage_perc") < 8100 / 440_000
        resp.close()
        await (await waiter).read()
        await _stats_when(server, "finished_requests", 1)
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
