"""``python -m bench.gateway --port 8100 --upstream http://127.0.0.1:8000 --workers 72``: the
simple shared-pool priority gateway (see :mod:`bench.gateway`); durations are wall-clock."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from aiohttp import web

from .server import GatewayConfig, create_app


def _class_timeouts(items: Sequence[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"expected CLASS=SECONDS, got {item!r}")
        out[name] = float(value)
    return out


def config_from_args(argv: Sequence[str] | None = None) -> tuple[GatewayConfig, str, int]:
    p = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--upstream", action="append", required=True, help="backend base URL")
    p.add_argument("--workers", type=int, required=True, help="requests forwarded at once")
    p.add_argument("--short-prompt", type=int, default=1024, help="short: prompt below this")
    p.add_argument("--short-output", type=int, default=128, help="and max_tokens below this")
    p.add_argument("--queue-timeout", type=float, default=60.0, help="default, wall seconds")
    p.add_argument(
        "--class-queue-timeout",
        action="append",
        default=[],
        metavar="CLASS=SECONDS",
        help="queue timeout for requests whose x-llm-class header is CLASS",
    )
    p.add_argument("--max-queue", type=int, default=10_000)
    a = p.parse_args(argv)
    config = GatewayConfig(
        upstreams=tuple(u.rstrip("/") for u in a.upstream),
        workers=a.workers,
        short_prompt=a.short_prompt,
        short_output=a.short_output,
        queue_timeout_s=a.queue_timeout,
        class_queue_timeout_s=_class_timeouts(a.class_queue_timeout),
        max_queue=a.max_queue,
    )
    return config, a.host, a.port


def main(argv: Sequence[str] | None = None) -> None:
    config, host, port = config_from_args(argv)
    web.run_app(
        create_app(config),
        host=host,
        port=port,
        handler_cancellation=True,
        access_log=None,
        print=lambda *_: print(
            f"bench.gateway: {config.workers} workers, short = prompt < {config.short_prompt} "
            f"and max_tokens < {config.short_output}, listening on http://{host}:{port}",
            flush=True,
        ),
    )


if __name__ == "__main__":
    main()
