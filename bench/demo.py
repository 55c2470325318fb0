"""``make demo``: a busy LLM server behind Envoy and the sidecar, hit by a mixed burst.

Starts the vLLM-like simulator (H100 profile, real time), the sidecar with its embedded
default policy (extproc/config/default_policy.yaml) and Envoy with envoy/envoy.yaml, on free
ports of 127.0.0.1, and sends a batch flood and three oversize prompts at once, then
interactive chat at a fixed rate (:func:`bench.load.presets.demo_burst`). An interactive
client refused with 429 comes back once after its Retry-After (at most ``--max-retry-wait``),
with ``x-stainless-retry-count: 1``, as the OpenAI SDKs do: the ``interactive-retry`` row.

It prints one row per kind of request: how many were sent, one column per answer seen (200 and
413 always, each refusal by its status and error code, ``other`` for no HTTP answer), which add
up to ``sent``; the p50 and p99 latency of the 200s, the p50 of the 429s and the Retry-After
range. Then the sidecar's outcome counters that are not zero; it stops every process it
started. What the policy makes of the burst, with a run's output: README.md and
docs/benchmarks.md, "`make demo`". ``--backend vllm-cpu`` (``make demo-vllm``): the real
engine on one CPU core, with a smaller burst (docs/vllm.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench.common.stats import percentile
from bench.common.table import fmt, format_table
from bench.load.client import Call, Reply, attempt, send_all, session
from bench.load.presets import demo_burst
from bench.load.retry import retry_after_s
from testing.harness import wait_idle
from testing.stack import Stack
from testing.vllm import HOW, VllmServer, find_engine_python

__all__ = ["KINDS", "burst", "column", "columns", "main", "nonzero_counters", "table"]

KINDS = ("interactive", "interactive-retry", "batch", "oversize")
RETRY = {"x-stainless-retry-count": "1"}  # what the SDKs send on a second attempt
OTHER = "other"  # no HTTP answer: the connection broke or the client gave up
# What the sidecar's refusal codes mean (extproc/outcome.py), printed under the table.
CODES = {
    "queue_full": "the bucket's queue was full",
    "queue_timeout": "waited in the queue until its deadline",
    "queue_wait_too_long": "refused at once: its predicted wait is past its deadline",
}

Result = tuple[str, Reply]  # (kind of request, what it got)


async def burst(
    url: str, rate: float, seconds: float, batch: int, max_retry_wait_s: float = 10.0
) -> list[Result]:
    """Send :func:`~bench.load.presets.demo_burst` to ``url``; every attempt's answer. An
    interactive request refused with 429 is sent once more after its Retry-After (at most
    ``max_retry_wait_s``; 1 s without one), marked as the SDKs mark a retry."""
    async with session() as http:

        async def send(call: Call, at: float) -> list[Result]:
            first = await attempt(http, url, call)
            if call.label != "interactive" or first.status != 429:
                return [(call.label, first)]
            hinted = retry_after_s(first.headers)
            await asyncio.sleep(min(max_retry_wait_s, 1.0 if hinted is None else max(0.0, hinted)))
            again = replace(call, headers={**call.headers, **RETRY}, label="interactive-retry")
            return [(call.label, first), (again.label, await attempt(http, url, again))]

        sent = await send_all(demo_burst(rate, seconds, batch), send)
    return [result for _, results in sent.done for result in results]


def column(reply: Reply) -> str:
    """The column an answer counts in: ``200``; ``413``; another status with its error code
    (``429 queue_full``), or alone when the body had none; ``other``."""
    if reply.outcome == "ok":
        return "200"
    if reply.outcome != "http_error" or reply.status is None:
        return OTHER
    if reply.status == 413 or reply.code is None:
        return str(reply.status)
    return f"{reply.status} {reply.code}"


def columns(results: Sequence[Result]) -> list[str]:
    """200 and 413, then every other column seen (by status, then code), then ``other``."""
    seen = {column(r) for _, r in results} - {"200", "413", OTHER}
    ordered = sorted(seen, key=lambda c: (int(c.split()[0]), c))
    return ["200", "413", *ordered, OTHER]


def table(results: Sequence[Result]) -> str:
    """One row per kind of request; its answer columns add up to ``sent``. Latencies are
    ``bench.common.stats.percentile``."""
    answers = columns(results)
    rows = []
    for kind in KINDS:
        replies = [r for k, r in results if k == kind]
        counts = dict.fromkeys(answers, 0)
        for r in replies:
            counts[column(r)] += 1
        ok = [r.seconds for r in replies if r.outcome == "ok"]
        refused = [r for r in replies if r.status == 429]
        ras = sorted(int(ra) for r in refused if (ra := r.retry_after) and ra.isdigit())
        rows.append(
            [
                kind,
                str(len(replies)),
                *(str(counts[c]) for c in answers),
                fmt(percentile(ok, 50)),
                fmt(percentile(ok, 99)),
                fmt(percentile([r.seconds for r in refused], 50)),
                f"{ras[0]}-{ras[-1]}s" if ras else "-",
            ]
        )
    headers = ["requests", "sent", *answers, "p50 ok s", "p99 ok s", "p50 429 s", "retry-after"]
    head, *body = format_table(headers, rows).splitlines()
    codes = [c.split()[1] for c in answers if " " in c]
    legend = [f"  {code}: {CODES[code]}" for code in codes if code in CODES]
    return "\n".join([head, "-" * len(head), *body, *legend])


def nonzero_counters(metrics: str, prefix: str = "llm_extproc_requests_total") -> list[str]:
    """The samples of a Prometheus text page whose name starts with ``prefix`` and whose
    value is not zero."""
    out = []
    for line in metrics.splitlines():
        if line.startswith(prefix):
            _, _, value = line.rpartition(" ")
            if float(value) != 0:
                out.append(line)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--interactive-rate", type=float, help="req/s (250; 20 on vllm-cpu)")
    ap.add_argument("--seconds", type=float, default=4.0, help="interactive burst length")
    ap.add_argument("--batch", type=int, help="batch requests sent at once (60; 12 on vllm-cpu)")
    ap.add_argument(
        "--max-retry-wait", type=float, default=10.0, help="s, the longest a 429 is waited out"
    )
    ap.add_argument(
        "--backend",
        choices=("sim", "vllm-cpu"),
        default="sim",
        help="the simulator, or the real vLLM CPU engine (make vllm-env)",
    )
    args = ap.parse_args(argv)
    small = args.backend == "vllm-cpu"
    if args.interactive_rate is None:
        args.interactive_rate = 20.0 if small else 250.0
    if args.batch is None:
        args.batch = 12 if small else 60
    with contextlib.ExitStack() as stop:
        if args.backend == "sim":
            backend = [sys.executable, "-m", "bench.sim", "--port", "{port}", "--profile", "h100"]
            print("starting simulator (H100 profile), sidecar (embedded default policy), Envoy ...")
            stack = Stack(backend_argv=backend, envoy_concurrency=1)
        else:
            python = find_engine_python()
            if python is None:
                print(f"the vLLM CPU engine is not installed: {HOW}", file=sys.stderr)
                return 2
            tmp = Path(stop.enter_context(tempfile.TemporaryDirectory(prefix="llm-extproc-demo-")))
            print("starting vLLM (CPU engine, tiny random model; about 40 s) ...")
            vllm = stop.enter_context(
                VllmServer(tmp, "--served-model-name", "demo", python=python, max_model_len=8192)
            )
            print("starting the sidecar (embedded default policy) and Envoy ...")
            stack = Stack(backend_argv=[], running_backends=[vllm.port], log_dir=tmp)
        run(stop.enter_context(stack), args)
    print("\nall processes stopped.")
    return 0


def run(stack: Stack, args: argparse.Namespace) -> None:
    """The burst through ``stack``, and what it got."""
    print(f"  Envoy listening on {stack.url}, sidecar metrics on {stack.metrics_url}")
    print(
        f"sending {int(args.interactive_rate * args.seconds)} interactive requests over "
        f"{args.seconds:g}s, {args.batch} batch requests and 3 oversize prompts at once ..."
    )
    t0 = time.monotonic()
    results = asyncio.run(
        burst(stack.url, args.interactive_rate, args.seconds, args.batch, args.max_retry_wait)
    )
    print(f"done in {time.monotonic() - t0:.1f}s\n")
    print(table(results))
    # A stream's outcome is counted when the sidecar finishes it, a moment after the client's
    # last byte: the counters are read once nothing is in flight.
    try:
        wait_idle(stack, timeout=30)
    except AssertionError as e:
        print(f"\n{e}")
    with urllib.request.urlopen(stack.metrics_url) as r:
        metrics = r.read().decode()
    print("\nsidecar outcome counters (those not zero):")
    for line in nonzero_counters(metrics):
        print("  " + line)


if __name__ == "__main__":
    sys.exit(main())
