"""Tests of the vLLM simulator's pure parts: the scheduler core (no event loop, no sleeps) and
request parsing. The HTTP server is tests/bench/test_sim_http.py."""

from __future__ import annotations

from typing import TypeVar

import pytest

from bench.sim.api import SimRequestError, count_prompt_tokens, parse_request
from bench.sim.metrics import BulkHistogram
from bench.sim.profiles import PROFILES, EngineConfig, Profile
from bench.sim.scheduler import Scheduler, StepOutcome

H100 = PROFILES["h100"]
T = TypeVar("T")


def step(profile: Profile, prefill: int, decode: int) -> float:
    return profile.b0_s + profile.b1_s * prefill + profile.b2_s * decode


def run_until_idle(s: Scheduler, start_s: float = 0.0) -> list[StepOutcome]:
    """Back-to-back steps (no clock) until no work is left."""
    outcomes: list[StepOutcome] = []
    t = start_s
    for _ in range(1_000_000):
        if not s.has_work:
            return outcomes
        t = s.next_start_s(t)
        plan = s.schedule(t)
        if plan is None:
            raise RuntimeError("scheduler stalled with work queued")
        outcomes.append(s.complete(plan))
        t = outcomes[-1].end_s
    raise RuntimeError("max_steps exceeded")


# ---------------------------------------------------------------------------------------------
# Pure core
# ---------------------------------------------------------------------------------------------


def test_profiles_step_time() -> None:
    assert H100.step_time_s(prefill_tokens=0, decode_tokens=0) == pytest.approx(5.753e-3)
    assert H100.step_time_s(prefill_tokens=8192, decode_tokens=0) == pytest.approx(
        5.753e-3 + 8192 * 17.25e-6
    )
    assert H100.step_time_s(prefill_tokens=100, decode_tokens=256) == pytest.approx(
        5.753e-3 + 100 * 17.25e-6 + 256 * 6.0e-6
    )
    a100 = PROFILES["a100"]
    assert a100.step_time_s(prefill_tokens=10, decode_tokens=10) == pytest.approx(
        16.442e-3 + 10 * 47.8e-6 + 10 * 18.2e-6
    )


def test_config_rejects_model_len_above_kv() -> None:
    with pytest.raises(ValueError):
        EngineConfig(kv_cache_tokens=1000, max_model_len=2000)


def test_single_request_timeline() -> None:
    s = Scheduler(EngineConfig())
    rid = s.add(prompt_tokens=100, max_tokens=3, arrival_s=1.0)
    plan = s.schedule(1.0)
    assert plan is not None
    assert (plan.prefill_tokens, plan.decode_tokens, plan.scheduled) == (100, 0, ((rid, 100),))
    assert plan.duration_s == pytest.approx(step(H100, 100, 0))
    assert s.kv_used == 100 and s.num_running == 1
    out = s.complete(plan)
    assert out.tokens == ((rid, 1),)
    assert out.first_tokens[0][1] == pytest.approx(step(H100, 100, 0))
    outs = run_until_idle(s, out.end_s)
    assert [(o.tokens) for o in outs] == [((rid, 2),), ((rid, 3),)]
    fin = outs[-1].finished[0]
    assert fin.output_tokens == 3 and fin.queue_s == 0.0
    assert fin.e2e_s == pytest.approx(step(H100, 100, 0) + 2 * step(H100, 0, 1))
    assert s.kv_used == 0 and not s.has_work
    assert (
        s.stats.prompt_tokens == 100
        and s.stats.generation_tokens == 3
        and s.stats.finished_requests == 1
    )


def test_chunked_prefill_shares_budget_with_decode() -> None:
    s = Scheduler(EngineConfig(max_num_batched_tokens=1000))
    a = s.add(prompt_tokens=10, max_tokens=50, arrival_s=0.0)
    s.complete(s.schedule(0.0))  # type: ignore[arg-type]  # a prefilled, now decoding
    b = s.add(prompt_tokens=2500, max_tokens=2, arrival_s=0.0)
    chunks = []
    t = 1.0
    for _ in range(3):
        plan = s.schedule(t)
        assert plan is not None
        chunks.append(dict(plan.scheduled))
        assert plan.decode_tokens == 1 and plan.prefill_tokens == plan.scheduled[1][1]
        assert plan.duration_s == pytest.approx(step(H100, plan.prefill_tokens, 1))
        out = s.complete(plan)
        t = out.end_s
    assert [c[b] for c in chunks] == [999, 999, 502]
    assert all(c[a] == 1 for c in chunks)
    assert out.first_tokens and out.first_tokens[0][0] == b  # the last chunk yields b's first token


