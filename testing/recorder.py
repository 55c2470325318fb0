"""A backend that records every request's start and end: ``python -m testing.recorder --port N``.

The fault-injection suite (``testing.faults``) asks one question of the backend: how many
requests did it have at once, at every instant? The simulator (``bench.sim``) is polled for its
count, so a short peak between two polls goes unseen; this backend answers from its own event
loop, where a request starts when its handler is entered (Envoy has forwarded it, so the sidecar
has admitted it) and ends when the handler returns or is cancelled (the last byte is written, or
Envoy reset the stream), each stamped with ``time.monotonic()``: the history
(``testing.inflight``) is exact, and its clock is the test's.

A request (``/v1/chat/completions`` or ``/v1/completions``) is held for ``x-test-hold-ms``
milliseconds (default 300): streamed (``"stream": true``) as one SSE chunk every
``x-test-chunk-ms`` (default 100) until then, or answered whole at the end.

- ``GET /history?since=I``: the events from index ``I`` on, ``{"events": [[t, delta], ...],
  "next": J}``;
- ``GET /inflight``: ``{"in_flight": n, "max": m, "started": s, "by_hold": {ms: n}}`` now;
- ``GET /metrics``: vLLM's gauges (``vllm:num_requests_running`` = in flight, nothing waiting,
  KV cache empty), so an adaptive pool has a backend to scrape;
- ``GET /health``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from aiohttp import web

__all__ = ["RecordingBackend", "main"]


class RecordingBackend:
    """The backend's state: the events, the count now and its maximum."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int]] = []
        self.in_flight = 0
        self.max = 0
        self.started = 0
        self.by_hold: dict[str, int] = {}  # in flight now, by x-test-hold-ms

    def start(self) -> None:
        self.in_flight += 1
        self.started += 1
        self.max = max(self.max, self.in_flight)
        self.events.append((time.monotonic(), 1))

    def end(self) -> None:
        self.in_flight -= 1
        self.events.append((time.monotonic(), -1))

    async def llm(self, request: web.Request) -> web.StreamResponse:
        self.start()
        hold = request.headers.get("x-test-hold-ms", "300")
        self.by_hold[hold] = self.by_hold.get(hold, 0) + 1
        try:
            raw = await request.read()
            hold_s = int(hold) / 1000
            chunk_s = max(0.005, int(request.headers.get("x-test-chunk-ms", "100")) / 1000)
            try:
                stream = bool(json.loads(raw).get("stream"))
            except (ValueError, AttributeError):
                stream = False
            end = time.monotonic() + hold_s
            if not stream:
                await asyncio.sleep(hold_s)
                return web.json_response({"object": "chat.completion", "choices": [_choice()]})
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            while (left := end - time.monotonic()) > 0:
                await asyncio.sleep(min(chunk_s, left))
                chunk = {"object": "chat.completion.chunk", "choices": [_choice()]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.end()
            self.by_hold[hold] -= 1
            if not self.by_hold[hold]:
                del self.by_hold[hold]

    async def history(self, request: web.Request) -> web.Response:
        since = int(request.query.get("since", "0"))
        return web.json_response({"events": self.events[since:], "next": len(self.events)})

    async def now(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "in_flight": self.in_flight,
                "max": self.max,
                "started": self.started,
                "by_hold": self.by_hold,
            }
        )

    async def metrics(self, _: web.Request) -> web.Response:
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{model_name="m"}} {self.in_flight}',
            "# TYPE vllm:num_requests_waiting gauge",
            'vllm:num_requests_waiting{model_name="m"} 0',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            'vllm:kv_cache_usage_perc{model_name="m"} 0.0',
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.llm)
        app.router.add_post("/v1/completions", self.llm)
        app.router.add_get("/history", self.history)
        app.router.add_get("/inflight", self.now)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", _health)
        return app


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


def _choice() -> dict[str, Any]:
    return {"index": 0, "delta": {"content": "t"}, "message": {"content": "ok"}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    app = RecordingBackend().app()
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
