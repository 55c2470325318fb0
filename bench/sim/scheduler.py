"""The pure core: vLLM's V1-style scheduler state machine, no I/O, no clock (see
:mod:`bench.sim`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .profiles import EngineConfig, check_speed_factor


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
    last_token_s: float = 0.0  # when the last output token was sampled (valid once one was)

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

    @property
    def tpot_s(self) -> float:
        """vLLM's mean time per output token: the decode time over the tokens after the first
        (0 for a one-token answer)."""
        n = self.output_tokens - 1
        return (self.finish_s - self.first_token_s) / n if n > 0 else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOutcome:
    """Results of a completed step: who got a token, who saw its first token, who finished, and
    the inter-token gaps of the tokens after the first."""

    end_s: float
    tokens: tuple[tuple[int, int], ...]  # (rid, tokens generated so far)
    first_tokens: tuple[tuple[int, float], ...]  # (rid, TTFT in simulated seconds)
    finished: tuple[FinishedRequest, ...]
    # (gap since the request's previous token in simulated seconds, number of tokens with that
    # gap): one entry per distinct gap, as most requests of a step share theirs.
    token_gaps: tuple[tuple[float, int], ...] = ()


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
        self._speed_factor = 1.0

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
    def speed_factor(self) -> float:
        """GPU speed relative to the profile: step times are the profile's divided by it."""
        return self._speed_factor

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def next_start_s(self, engine_free_s: float) -> float:
        """Earliest time a step can start: now if anything runs, else when the head arrived."""
        if self.running or not self.waiting:
            return engine_free_s
        return max(engine_free_s, self.waiting[0].arrival_s)

    # ---- mutations ---------------------------------------------------------------------
    def set_speed_factor(self, factor: float) -> None:
        """Steps scheduled from now on take 1/``factor`` of the profile's time (0.5: the GPU got
        half as fast); a step already scheduled keeps its duration. ValueError if out of range."""
        self._speed_factor = check_speed_factor(factor)

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
            duration_s=cfg.profile.step_time_s(prefill_tokens=prefill, decode_tokens=decode)
            / self._speed_factor,
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
        gaps: dict[float, int] = {}
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
            else:
                # After a preemption the gap includes the wait and the recompute, as a client
                # sees it.
                gap = end - seq.last_token_s
                gaps[gap] = gaps.get(gap, 0) + 1
            seq.last_token_s = end
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
            end_s=end,
            tokens=tuple(tokens),
            first_tokens=tuple(first),
            finished=tuple(finished),
            token_gaps=tuple(gaps.items()),
        )
