"""A vLLM-like OpenAI-compatible inference server simulator.

It stands in for a real vLLM backend in tests and benchmarks of the admission-control sidecar:
it speaks the same HTTP API (chat/completions, streaming SSE, ``/v1/models``, ``/health``,
``/metrics`` with vLLM's metric names) and reproduces vLLM's *queueing* behaviour -- continuous
batching, chunked prefill, a finite KV cache with recompute preemption, and aborting a request the
moment its client disconnects -- while the GPU is replaced by a linear step-time model.

Design
------
The module has three layers:

1. **Pure core** (:class:`Scheduler`): the V1-style scheduler state machine, no I/O, no clock.
   A step is two calls, mirroring vLLM's ``schedule()`` / ``update_from_output()``:

   * :meth:`Scheduler.schedule` picks the work of one step at simulated time ``start_s`` and
     allocates its KV cache: first the running requests in admission order (a decoding request
     needs 1 token, a prefilling one the rest of its prompt, chunked to the remaining token
     budget); if the KV cache cannot hold a running request's new tokens, the most recently
     admitted running request is preempted (KV freed, progress discarded, put back at the front
     of the waiting queue, recomputed later -- vLLM's recompute preemption). Then, only if no
     request was preempted, waiting requests are admitted FCFS while there is token budget, a
     free sequence slot (``max_num_seqs``) and KV space for their first chunk (head-of-line
     blocking, no skipping). It returns a :class:`StepPlan` whose duration is
     ``b0 + b1 * prefill_tokens + b2 * decode_tokens``.
   * :meth:`Scheduler.complete` applies the step's results at ``end_s``: computed tokens advance,
     every request whose tokens are all computed samples one output token (the step that finishes
     a prefill yields the first token), requests that reached ``max_tokens`` finish and free
     their KV. Requests aborted between the two calls are skipped (their output is dropped, as
     in vLLM).

   The KV cache is accounted in tokens (no 16-token blocks): a request holds
   ``prompt + generated`` tokens of KV, allocated as they are scheduled. ``max_model_len`` must
   not exceed the KV capacity (vLLM refuses to start otherwise), which guarantees progress: a
   single request always fits once the others are preempted.

2. **Async engine** (:class:`SimEngine`): drives the core on a *virtual clock* tied to the wall
   clock, ``sim_now = (loop.time() - t0) * speedup``. Steps are laid back to back in simulated
   time (step ``k+1`` starts exactly where step ``k`` ended), and the loop sleeps until the wall
   time at which the step ends. When the loop oversleeps (asyncio sleeps have 1 ms resolution on
   Linux) or Python is slower than the scaled step, the next steps run without sleeping (yielding
   to the handlers every 2 ms of wall time) until the engine has caught up; timestamps stay those
   of the model, so throughput and server-side
   latencies are exact, and the delay with which results reach the sockets is measured as *lag*
   (``vllm_sim:engine_lag_seconds`` gauge, ``lag_s_max`` / ``lag_s_mean`` in ``/sim/stats``).
   A request arriving while the engine is behind is stamped with its real arrival time and only
   joins steps that start after it. A lag that keeps growing means the machine cannot run this
   speedup: lower ``--speedup``.

3. **HTTP layer** (aiohttp): parses requests (:func:`parse_request`, pure), submits them to the
   engine and streams tokens as they are produced. The server runs with
   ``handler_cancellation=True`` so that a client disconnect cancels the handler, which aborts
   the request in the core and frees its slot and KV at once. Metrics are exposed from a
   per-instance :class:`prometheus_client.CollectorRegistry`.

All times reported (metrics, ``/sim/stats``, ``x-sim-*`` response headers) are simulated seconds.

Token accounting: a prompt's token count is the number of characters of its text / 4 (rounded
up, at least 1), or the value of the ``x-sim-prompt-tokens`` request header. The simulator always
generates exactly ``max_completion_tokens`` / ``max_tokens`` tokens (default 16), each the text
``" tok"``, with ``finish_reason="length"``.

Run: ``python -m bench.vllm_sim --host 127.0.0.1 --port 8000 --profile h100 --speedup 1``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------

DEFAULT_MODEL: Final = "meta-llama/Llama-3.1-8B-Instruct"

# Default KV-cache capacity, in tokens, for Llama-3.1-8B on one 80 GB GPU with vLLM's default
# gpu_memory_utilization=0.9: 0.9 * ~79.6 GiB usable = ~71.6 GiB, minus ~15 GiB of BF16 weights
# (8.03 B params), minus ~2-3 GiB of activations / CUDA graphs at 8192 batched tokens, leaves
# ~54 GiB for KV. One token of KV is 32 layers * 8 KV heads * 128 dims * 2 (K and V) * 2 bytes
# = 128 KiB, i.e. 8192 tokens per GiB, so ~54 GiB holds ~440k tokens (vLLM logs a "GPU KV cache
# size" of this order for this model on an H100 80 GB). The A100 80 GB profile uses the same.
DEFAULT_KV_CACHE_TOKENS: Final = 440_000
DEFAULT_MAX_MODEL_LEN: Final = 8192
DEFAULT_MAX_TOKENS: Final = 16
CHARS_PER_TOKEN: Final = 4
TOKEN_TEXT: Final = " tok"
# When the engine is behind the clock it runs steps without sleeping; it yields to the event
# loop (handlers, new arrivals) at least this often, in wall seconds.
CATCH_UP_SLICE_WALL_S: Final = 0.002


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """A GPU/model step-time model: ``step = b0 + b1 * prefill_tokens + b2 * decode_tokens``."""

    name: str
    b0_s: float
    b1_s: float
    b2_s: float
    description: str = ""

    def step_time_s(self, *, prefill_tokens: int, decode_tokens: int) -> float:
        """Duration in simulated seconds of one engine step."""
        return self.b0_s + self.b1_s * prefill_tokens + self.b2_s * decode_tokens


PROFILES: Final[Mapping[str, Profile]] = {
    "h100": Profile(
        name="h100",
        b0_s=5.753e-3,
        b1_s=17.25e-6,
        b2_s=6.0e-6,
        description="Llama-3.1-8B on 1x H100, vLLM 0.8 (BLIS linear fit)",
    ),
    "a100": Profile(
        name="a100",
        b0_s=16.442e-3,
        b1_s=47.8e-6,
        b2_s=18.2e-6,
        description="Llama-3.1-8B on 1x A100 80 GB (BLIS linear fit)",
    ),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Scheduler limits (vLLM's engine arguments of the same names) and the step-time profile."""

    profile: Profile = PROFILES["h100"]
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS
    max_model_len: int = DEFAULT_MAX_MODEL_LEN

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError(
                "max_num_seqs, max_num_batched_tokens must be >= 1, max_model_len >= 2"
            )
        if self.max_model_len > self.kv_cache_tokens:
            # vLLM refuses to start in this case; it also guarantees the scheduler makes progress.
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the KV cache "
                f"({self.kv_cache_tokens} tokens)"
            )


