"""Would pacing the batch band's prefill help the streams it slows? Offline, on the simulator's
pure scheduler: ``python -m bench.micro.prefill_pacing [--seconds 600] [--seed 0]``.

Issue 20 asks that a latency breach first shrink what the least urgent band may *send*, its
prefill in prompt tokens per second, rather than what it may *hold*. The pool's band cut
(``extproc.pool.bandcut``) counts requests held. This measures, before building a pacer,
what a pacer could buy at best: the same batch prompt tokens per second reaching the engine,
held by a slot count as the band cut does, or spread perfectly evenly in time as an ideal
token pacer would, or in Poisson bursts as nothing at all would.

The engine is :class:`bench.sim.scheduler.Scheduler` (vLLM V1's scheduler state machine) on
the A100 profile, no clock: each step starts when the previous one ends. Interactive is a
closed population of ``--interactive`` streams (a finished one is replaced at once, so the
pool is always full, as when the adaptive limit binds), lengths drawn from ``azure_conv.csv``;
batch lengths from ``azure_code.csv`` (prompts of ~2k tokens, short answers), as in
``bench.compare``. The batch variants:

* ``slots k``: k batch requests held at all times (the band cut's lever, in requests);
* ``paced``: arrivals evenly spaced at the rate ``slots k`` reached (the ideal pacer);
* ``poisson``: arrivals at that rate, Poisson (no pacing and no slot bound);
* ``slots k, chunks 512``: ``slots k`` on an engine with ``max_num_batched_tokens: 512``, so
  a prompt is spread over several steps by the engine itself (vLLM's chunked prefill), which
  the front door cannot do.

Figures over ``[warm-up, end)``: the interactive answers' time per output token (vLLM's
``tpot``: decode time over the tokens after the first), the gaps between an interactive
stream's tokens (``itl``), interactive TTFT, and the batch rates. The ratio columns are each
variant's over ``slots k`` at the same k. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import random
from collections import deque
from dataclasses import dataclass
from typing import Final, Literal

from bench.common.stats import percentile_scaled
from bench.common.table import format_table
from bench.load.workload import Trace, load_trace, resolve_trace
from bench.sim.profiles import PROFILES, EngineConfig
from bench.sim.scheduler import Scheduler

__all__ = ["KS", "Figures", "Variant", "format_pacing", "pacing_table", "run_variant"]

KS: Final = (2, 4, 8)
CHUNK: Final = 2048
Batch = Literal["none", "slots", "paced", "poisson"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Variant:
    """How batch reaches the engine."""

    name: str
    batch: Batch
    k: int = 0  # slots held (``slots``)
    rate: float = 0.0  # arrivals per simulated second (``paced``, ``poisson``)
    max_batched: int = 8192  # the engine's max_num_batched_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class Figures:
    """One variant's figures over the measurement window (times in ms)."""

    batch_rps: float
    batch_prompt_tps: float  # batch prompt tokens per second that finished their prefill
    interactive_tps: float  # interactive output tokens per second
    tpot_p50_ms: float
    tpot_p90_ms: float
    itl_p90_ms: float
    itl_p99_ms: float
    ttft_p90_ms: float


def _draw(rng: random.Random, trace: Trace, max_len: int) -> tuple[int, int]:
    while True:
        j = rng.randrange(len(trace))
        p, o = trace.prompt_tokens[j], trace.output_tokens[j]
        if p + o <= max_len:
            return p, o


def _arrivals(v: Variant, seconds: float, rng: random.Random) -> deque[float]:
    if v.batch == "paced":
        n = int(seconds * v.rate)
        return deque((i + 0.5) / v.rate for i in range(n))
    out: deque[float] = deque()
    if v.batch == "poisson":
        t = rng.expovariate(v.rate)
        while t < seconds:
            out.append(t)
            t += rng.expovariate(v.rate)
    return out


