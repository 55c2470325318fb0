"""A small OpenAI-like backend for the end-to-end tests: ``python testing/backend.py --port N``.

It answers what it received, so tests can see exactly what Envoy forwarded:
non-streamed responses carry ``echo: {body, headers}``; streamed ones (``"stream": true``) send
``x-test-chunks`` SSE chunks (default 3), each after ``x-test-delay-ms`` (default 0), the first
carrying the echo. ``GET /stats`` reports requests running, finished and aborted (client left),
so tests can see that work stops when clients leave.

Faults on request (header ``x-test-fault``): ``500`` answers 500; ``reset`` sends the first SSE
chunk then drops the connection; ``hang`` never answers (until the client leaves).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

STATS = {"running": 0, "finished": 0, "aborted": 0, "total": 0}


async def llm(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    STATS["total"] += 1
    STATS["running"] += 1
    try:
        delay = int(request.headers.get("x-test-delay-ms", "0")) / 1000
        chunks = int(request.headers.get("x-test-chunks", "3"))
        fault = request.headers.get("x-test-fault")
        if fault == "500":
            STATS["finished"] += 1
            return web.json_response({"error": {"message": "backend failure"}}, status=500)
        if fault == "hang":
            await asyncio.sleep(3600)
        echo = {
            "body": raw.decode("utf-8", "replace"),
            "headers": {k.lower(): v for k, v in request.headers.items()},
        }
        try:
            stream = bool(json.loads(raw).get("stream"))
        except (ValueError, AttributeError):
            stream = False
        if not stream:
            if delay:
                await asyncio.sleep(delay)
            resp = web.json_response(
                {
                    "id": "cmpl-test",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "ok"},
                            "finish_reason": "stop",
                        }
                    ],
                    "echo": echo,
                }
            )
            STATS["finished"] += 1
            return resp
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(chunks):
            if delay:
                await asyncio.sleep(delay)
            chunk: dict[str, object] = {
                "id": "cmpl-test",
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": f"t{i}"}}],
            }
            if i == 0:
                chunk["echo"] = echo
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if fault == "reset":
                assert request.transport is not None
                request.transport.abort()  # drop the connection mid-stream
                STATS["aborted"] += 1
                return resp
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        STATS["finished"] += 1
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        STATS["aborted"] += 1
        raise
    finally:
        STATS["running"] -= 1


async def passthrough(request: web.Request) -> web.Response:
    return web.json_response(
        {
            "path": request.path,
            "headers": {k.lower(): v for k, v in request.headers.items()},
            "body": (await request.read()).decode("utf-8", "replace"),
        }
    )


async def stats(_: web.Request) -> web.Response:
    return web.json_response(STATS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", llm)
    app.router.add_post("/v1/completions", llm)
    app.router.add_get("/health", lambda _: web.Response(text="ok"))
    app.router.add_get("/stats", stats)
    app.router.add_route("*", "/{tail:.*}", passthrough)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