def test_max_num_seqs_and_fcfs_queueing() -> None:
    s = Scheduler(EngineConfig(max_num_seqs=2))
    ids = [s.add(prompt_tokens=10, max_tokens=2, arrival_s=0.0) for _ in range(3)]
    plan = s.schedule(0.0)
    assert plan is not None and [r for r, _ in plan.scheduled] == ids[:2]
    assert s.num_running == 2 and s.num_waiting == 1
    outs: list[StepOutcome] = [s.complete(plan)]
    outs += run_until_idle(s, outs[0].end_s)
    finished = {f.rid: f for o in outs for f in o.finished}
    assert set(finished) == set(ids)
    assert finished[ids[2]].queue_s == pytest.approx(outs[1].end_s)  # admitted when a slot freed
    assert finished[ids[0]].queue_s == 0.0


def test_waiting_request_not_scheduled_before_arrival() -> None:
    s = Scheduler(EngineConfig())
    s.add(prompt_tokens=10, max_tokens=1, arrival_s=5.0)
    assert s.schedule(1.0) is None
    assert s.next_start_s(1.0) == 5.0
    plan = s.schedule(5.0)
    assert plan is not None


def test_kv_full_blocks_admission_head_of_line() -> None:
    s = Scheduler(EngineConfig(kv_cache_tokens=1000, max_model_len=1000))
    a = s.add(prompt_tokens=700, max_tokens=5, arrival_s=0.0)
    b = s.add(prompt_tokens=400, max_tokens=5, arrival_s=0.0)
    c = s.add(prompt_tokens=10, max_tokens=5, arrival_s=0.0)  # would fit, but FCFS: no skipping
    plan = s.schedule(0.0)
    assert plan is not None and plan.scheduled == ((a, 700),)
    assert s.num_waiting == 2
    outs = [s.complete(plan), *run_until_idle(s, plan.end_s)]
    order = [f.rid for o in outs for f in o.finished]
    assert order[0] == a and set(order) == {a, b, c}
    assert s.stats.preemptions == 0


def test_recompute_preemption_of_most_recent() -> None:
    s = Scheduler(EngineConfig(kv_cache_tokens=100, max_model_len=100))
    a = s.add(prompt_tokens=40, max_tokens=30, arrival_s=0.0)
    b = s.add(prompt_tokens=40, max_tokens=30, arrival_s=0.0)
    outs = run_until_idle(s, 0.0)
    assert s.stats.preemptions == 1
    finished = {f.rid: f for o in outs for f in o.finished}
    assert finished[a].output_tokens == 30 and finished[b].output_tokens == 30
    assert finished[a].finish_s < finished[b].finish_s
    # After 10 decode steps both hold 50 tokens of KV (full at 100) and have sampled 11 tokens
    # each; at the next step a needs one more slot, so b (admitted last) is preempted. b then
    # recomputes its prompt plus its 11 tokens, which are not generated again.
    assert s.stats.prefill_tokens_computed == 40 + 40 + (40 + 11)
    assert s.stats.generation_tokens == 60
    assert s.kv_used == 0


def test_preempting_step_admits_no_waiting() -> None:
    s = Scheduler(EngineConfig(kv_cache_tokens=100, max_model_len=100))
    s.add(prompt_tokens=40, max_tokens=30, arrival_s=0.0)
    s.add(prompt_tokens=40, max_tokens=30, arrival_s=0.0)
    t = 0.0
    while True:
        plan = s.schedule(t)
        assert plan is not None
        if plan.preempted:
            assert plan.admitted == ()
            assert s.num_waiting == 1 and s.num_running == 1
            break
        t = s.complete(plan).end_s


def test_abort_frees_slot_and_counts_waste() -> None:
    s = Scheduler(EngineConfig(max_num_seqs=1))
    a = s.add(prompt_tokens=100, max_tokens=1000, arrival_s=0.0)
    b = s.add(prompt_tokens=10, max_tokens=1, arrival_s=0.0)
    t = 0.0
    for _ in range(5):
        t = s.complete(s.schedule(t)).end_s  # type: ignore[arg-type]
    plan = s.schedule(t)
    assert plan is not None and plan.scheduled == ((a, 1),)
    info = s.abort(a)  # the client disconnects while the step runs
    assert info is not None and info.was_running and info.generated_tokens == 5
    assert s.kv_used == 0 and s.num_running == 0
    out = s.complete(plan)
    assert out.tokens == ()  # the aborted request's output is dropped
    assert s.stats.aborted_requests == 1
    assert s.stats.aborted_generation_tokens == 5 and s.stats.aborted_prefill_tokens == 100
    plan = s.schedule(out.end_s)
    assert plan is not None and plan.scheduled == ((b, 10),)
    assert s.abort(12345) is None


def test_abort_waiting_request_wastes_nothing() -> None:
    s = Scheduler(EngineConfig())
    rid = s.add(prompt_tokens=10, max_tokens=5, arrival_s=0.0)
    assert s.abort(rid) is not None
    assert s.stats.aborted_requests == 1 and s.stats.aborted_generation_tokens == 0
    assert not s.has_work