# --------------------------------------------------------------------------------------------
# Request parsing (pure)
# --------------------------------------------------------------------------------------------


class SimRequestError(Exception):
    """A request the server rejects; rendered as an OpenAI-style JSON error."""

    def __init__(
        self, message: str, *, status: int = 400, err_type: str = "BadRequestError"
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": None,
                "code": self.status,
            }
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class ParsedRequest:
    """What the simulator needs from an OpenAI request body."""

    chat: bool
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool


def _text_chars(value: Any) -> int:
    """Characters of text in a chat message ``content`` (string or list of parts)."""
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        total = 0
        for part in value:
            if isinstance(part, str):
                total += len(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                total += len(part["text"])
        return total
    raise SimRequestError("message content must be a string or a list of content parts")


def _prompt_units(prompt: Any) -> tuple[int, int]:
    """(characters, token ids) of a completions ``prompt``.

    Accepts str, list[str] (counted as one concatenated prompt, no batching), list[int] and
    list[list[int]] (token ids).
    """
    if isinstance(prompt, str):
        return len(prompt), 0
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return sum(len(p) for p in prompt), 0
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return 0, len(prompt)
        if all(isinstance(p, list) for p in prompt):
            return 0, sum(len(p) for p in prompt)
    raise SimRequestError("prompt must be a string, a list of strings or a list of token ids")


def count_prompt_tokens(body: Mapping[str, Any], *, chat: bool) -> int:
    """Prompt tokens of a request body: ceil(characters / 4) plus any token ids; at least 1."""
    chars = 0
    ids = 0
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise SimRequestError("messages must be a non-empty list")
        for message in messages:
            if not isinstance(message, Mapping):
                raise SimRequestError("each message must be an object")
            chars += _text_chars(message.get("content"))
    else:
        if "prompt" not in body:
            raise SimRequestError("prompt is required")
        chars, ids = _prompt_units(body["prompt"])
    return max(1, math.ceil(chars / CHARS_PER_TOKEN) + ids)


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SimRequestError(f"{name} must be a positive integer")
    return value


def parse_request(
    body: Any, *, chat: bool, max_model_len: int, prompt_tokens_header: str | None = None
) -> ParsedRequest:
    """Validate an OpenAI request body and extract token counts; raises :class:`SimRequestError`."""
    if not isinstance(body, Mapping):
        raise SimRequestError("request body must be a JSON object")
    if prompt_tokens_header is not None:
        try:
            prompt_tokens = _positive_int(int(prompt_tokens_header), "x-sim-prompt-tokens")
        except ValueError:
            raise SimRequestError("x-sim-prompt-tokens must be a positive integer") from None
        if chat and not isinstance(body.get("messages"), list):
            raise SimRequestError("messages must be a non-empty list")
    else:
        prompt_tokens = count_prompt_tokens(body, chat=chat)
    raw_max = body.get("max_completion_tokens") if chat else None
    if raw_max is None:
        raw_max = body.get("max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if raw_max is None else _positive_int(raw_max, "max_tokens")
    if prompt_tokens + max_tokens > max_model_len:
        raise SimRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion."
        )
    stream = bool(body.get("stream", False))
    options = body.get("stream_options")
    include_usage = stream and isinstance(options, Mapping) and bool(options.get("include_usage"))
    return ParsedRequest(
        chat=chat,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
    )


# --------------------------------------------------------------------------------------------
# Pure scheduler core
# --------------------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Sequence:
    """Mutable per-request scheduler state (internal to :class:`Scheduler`)."""

    rid: int
    prompt_tokens: int
    max_tokens: int
    arrival_s: float
    num_computed: int = 0  # tokens whose KV has been computed (prompt + generated)
    num_generated: int = 0
    kv_tokens: int = 0  # KV allocated
    prefill_computed: int = 0  # all prefill tokens ever computed, recompute included
    first_scheduled_s: float | None = None
    first_token_s: float | None = None

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.num_generated

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token is missing from the KV cache."""
        return self.num_generated > 0 and self.num_computed == self.num_tokens - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPlan:
    """The work of one engine step, as chosen by :meth:`Scheduler.schedule`."""

    start_s: float
    duration_s: float
    prefill_tokens: int
    decode_tokens: int
    scheduled: tuple[tuple[int, int], ...]  # (rid, new tokens) in scheduling order
    preempted: tuple[int, ...] = ()
    admitted: tuple[int, ...] = ()

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True, slots=True, kw_only=True)
class FinishedRequest:
    """Timing of a request that generated all its tokens (simulated seconds)."""

    rid: int
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    first_scheduled_s: float
    first_token_s: float
    finish_s: float

    @property
    def queue_s(self) -> float:
        return self.first_scheduled_s - self.arrival_s

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOutcome:
    """Results of a completed step: who got a token, who saw its first token, who finished."""

    end_s: float
    tokens: tuple[tuple[int, int], ...]  # (rid, tokens generated so far)
    first_tokens: tuple[tuple[int, float], ...]  # (rid, TTFT in simulated seconds)
    finished: tuple[FinishedRequest, ...]


@dataclass(slots=True, kw_only=True)
class SchedulerStats:
    """Monotonic counters of the core (the source of the Prometheus counters and /sim/stats)."""

    requests_added: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    aborted_generation_tokens: int = 0
    aborted_prefill_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefill_tokens_computed: int = 0
    decode_tokens_computed: int = 0
    preemptions: int = 0
    steps: int = 0
    busy_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortInfo:
    """What an abort threw away."""

    rid: int
    was_running: bool
    generated_tokens: int
    prefill_tokens: int


class Scheduler:
    """vLLM V1-style continuous-batching scheduler over a token-granular KV cache (no I/O)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.stats = SchedulerStats()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.kv_used = 0
        self._seqs: dict[int, Sequence] = {}
        self._next_rid = 0
        self._plan_open = False

    # ---- queries -----------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.kv_used / self.config.kv_cache_tokens

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def next_start_s(self, engine_free_s: float) -> float:
        """Earliest time a step can start: now if anything runs, else when the head arrived."""
        if self.running or not self.waiting:
            return engine_free_s
        return max(engine_free_s, self.waiting[0].arrival_s)

    def __contains__(self, rid: int) -> bool:
        return rid in self._seqs

    # ---- mutations ---------------------------------------------------------------------
    def add(self, *, prompt_tokens: int, max_tokens: int, arrival_s: float) -> int:
        """Queue a request (FCFS); returns its id. Callers add in non-decreasing arrival order."""
        if prompt_tokens < 1 or max_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be >= 1")
        if prompt_tokens + max_tokens > self.config.max_model_len:
            raise ValueError("request exceeds max_model_len")
        rid = self._next_rid
        self._next_rid += 1
        seq = Sequence(
            rid=rid, prompt_tokens=prompt_tokens, max_tokens=max_tokens, arrival_s=arrival_s
        )
        self._seqs[rid] = seq
        self.waiting.append(seq)
        self.stats.requests_added += 1
        return rid

    def abort(self, rid: int) -> AbortInfo | None:
        """Remove a request now (client went away): frees its slot and KV. None if unknown."""
        seq = self._seqs.pop(rid, None)
        if seq is None:
            return None
        was_running = seq in self.running
        if was_running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv_used -= seq.kv_tokens
        seq.kv_tokens = 0
        self.stats.aborted_requests += 1
        self.stats.aborted_generation_tokens += seq.num_generated
        self.stats.aborted_prefill_tokens += seq.prefill_computed
        return AbortInfo(
            rid=rid,
            was_running=was_running,
            generated_tokens=seq.num_generated,
            prefill_tokens=seq.prefill_computed,
        )

    def _preempt(self, seq: Sequence) -> None:
        self.kv_used -= seq.kv_tokens
        seq.kv_tokens = 0
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def schedule(self, start_s: float) -> StepPlan | None:
        """Choose and allocate the work of the step starting at ``start_s``; None if idle.

        Every plan must be passed to :meth:`complete` before the next ``schedule`` call.
        """
        if self._plan_open:
            raise RuntimeError("previous step not completed")
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        free_kv = cfg.kv_cache_tokens - self.kv_used
        scheduled: list[tuple[int, int]] = []
        preempted: list[int] = []
        admitted: list[int] = []
        prefill = decode = 0

        # 1) Running requests, in admission order; preempt from the back when KV runs out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            new = min(seq.num_tokens - seq.num_computed, budget)
            need = seq.num_computed + new - seq.kv_tokens
            while need > free_kv:
                victim = self.running.pop()
                free_kv += victim.kv_tokens
                self._preempt(victim)
                preempted.append(victim.rid)
                if victim is seq:
                    break
            else:
                seq.kv_tokens += need
                free_kv -= need
                budget -= new
                if seq.is_decoding:
                    decode += new
                else:
                    prefill += new
                scheduled.append((seq.rid, new))
                i += 1
                continue
            break  # the current request preempted itself: nothing after it is left running

        # 2) Waiting requests, FCFS, only if nobody was preempted in this step (as vLLM V1).
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
                seq = self.waiting[0]
                if seq.arrival_s > start_s:
                    break
                new = min(seq.num_tokens - seq.num_computed, budget)
                if new > free_kv:
                    break
                self.waiting.popleft()
                self.running.append(seq)
                seq.kv_tokens = new
                free_kv -= new
                budget -= new
                prefill += new
                if seq.first_scheduled_s is None:
                    seq.first_scheduled_s = start_s
                scheduled.append((seq.rid, new))
                admitted.append(seq.rid)

        self.kv_used = cfg.kv_cache_tokens - free_kv
        if not scheduled:
            return None
        self._plan_open = True
        return StepPlan(
            start_s=start_s,
            duration_s=cfg.profile.step_time_s(prefill_tokens=prefill, decode_tokens=decode),
            prefill_tokens=prefill,
            decode_tokens=decode,
            scheduled=tuple(scheduled),
            preempted=tuple(preempted),
            admitted=tuple(admitted),
        )

    def complete(self, plan: StepPlan, end_s: float | None = None) -> StepOutcome:
        """Apply a scheduled step's results at ``end_s`` (default: the plan's own end)."""
        if not self._plan_open:
            raise RuntimeError("no step in flight")
        self._plan_open = False
        end = plan.end_s if end_s is None else end_s
        st = self.stats
        st.steps += 1
        st.busy_s += plan.duration_s
        tokens: list[tuple[int, int]] = []
        first: list[tuple[int, float]] = []
        finished: list[FinishedRequest] = []
        for rid, new in plan.scheduled:
            seq = self._seqs.get(rid)
            if seq is None:  # aborted while the step ran: output dropped
                continue
            if seq.is_decoding:
                st.decode_tokens_computed += new
            else:
                st.prefill_tokens_computed += new
                seq.prefill_computed += new
            seq.num_computed += new
            if seq.num_computed < seq.num_tokens:
                continue  # partial prefill chunk: no token yet
            seq.num_generated += 1
            st.generation_tokens += 1
            tokens.append((rid, seq.num_generated))
            if seq.first_token_s is None:
                seq.first_token_s = end
                st.prompt_tokens += seq.prompt_tokens
                first.append((rid, end - seq.arrival_s))
            if seq.num_generated >= seq.max_tokens:
                self.running.remove(seq)
                del self._seqs[rid]
                self.kv_used -= seq.kv_tokens
                seq.kv_tokens = 0
                st.finished_requests += 1
                assert seq.first_scheduled_s is not None
                finished.append(
                    FinishedRequest(
                        rid=rid,
                        prompt_tokens=seq.prompt_tokens,
                        output_tokens=seq.num_generated,
                        arrival_s=seq.arrival_s,
                        first_scheduled_s=seq.first_scheduled_s,
                        first_token_s=seq.first_token_s,
                        finish_s=end,
                    )
                )
        return StepOutcome(
            end_s=end, tokens=tuple(tokens), first_tokens=tuple(first), finished=tuple(finished)
        )

    def run_until_idle(self, start_s: float = 0.0, max_steps: int = 1_000_000) -> list[StepOutcome]:
        """Run back-to-back steps (no clock) until no work is left; for tests and offline use."""
        outcomes: list[StepOutcome] = []
        t = start_s
        for _ in range(max_steps):
            if not self.has_work:
                return outcomes
            t = self.next_start_s(t)
            plan = self.schedule(t)
            if plan is None:
                raise RuntimeError("scheduler stalled with work queued")
            outcome = self.complete(plan)
            outcomes.append(outcome)
            t = outcome.end_s
        raise RuntimeError("max_steps exceeded")


# --------------------------------------------------------------------------------------------
# Async engine (virtual clock)
# --------------------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class RequestHandle:
    """Per-request mailbox between the engine loop and an HTTP handler."""

    rid: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
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
    """Runs the :class:`Scheduler` on a virtual clock ``speedup`` times faster than the wall."""

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
        handle = RequestHandle(
            rid=rid, arrival_s=arrival, prompt_tokens=prompt_tokens, max_tokens=max_tokens
        )
        self._handles[rid] = handle
        self._wakeup.set()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        self._handles.pop(handle.rid, None)
        self.core.abort(handle.rid)

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
        for fin in outcome.finished:
            handle = handles.pop(fin.rid, None)
            if handle is not None:
                handle.finished = fin
                handle.event.set()
            if self.e2e_hist is not None and self.queue_hist is not None:
                self.e2e_hist.observe(fin.e2e_s)
                self.queue_hist.observe(fin.queue_s)

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
            profile=self.config.profile.name,
            lag_s_current=self.lag.current_s,
            lag_s_max=self.lag.max_s,
            lag_s_mean=self.lag.sum_s / self.lag.steps if self.lag.steps else 0.0,
        )
        return out


