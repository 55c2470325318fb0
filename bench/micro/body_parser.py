"""What the body parser costs per request, in process: ``python -m bench.micro.body_parser
[--n 2000]``.

``extproc.request.parse.parse_body`` (UTF-8 decode, JSON with duplicate keys, NaN and
Infinity refused, then the few facts admission needs) against ``json.loads`` of the same
bytes, what the naive ext_proc server of ``bench.overhead`` does with a body, on four bodies:
the overhead bench's ~1 KB chat (``bench.overhead.ways.chat_body``), a 16 KB conversation of
80 turns, a 256 KB single-message prompt (retrieval-sized) and a completions prompt of 8,192
token ids. Each call is timed on its own with ``perf_counter_ns``, ``--n`` times after as many
warm-up calls; the table shows p50 / p99 (``bench.common.stats.percentile``), the parser's
p50 over ``json.loads``'s, and the parser's throughput at p50.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from bench.common.stats import percentile_scaled
from bench.common.table import format_table
from bench.overhead.ways import chat_body
from extproc.request.parse import Endpoint, parse_body

__all__ = ["BODIES", "main", "parse_costs"]

_TURN = "Could you summarise the booking rules for a change of dates, point by point? " * 2


def _conversation(turns: int) -> bytes:
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"[{i}] {_TURN}"}
        for i in range(turns)
    ]
    return json.dumps({"model": "m", "messages": messages, "max_tokens": 256}).encode()


def _long_prompt(size: int) -> bytes:
    text = ("Retrieved passage: the quick brown fox jumps over the lazy dog. " * (size // 64))[
        :size
    ]
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


# name -> (endpoint, body)
BODIES: dict[str, tuple[Endpoint, bytes]] = {
    "chat 1 KB": (Endpoint.CHAT, chat_body(with_max_tokens=True)),
    "chat 16 KB, 80 turns": (Endpoint.CHAT, _conversation(80)),
    "chat 256 KB, 1 message": (Endpoint.CHAT, _long_prompt(256 * 1024)),
    "completions, 8192 ids": (
        Endpoint.COMPLETIONS,
        json.dumps({"model": "m", "prompt": list(range(8192)), "max_tokens": 16}).encode(),
    ),
}


def _timed_us(call: Callable[[], Any], n: int) -> list[float]:
    for _ in range(n):
        call()
    clock = time.perf_counter_ns
    out = []
    for _ in range(n):
        t0 = clock()
        call()
        out.append((clock() - t0) / 1e3)
    return out


def parse_costs(n: int) -> dict[str, dict[str, float]]:
    """{body: {bytes, json_p50_us, json_p99_us, parse_p50_us, parse_p99_us}}."""
    out = {}
    for name, (endpoint, body) in BODIES.items():
        floor = _timed_us(lambda body=body: json.loads(body), n)  # type: ignore[misc]
        ours = _timed_us(lambda e=endpoint, b=body: parse_body(e, b), n)  # type: ignore[misc]
        out[name] = {
            "bytes": float(len(body)),
            "json_p50_us": percentile_scaled(floor, 50),
            "json_p99_us": percentile_scaled(floor, 99),
            "parse_p50_us": percentile_scaled(ours, 50),
            "parse_p99_us": percentile_scaled(ours, 99),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.micro.body_parser", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--n", type=int, default=2000, help="timed calls per body and parser")
    costs = parse_costs(parser.parse_args(argv).n)
    rows = [
        [
            name,
            f"{c['bytes']:,.0f}",
            f"{c['json_p50_us']:.1f} / {c['json_p99_us']:.1f}",
            f"{c['parse_p50_us']:.1f} / {c['parse_p99_us']:.1f}",
            f"{c['parse_p50_us'] / c['json_p50_us']:.2f}x",
            f"{c['bytes'] / c['parse_p50_us']:.0f}",
        ]
        for name, c in costs.items()
    ]
    headers = ["body", "bytes", "json.loads us p50/p99", "parse_body us p50/p99", "parse/json"]
    print(format_table([*headers, "parse MB/s"], rows))


if __name__ == "__main__":
    main()