def test_token_gaps_one_per_token_after_the_first() -> None:
    s = Scheduler(EngineConfig())
    s.add(prompt_tokens=100, max_tokens=4, arrival_s=0.0)
    s.add(prompt_tokens=50, max_tokens=2, arrival_s=0.0)
    outs = run_until_idle(s)
    assert outs[0].first_tokens and outs[0].token_gaps == ()  # the prefill step: first tokens
    # Both decode in the next step, which is one gap of that step's length for each of them.
    ((gap, n),) = outs[1].token_gaps
    assert gap == pytest.approx(step(H100, 0, 2)) and n == 2
    for out in outs[2:]:
        ((gap, n),) = out.token_gaps
        assert gap == pytest.approx(step(H100, 0, 1)) and n == 1
    assert len(outs) == 4
    assert sum(n for o in outs for _, n in o.token_gaps) == (4 - 1) + (2 - 1)


def test_token_gap_after_preemption_spans_the_recompute() -> None:
    s = Scheduler(EngineConfig(kv_cache_tokens=100, max_model_len=100))
    s.add(prompt_tokens=40, max_tokens=30, arrival_s=0.0)
    s.add(prompt_tokens=40, max_tokens=30, arrival_s=0.0)
    outs = run_until_idle(s)
    gaps = [(gap, n) for o in outs for gap, n in o.token_gaps]
    assert s.stats.preemptions == 1 and sum(n for _, n in gaps) == 2 * (30 - 1)
    # The preempted request waits for the other to finish (19 more decode steps), then
    # recomputes its prompt and 11 tokens: that one gap is the longest by far.
    longest = max(gap for gap, _ in gaps)
    assert longest > 19 * step(H100, 0, 1) + step(H100, 51, 0)
    assert sorted(gap for gap, _ in gaps)[-2] < 2 * step(H100, 0, 2)


def test_speed_factor_applies_from_the_next_step() -> None:
    s = Scheduler(EngineConfig())
    s.add(prompt_tokens=100, max_tokens=3, arrival_s=0.0)
    plan = s.schedule(0.0)
    assert plan is not None and plan.duration_s == pytest.approx(step(H100, 100, 0))
    s.set_speed_factor(0.5)  # while the step runs: it keeps its duration
    out = s.complete(plan)
    assert out.end_s == pytest.approx(step(H100, 100, 0))
    plan = s.schedule(out.end_s)
    assert plan is not None and plan.duration_s == pytest.approx(2 * step(H100, 0, 1))
    s.set_speed_factor(10)
    s.complete(plan)
    plan = s.schedule(out.end_s)
    assert plan is not None and plan.duration_s == pytest.approx(step(H100, 0, 1) / 10)
    for bad in (0.0, -1.0, 10.01, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="speed factor must be > 0 and <= 10"):
            s.set_speed_factor(bad)
    assert s.speed_factor == 10


def test_bulk_histogram_buckets() -> None:
    h = BulkHistogram((0.01, 0.1))
    h.observe(0.01, 3)  # on a bound: counted in that bucket (le means <=)
    h.observe(0.05)
    h.observe(7.0, 2)
    assert h.cumulative() == [("0.01", 3.0), ("0.1", 4.0), ("+Inf", 6.0)]
    assert h.count == 6 and h.sum == pytest.approx(0.03 + 0.05 + 14.0)


# ---------------------------------------------------------------------------------------------
# Request parsing
# ---------------------------------------------------------------------------------------------


def test_prompt_token_counting() -> None:
    chat = {
        "messages": [
            {"role": "system", "content": "x" * 8},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "y" * 5},
                    {"type": "image_url", "image_url": {"url": "u"}},
                ],
            },
        ]
    }
    assert count_prompt_tokens(chat, chat=True) == 4  # ceil(13 / 4)
    assert count_prompt_tokens({"prompt": "abcd" * 10}, chat=False) == 10
    assert count_prompt_tokens({"prompt": [1, 2, 3]}, chat=False) == 3
    assert count_prompt_tokens({"prompt": [[1, 2], [3]]}, chat=False) == 3
    assert count_prompt_tokens({"prompt": ""}, chat=False) == 1
    with pytest.raises(SimRequestError):
        count_prompt_tokens({"messages": []}, chat=True)


def test_parse_request_fields() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 7,
        "max_completion_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    p = parse_request(body, chat=True, max_model_len=8192)
    assert (p.prompt_tokens, p.max_tokens, p.stream, p.include_usage) == (1, 9, True, True)
    p = parse_request({"prompt": "hi"}, chat=False, max_model_len=8192)
    assert (p.prompt_tokens, p.max_tokens, p.stream, p.include_usage) == (1, 16, False, False)
    with pytest.raises(SimRequestError):
        parse_request({"prompt": "hi", "max_tokens": 0}, chat=False, max_model_len=8192)


def test_context_length_error_message() -> None:
    with pytest.raises(SimRequestError) as ei:
        parse_request({"prompt": "a" * 400, "max_tokens": 2000}, chat=False, max_model_len=2048)
    assert ei.value.status == 400
    assert ei.value.body() == {
        "error": {
            "message": "This model's maximum context length is 2048 tokens. However, you requested "
            "2100 tokens (100 in the messages, 2000 in the completion). Please reduce the "
            "length of the messages or completion.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