# --------------------------------------------------------------------------------------------
# Prometheus metrics
# --------------------------------------------------------------------------------------------

# vLLM's bucket boundaries.
# fmt: off
TTFT_BUCKETS: Final = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                       5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS: Final = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                          50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on
LABELS: Final = ("model_name", "engine")


class _EngineCollector(Collector):
    """Exposes the engine's gauges and the core's counters at scrape time."""

    def __init__(self, engine: SimEngine, model_name: str) -> None:
        self._engine = engine
        self._labels = [model_name, "0"]

    def collect(self) -> Iterable[Metric]:
        engine = self._engine
        core = engine.core
        st = core.stats
        gauges = (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                core.num_running,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                core.num_waiting,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                core.kv_usage,
            ),
            (
                "vllm_sim:engine_lag_seconds",
                (
                    "How late the last step's results were delivered (simulated s); "
                    "growing means the host cannot keep up with --speedup."
                ),
                engine.lag.current_s,
            ),
        )
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(self._labels, float(value))
            yield g
        counters = (
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                st.generation_tokens,
            ),
            ("vllm:num_preemptions", "Cumulative number of preemptions.", st.preemptions),
            (
                "vllm_sim:finished_requests",
                "Requests that generated all their tokens.",
                st.finished_requests,
            ),
            (
                "vllm_sim:aborted_requests",
                "Requests aborted because the client disconnected.",
                st.aborted_requests,
            ),
            (
                "vllm_sim:aborted_generation_tokens",
                "Tokens generated for requests that were later aborted (wasted decode work).",
                st.aborted_generation_tokens,
            ),
            (
                "vllm_sim:aborted_prefill_tokens",
                "Prefill tokens computed for requests later aborted (wasted prefill work).",
                st.aborted_prefill_tokens,
            ),
            (
                "vllm_sim:rejected_requests",
                "Requests rejected with a 4xx error.",
                engine.rejected_requests,
            ),
            ("vllm_sim:busy_seconds", "Simulated GPU busy time.", st.busy_s),
        )
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(self._labels, float(value))
            yield c


