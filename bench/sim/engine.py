"""The async engine: the :class:`~bench.sim.scheduler.Scheduler` on a virtual clock tied to the
wall clock (see :mod:`bench.sim`)."""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import Histogram

from .profiles import EngineConfig
from .scheduler import FinishedRequest, Scheduler, StepOutcome

if TYPE_CHECKING:
    from .metrics import BulkHistogram

# When the engine is behind the clock it runs steps without sleeping; it yields to the event
# loop (handlers, new arrivals) at least this often, in wall seconds.
CATCH_UP_SLICE_WALL_S: Final = 0.002


@dataclass(slots=True, kw_only=True)
class RequestHandle:
    """Per-request mailbox between the engine loop and an HTTP handler."""

    rid: int
    generated: int = 0
    finished: FinishedRequest | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True, kw_only=True)
class LagStats:
    """How late step results reached the handlers, relative to the model (simulated seconds)."""

    current_s: float = 0.0
    max_s: float = 0.0
    sum_s: float = 0.0
    steps: int = 0

    def record(self, lag_s: float) -> None:
        lag_s = max(0.0, lag_s)
        self.current_s = lag_s
        self.max_s = max(self.max_s, lag_s)
        self.sum_s += lag_s
        self.steps += 1


class SimEngine:
    """Runs the :class:`Scheduler` on a virtual clock ``speedup`` times faster than the wall;
    :meth:`set_speed_factor` changes the GPU's speed (see :meth:`Scheduler.set_speed_factor`).
    """

    def __init__(self, config: EngineConfig, *, speedup: float = 1.0) -> None:
        if speedup <= 0:
            raise ValueError("speedup must be > 0")
        self.config = config
        self.speedup = speedup
        self.core = Scheduler(config)
        self.lag = LagStats()
        self.rejected_requests = 0
        self._handles: dict[int, RequestHandle] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0
        self._engine_free_s = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self.ttft_hist: Histogram | None = None
        self.e2e_hist: Histogram | None = None
        self.queue_hist: Histogram | None = None
        self.tpot_hist: Histogram | None = None
        self.itl_hist: BulkHistogram | None = None

    def now_s(self) -> float:
        """Current simulated time (seconds since start)."""
        assert self._loop is not None, "engine not started"
        return (self._loop.time() - self._t0) * self.speedup

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self._task = asyncio.create_task(self._run(), name="vllm-sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def submit(self, *, prompt_tokens: int, max_tokens: int) -> RequestHandle:
        arrival = self.now_s()
        rid = self.core.add(prompt_tokens=prompt_tokens, max_tokens=max_tokens, arrival_s=arrival)
        handle = RequestHandle(rid=rid)
        self._handles[rid] = handle
        self._wakeup.set()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        self._handles.pop(handle.rid, None)
        self.core.abort(handle.rid)

    @property
    def speed_factor(self) -> float:
        """The speed factor of a step starting now."""
        return self.core.speed_factor

    def set_speed_factor(self, factor: float) -> None:
        """Change the GPU's speed from the next step on. ValueError if out of range."""
        self.core.set_speed_factor(factor)

    async def _run(self) -> None:
        core = self.core
        loop = asyncio.get_running_loop()
        last_yield = loop.time()
        while True:
            if not core.has_work:
                self._wakeup.clear()
                await self._wakeup.wait()
                last_yield = loop.time()
                continue
            start = core.next_start_s(self._engine_free_s)
            plan = core.schedule(start)
            if plan is None:  # cannot happen with a valid config; never spin
                self._engine_free_s = max(start, self.now_s())
                await asyncio.sleep(0.001)
                continue
            delay = (plan.end_s - self.now_s()) / self.speedup
            if delay > 0:
                # Results are delivered at the step's modelled end.
                await asyncio.sleep(delay)
                last_yield = loop.time()
            elif loop.time() - last_yield >= CATCH_UP_SLICE_WALL_S:
                # Behind the clock: run steps back to back, letting handlers and new arrivals
                # in every few ms (streams then write several tokens per wake-up).
                await asyncio.sleep(0)
                last_yield = loop.time()
            outcome = core.complete(plan)
            self._engine_free_s = outcome.end_s
            self.lag.record(self.now_s() - outcome.end_s)
            self._deliver(outcome)

    def _deliver(self, outcome: StepOutcome) -> None:
        handles = self._handles
        for rid, n in outcome.tokens:
            handle = handles.get(rid)
            if handle is not None:
                handle.generated = n
                handle.event.set()
        if self.ttft_hist is not None:
            for _, ttft in outcome.first_tokens:
                self.ttft_hist.observe(ttft)
        if self.itl_hist is not None:
            for gap, count in outcome.token_gaps:
                self.itl_hist.observe(gap, count)
        for fin in outcome.finished:
            handle = handles.pop(fin.rid, None)
            if handle is not None:
                handle.finished = fin
                handle.event.set()
            if self.e2e_hist is not None and self.queue_hist is not None:
                self.e2e_hist.observe(fin.e2e_s)
                self.queue_hist.observe(fin.queue_s)
            if self.tpot_hist is not None:
                self.tpot_hist.observe(fin.tpot_s)

    def stats_dict(self) -> dict[str, Any]:
        """Counters and gauges as plain JSON-able values (the /sim/stats body)."""
        core = self.core
        out: dict[str, Any] = asdict(core.stats)
        out.update(
            num_requests_running=core.num_running,
            num_requests_waiting=core.num_waiting,
            kv_cache_used_tokens=core.kv_used,
            kv_cache_tokens=self.config.kv_cache_tokens,
            kv_cache_usage_perc=core.kv_usage,
            rejected_requests=self.rejected_requests,
            sim_time_s=self.now_s(),
            speedup=self.speedup,
            speed_factor=self.speed_factor,
            profile=self.config.profile.name,
            lag_s_current=self.lag.current_s,
            lag_s_max=self.lag.max_s,
            lag_s_mean=self.lag.sum_s / self.lag.steps if self.lag.steps else 0.0,
        )
        return out
