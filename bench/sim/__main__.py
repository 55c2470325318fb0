"""A vLLM-like OpenAI-compatible inference server simulator.

``python -m bench.sim --host 127.0.0.1 --port 8000 --profile h100 --speedup 1``; see
:mod:`bench.sim` for what it models.
"""

from __future__ import annotations

import argparse

from aiohttp import web

from .profiles import (
    DEFAULT_KV_CACHE_TOKENS,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MODEL,
    PROFILES,
    EngineConfig,
)
from .server import SimConfig, create_app


def config_from_args(argv: list[str] | None = None) -> tuple[SimConfig, str, int]:
    parser = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="h100")
    parser.add_argument(
        "--speedup", type=float, default=1.0, help="simulated seconds per wall second (default 1)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-cache-tokens", type=int, default=DEFAULT_KV_CACHE_TOKENS)
    parser.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="served model name")
    args = parser.parse_args(argv)
    engine = EngineConfig(
        profile=PROFILES[args.profile],
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_tokens=args.kv_cache_tokens,
        max_model_len=args.max_model_len,
    )
    config = SimConfig(engine=engine, speedup=args.speedup, model_name=args.model)
    return config, args.host, args.port


def main(argv: list[str] | None = None) -> None:
    try:
        config, host, port = config_from_args(argv)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    web.run_app(
        create_app(config),
        host=host,
        port=port,
        handler_cancellation=True,
        access_log=None,
        print=lambda *_: print(
            f"bench.sim: {config.engine.profile.description}, speedup "
            f"{config.speedup:g}, listening on http://{host}:{port}",
            flush=True,
        ),
    )


if __name__ == "__main__":
    main()