def run_variant(
    v: Variant,
    *,
    interactive: int = 72,
    seconds: float = 600.0,
    warmup: float = 60.0,
    seed: int = 0,
) -> Figures:
    """Run one variant for ``seconds`` simulated seconds and return its figures."""
    cfg = EngineConfig(profile=PROFILES["a100"], max_num_batched_tokens=v.max_batched)
    sched = Scheduler(cfg)
    conv = load_trace(resolve_trace("azure_conv.csv"))
    code = load_trace(resolve_trace("azure_code.csv"))
    rng_i, rng_b, rng_t = random.Random(seed), random.Random(seed + 1), random.Random(seed + 2)
    batch_rid: set[int] = set()

    def add(cls: str, t: float) -> None:
        if cls == "batch":
            p, o = _draw(rng_b, code, cfg.max_model_len)
            batch_rid.add(sched.add(prompt_tokens=p, max_tokens=o, arrival_s=t))
        else:
            p, o = _draw(rng_i, conv, cfg.max_model_len)
            sched.add(prompt_tokens=p, max_tokens=o, arrival_s=t)

    for _ in range(interactive):
        add("interactive", 0.0)
    for _ in range(v.k if v.batch == "slots" else 0):
        add("batch", 0.0)
    arrivals = _arrivals(v, seconds, rng_t)
    last: dict[int, float] = {}
    tpot: list[float] = []
    ttft: list[float] = []
    gaps: list[float] = []
    batch_done = batch_prompt = out_tokens = 0
    t = 0.0
    while t < seconds:
        while arrivals and arrivals[0] <= t:
            add("batch", arrivals.popleft())
        plan = sched.schedule(sched.next_start_s(t))
        if plan is None:  # only batch arrivals in the future are left
            t = arrivals[0] if arrivals else seconds
            continue
        out = sched.complete(plan)
        t = out.end_s
        measured = t >= warmup
        for rid, n in out.tokens:
            if rid in batch_rid:
                continue
            if measured:
                out_tokens += 1
                if n > 1:
                    gaps.append(t - last[rid])
            last[rid] = t
        while arrivals and arrivals[0] <= t:  # keep the arrivals in time order
            add("batch", arrivals.popleft())
        for f in out.finished:
            last.pop(f.rid, None)
            if f.rid in batch_rid:
                batch_rid.discard(f.rid)
                if measured:
                    batch_done += 1
                    batch_prompt += f.prompt_tokens
                if v.batch == "slots":
                    add("batch", t)
                continue
            if measured and f.arrival_s >= warmup:
                ttft.append(f.ttft_s)
                if f.output_tokens > 1:
                    tpot.append(f.tpot_s)
            add("interactive", t)
    span = seconds - warmup
    return Figures(
        batch_rps=batch_done / span,
        batch_prompt_tps=batch_prompt / span,
        interactive_tps=out_tokens / span,
        tpot_p50_ms=percentile_scaled(tpot, 50, 1e3),
        tpot_p90_ms=percentile_scaled(tpot, 90, 1e3),
        itl_p90_ms=percentile_scaled(gaps, 90, 1e3),
        itl_p99_ms=percentile_scaled(gaps, 99, 1e3),
        ttft_p90_ms=percentile_scaled(ttft, 90, 1e3),
    )


def pacing_table(
    *, ks: tuple[int, ...] = KS, interactive: int = 72, seconds: float = 600.0, seed: int = 0
) -> list[tuple[Variant, Figures, Figures]]:
    """Every variant with its figures and the ``slots k`` figures it is compared with (the
    no-batch reference is compared with itself)."""
    kw = {"interactive": interactive, "seconds": seconds, "warmup": seconds / 10, "seed": seed}
    none = Variant(name="no batch", batch="none")
    ref = run_variant(none, **kw)
    rows = [(none, ref, ref)]
    for k in ks:
        slots = Variant(name=f"slots {k}", batch="slots", k=k)
        held = run_variant(slots, **kw)
        rows.append((slots, held, held))
        others = (
            Variant(name=f"paced (slots {k}'s rate)", batch="paced", rate=held.batch_rps),
            Variant(name=f"poisson (slots {k}'s rate)", batch="poisson", rate=held.batch_rps),
            Variant(name=f"slots {k}, chunks {CHUNK}", batch="slots", k=k, max_batched=CHUNK),
        )
        rows.extend((v, run_variant(v, **kw), held) for v in others)
    return rows


def format_pacing(rows: list[tuple[Variant, Figures, Figures]]) -> str:
    head = [
        "batch", "batch/s", "batch prompt tok/s", "interactive tok/s", "tpot p50 ms",
        "tpot p90 ms", "itl p90 ms", "itl p99 ms", "ttft p90 ms", "tpot p90 / slots",
        "itl p90 / slots",
    ]  # fmt: skip
    body = [
        [
            v.name,
            f"{f.batch_rps:.2f}",
            f"{f.batch_prompt_tps:.0f}",
            f"{f.interactive_tps:.0f}",
            f"{f.tpot_p50_ms:.1f}",
            f"{f.tpot_p90_ms:.1f}",
            f"{f.itl_p90_ms:.1f}",
            f"{f.itl_p99_ms:.1f}",
            f"{f.ttft_p90_ms:.0f}",
            f"{f.tpot_p90_ms / ref.tpot_p90_ms:.3f}",
            f"{f.itl_p90_ms / ref.itl_p90_ms:.3f}",
        ]
        for v, f, ref in rows
    ]
    return format_table(head, body)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=600.0, help="simulated seconds a variant")
    ap.add_argument("--interactive", type=int, default=72, help="interactive streams held")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(
        f"A100 profile, {a.interactive} interactive streams, {a.seconds:g} simulated s, "
        f"seed {a.seed}"
    )
    rows = pacing_table(interactive=a.interactive, seconds=a.seconds, seed=a.seed)
    print(format_pacing(rows))


if __name__ == "__main__":
    main()