def make_registry(engine: SimEngine, model_name: str) -> CollectorRegistry:
    """A fresh registry with the engine's metrics; wires the latency histograms into the engine."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_EngineCollector(engine, model_name))
    hists = {
        "ttft": Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            LABELS,
            buckets=TTFT_BUCKETS,
            registry=registry,
        ),
        "e2e": Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LABELS,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        ),
        "queue": Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase.",
            LABELS,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        ),
    }
    engine.ttft_hist = hists["ttft"].labels(model_name, "0")
    engine.e2e_hist = hists["e2e"].labels(model_name, "0")
    engine.queue_hist = hists["queue"].labels(model_name, "0")
    return registry


# --------------------------------------------------------------------------------------------
# HTTP layer
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """Everything needed to build a simulator app."""

    engine: EngineConfig = EngineConfig()
    speedup: float = 1.0
    model_name: str = DEFAULT_MODEL


ENGINE_KEY: Final = web.AppKey("engine", SimEngine)
REGISTRY_KEY: Final = web.AppKey("registry", CollectorRegistry)
CONFIG_KEY: Final = web.AppKey("config", SimConfig)


def _error(exc: SimRequestError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


class _Render:
    """Pre-rendered OpenAI response fragments for one request (cheap per-token streaming)."""

    __slots__ = ("_obj", "chat", "created", "model", "rid")

    def __init__(self, *, chat: bool, model: str) -> None:
        self.chat = chat
        self.rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self._obj = "chat.completion.chunk" if chat else "text_completion"

    def _chunk(self, choice: dict[str, Any] | None, usage: dict[str, int] | None = None) -> bytes:
        obj: dict[str, Any] = {
            "id": self.rid,
            "object": self._obj,
            "created": self.created,
            "model": self.model,
            "choices": [] if choice is None else [choice],
        }
        if usage is not None:
            obj["usage"] = usage
        return b"data: " + _dumps(obj).encode() + b"\n\n"

    def role_chunk(self) -> bytes:
        return self._chunk(
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        )

    def token_chunk(self, finish_reason: str | None = None) -> bytes:
        if self.chat:
            choice = {
                "index": 0,
                "delta": {"content": TOKEN_TEXT},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": TOKEN_TEXT,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        return self._chunk(choice)

    def usage_chunk(self, usage: dict[str, int]) -> bytes:
        return self._chunk(None, usage)

    def full_response(self, n_tokens: int, usage: dict[str, int]) -> dict[str, Any]:
        text = TOKEN_TEXT * n_tokens
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        return {
            "id": self.rid,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def _generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    config = request.app[CONFIG_KEY]
    try:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise SimRequestError("malformed JSON body") from None
        parsed = parse_request(
            body,
            chat=chat,
            max_model_len=config.engine.max_model_len,
            prompt_tokens_header=request.headers.get("x-sim-prompt-tokens"),
        )
    except SimRequestError as exc:
        engine.rejected_requests += 1
        return _error(exc)

    render = _Render(chat=chat, model=config.model_name)
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
        usage = _usage(fin.prompt_tokens, fin.output_tokens)
        return web.json_response(
            render.full_response(fin.output_tokens, usage), headers=headers, dumps=_dumps
        )
    finally:
        # Cancelled (client disconnect), write failed, or anything else: free the slot now.
        if handle.finished is None:
            engine.abort(handle)


async def _stream(
    request: web.Request, handle: RequestHandle, render: _Render, parsed: ParsedRequest
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
                    parts.append(render.usage_chunk(_usage(fin.prompt_tokens, fin.output_tokens)))
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


def config_from_args(argv: list[str] | None = None) -> tuple[SimConfig, str, int]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.vllm_sim", description=__doc__.split("\n")[0]
    )
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
    return (
        SimConfig(engine=engine, speedup=args.speedup, model_name=args.model),
        args.host,
        args.port,
    )


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
            f"vllm_sim: {config.engine.profile.description}, speedup "
            f"{config.speedup:g}, listening on http://{host}:{port}",
            flush=True,
        ),
    )


if __name__ == "__main__":
    main()
