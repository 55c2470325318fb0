"""The HTTP layer (aiohttp): OpenAI endpoints, ``/health``, ``/metrics``, ``/sim/stats`` and
``/sim/speed`` (``GET``: ``{"factor": 1.0}``; ``POST {"factor": 0.5}``: from the next step on the
GPU is half as fast, i.e. step times are 1/factor as long; 400 unless 0 < factor <= 10).

Served with ``handler_cancellation=True``, so that a client disconnect cancels the handler, which
aborts the request in the engine and frees its slot and KV at once.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Final

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .api import (
    ParsedRequest,
    Render,
    SimRequestError,
    dumps,
    parse_request,
    parse_speed_factor,
    token_usage,
)
from .engine import RequestHandle, SimEngine
from .metrics import make_registry
from .profiles import DEFAULT_MODEL, EngineConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """Everything needed to build a simulator app."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    speedup: float = 1.0
    model_name: str = DEFAULT_MODEL


ENGINE_KEY: Final = web.AppKey("engine", SimEngine)
REGISTRY_KEY: Final = web.AppKey("registry", CollectorRegistry)
CONFIG_KEY: Final = web.AppKey("config", SimConfig)


def _error(exc: SimRequestError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


async def _generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    config = request.app[CONFIG_KEY]
    try:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise SimRequestError("malformed JSON body") from None
        parsed = parse_request(body, chat=chat, max_model_len=config.engine.max_model_len)
    except SimRequestError as exc:
        engine.rejected_requests += 1
        return _error(exc)

    render = Render(chat=chat, model=config.model_name)
    handle = engine.submit(prompt_tokens=parsed.prompt_tokens, max_tokens=parsed.max_tokens)
    try:
        if parsed.stream:
            return await _stream(request, handle, render, parsed)
        while handle.finished is None:
            await handle.event.wait()
            handle.event.clear()
        fin = handle.finished
        headers = {
            "x-sim-queue-s": f"{fin.queue_s:.6f}",
            "x-sim-ttft-s": f"{fin.ttft_s:.6f}",
            "x-sim-e2e-s": f"{fin.e2e_s:.6f}",
        }
        usage = token_usage(fin.prompt_tokens, fin.output_tokens)
        return web.json_response(
            render.full_response(fin.output_tokens, usage), headers=headers, dumps=dumps
        )
    finally:
        # Cancelled (client disconnect), write failed, or anything else: free the slot now.
        if handle.finished is None:
            engine.abort(handle)


async def _stream(
    request: web.Request, handle: RequestHandle, render: Render, parsed: ParsedRequest
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    token = render.token_chunk()
    last = render.token_chunk("length")
    sent = 0
    try:
        while True:
            await handle.event.wait()
            handle.event.clear()
            n = handle.generated
            fin = handle.finished
            parts: list[bytes] = []
            if sent == 0 and n > 0 and render.chat:
                parts.append(render.role_chunk())  # vLLM sends the role with the first token
            if fin is not None:
                if n > sent:
                    parts.append(token * (n - sent - 1))
                    parts.append(last)
                if parsed.include_usage:
                    parts.append(
                        render.usage_chunk(token_usage(fin.prompt_tokens, fin.output_tokens))
                    )
                parts.append(b"data: [DONE]\n\n")
            elif n > sent:
                parts.append(token * (n - sent))
            sent = n
            if parts:
                await resp.write(b"".join(parts))
            if fin is not None:
                break
        await resp.write_eof()
    except ConnectionError:
        pass  # client went away mid-stream; the caller's finally aborts the request
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def models(request: web.Request) -> web.Response:
    config = request.app[CONFIG_KEY]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": config.model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "vllm",
                    "root": config.model_name,
                    "parent": None,
                    "max_model_len": config.engine.max_model_len,
                }
            ],
        }
    )


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[ENGINE_KEY].running else 503)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY_KEY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def sim_stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE_KEY].stats_dict())


async def get_sim_speed(request: web.Request) -> web.Response:
    return web.json_response({"factor": request.app[ENGINE_KEY].speed_factor})


async def set_sim_speed(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    try:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise SimRequestError("malformed JSON body") from None
        engine.set_speed_factor(parse_speed_factor(body))
    except SimRequestError as exc:
        return _error(exc)
    return web.json_response({"factor": engine.speed_factor})


def create_app(config: SimConfig = SimConfig()) -> web.Application:
    """The simulator as an aiohttp app. Serve it with ``handler_cancellation=True``."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    engine = SimEngine(config.engine, speedup=config.speedup)
    app[CONFIG_KEY] = config
    app[ENGINE_KEY] = engine
    app[REGISTRY_KEY] = make_registry(engine, config.model_name)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.stop()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/sim/stats", sim_stats)
    app.router.add_get("/sim/speed", get_sim_speed)
    app.router.add_post("/sim/speed", set_sim_speed)
    return app


@dataclass(slots=True, kw_only=True)
class SimServer:
    """A running simulator (see :func:`start_server`)."""

    runner: web.AppRunner
    app: web.Application
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def engine(self) -> SimEngine:
        return self.app[ENGINE_KEY]

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_server(
    config: SimConfig = SimConfig(), *, host: str = "127.0.0.1", port: int = 0
) -> SimServer:
    """Start the simulator in the running event loop; ``port=0`` picks a free port."""
    app = create_app(config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_port = port
    for addr in runner.addresses:
        if isinstance(addr, tuple):
            bound_port = int(addr[1])
            break
    return SimServer(runner=runner, app=app, host=host, port=bound_port)
