"""The adaptive pool limit: the control law with plain numbers, and the poller that feeds it
(on a virtual clock, ``testing.clock``: its rounds come at their exact loop times, at once)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import replace

import pytest

from extproc.backend.scrape import Latency, Signals
from extproc.config.policy import AdaptivePolicy
from extproc.pool.control.adaptive import AdaptiveLimit, LimitState
from extproc.pool.control.bandcut import BandLoad
from extproc.pool.control.poller import Poller
from testing.clock import run_virtual


def run(coro: Awaitable[None]) -> None:
    run_virtual(asyncio.wait_for(coro, 10))


def sig(
    at: float,
    *,
    ok: int = 1,
    waiting: int = 0,
    kv: float = 0.2,
    ttft: float | None = 0.1,
    ttft_n: int = 100,
    itl: float | None = 0.02,
    itl_n: int = 100,
    tpot: float | None = None,
    tpot_n: int = 100,
    queue: float | None = None,
    queue_n: int = 100,
    refused: int = 0,
) -> Signals:
    return Signals(
        at=at,
        endpoints_ok=ok,
        endpoints_failed=0,
        waiting=waiting,
        running=10,
        kv_usage=kv,
        latency={
            name: Latency(q, n if q is not None else 0)
            for name, q, n in (
                ("ttft", ttft, ttft_n),
                ("itl", itl, itl_n),
                ("tpot", tpot, tpot_n),
                ("queue_time", queue, queue_n),
            )
        },
        refused=refused,
    )


def limiter(initial: int = 100, fallback_limit: int | None = None, **kw: object) -> AdaptiveLimit:
    """An adaptive limit on a policy with these settings (``window_s`` is the cooldown); an
    objective as ``<name>_slo_s`` (None: none), ttft's 1 s and itl's 50 ms by default."""
    slo: dict[str, object] = {"ttft": 1.0, "itl": 0.05}
    slo |= {k.removesuffix("_slo_s"): kw.pop(k) for k in list(kw) if k.endswith("_slo_s")}
    settings: dict[str, object] = {"min_limit": 4, "max_limit": 400, "initial": initial}
    settings |= kw | {"slo_s": {name: s for name, s in slo.items() if s is not None}}
    return AdaptiveLimit(AdaptivePolicy(**settings), fallback_limit=fallback_limit)  # type: ignore[arg-type]


def test_rises_under_demand_while_every_objective_holds() -> None:
    a = limiter(initial=10)
    seen = [a.update(float(t), sig(t), in_flight=a.limit, waiting=0) for t in range(8)]
    assert seen == [11, 12, 13, 14, 15, 16, 17, 18]  # +max(1, 5%)
    assert (a.state, a.reason) == (LimitState.TRACKING, "increase")
    big = limiter(initial=200)
    assert big.update(0.0, sig(0), in_flight=0, waiting=3) == 210  # queued with us: demand


def test_no_observations_is_no_objective_broken() -> None:
    a = limiter(initial=10)
    assert a.update(0.0, sig(0, ttft=None, itl=None), in_flight=10, waiting=0) == 11


def test_does_not_rise_without_demand() -> None:
    a = limiter(initial=100)
    # margin: max(1, 10% of 100) = 10; 89 in flight is below 100 - 10
    for t in range(5):
        assert a.update(float(t), sig(t), in_flight=89, waiting=0) == 100
    assert a.update(5.0, sig(5), in_flight=90, waiting=0) == 105
    assert limiter(initial=10).update(0.0, sig(0), in_flight=8, waiting=0) == 10  # margin 1


@pytest.mark.parametrize(
    ("signals", "why"),
    [
        ({"ttft": 0.95}, "inside the 0.9x headroom band"),
        ({"itl": 0.046}, "inside the 0.9x headroom band"),
        ({"ttft": 2.0, "ttft_n": 9}, "too few observations to break the objective"),
        ({"tpot": 0.038}, "inside the 0.9x headroom band"),
        ({"tpot": 0.2, "tpot_n": 9}, "too few finished requests to break the objective"),
        ({"queue": 0.46}, "inside the 0.9x headroom band"),
        ({"queue": 3.0, "queue_n": 9}, "too few finished requests to break the objective"),
    ],
)
def test_holds_between_increase_and_decrease(signals: dict[str, float], why: str) -> None:
    a = limiter(initial=100, tpot_slo_s=0.04, queue_time_slo_s=0.5)
    for t in range(3):
        assert a.update(float(t), sig(t, **signals), in_flight=100, waiting=5) == 100, why  # type: ignore[arg-type]
    assert a.reason == "initial"


@pytest.mark.parametrize(
    ("signals", "reason", "limit"),
    [
        ({"ttft": 1.01}, "ttft", 80),  # a small breach: 20 %
        ({"itl": 0.051}, "itl", 80),
        ({"kv": 0.9}, "kv", 80),
        ({"ttft": 5.0, "waiting": 50, "kv": 1.0}, "ttft", 50),  # the first one named
        ({"waiting": 50, "kv": 1.0}, "kv", 80),  # one round of vLLM queueing is no breach yet
        ({"ttft": 1.6}, "ttft", 62),  # objective / quantile = 0.625
        ({"itl": 0.1}, "itl", 50),  # twice the objective: half
        ({"itl": 0.5}, "itl", 50),  # never deeper than half in one cut
        ({"tpot": 0.041}, "tpot", 80),
        ({"tpot": 0.06, "itl": 0.06}, "itl", 80),  # itl is named before tpot
        ({"tpot": 0.08}, "tpot", 50),
        ({"queue": 0.51}, "queue_time", 80),
        ({"queue": 0.8}, "queue_time", 62),  # 0.5 / 0.8 = 0.625
        ({"queue": 0.8, "tpot": 0.05}, "tpot", 80),  # tpot is named before queue_time
        ({"refused": 1}, "vllm_refused", 80),  # vLLM refused what the sidecar admitted
        ({"refused": 3, "ttft": 5.0}, "vllm_refused", 80),  # named first
    ],
)
def test_falls_on_each_breach(signals: dict[str, float], reason: str, limit: int) -> None:
    a = limiter(initial=100, tpot_slo_s=0.04, queue_time_slo_s=0.5)
    assert a.update(0.0, sig(0, **signals), in_flight=100, waiting=10) == limit  # type: ignore[arg-type]
    assert a.reason == reason


def test_vllm_queue_breaks_only_above_its_allowance_three_rounds_in_a_row() -> None:
    """The allowance is max(8, 10% of the limit): requests waiting for their prefill turn are
    normal; more, three rounds in a row, is vLLM not keeping up."""
    a = limiter(initial=100)
    assert a.update(0.0, sig(0, waiting=10), in_flight=100, waiting=1) == 105  # within: grows
    assert a.update(1.0, sig(1, waiting=11), in_flight=105, waiting=1) == 105  # above: holds
    assert a.update(2.0, sig(2, waiting=11), in_flight=105, waiting=1) == 105
    assert a.update(3.0, sig(3, waiting=1), in_flight=105, waiting=1) == 110  # the run restarts
    for t in (4.0, 5.0):
        assert a.update(t, sig(t, waiting=12), in_flight=110, waiting=1) == 110
    assert a.update(6.0, sig(6, waiting=12), in_flight=110, waiting=1) == 88
    assert a.reason == "vllm_queue"
    small = limiter(initial=20)
    assert small.update(0.0, sig(0, waiting=8), in_flight=20, waiting=1) == 21  # min allowance 8
    for t in (1.0, 2.0):
        assert small.update(t, sig(t, waiting=9), in_flight=21, waiting=1) == 21
    assert small.update(3.0, sig(3, waiting=9), in_flight=21, waiting=1) == 16


def test_objectives_are_optional() -> None:
    a = limiter(initial=100, ttft_slo_s=None, itl_slo_s=None)
    assert a.update(0.0, sig(0, ttft=60.0, itl=9.0, tpot=9.0), in_flight=100, waiting=0) == 105


def test_tpot_alone_lets_slow_single_tokens_through() -> None:
    """A prefill step stalls every running stream for one token: the tokens' p90 (``itl``)
    breaks while each answer's mean gap (``tpot``) holds. With only ``tpot`` the limit grows;
    with ``itl`` it is cut."""
    stalled = sig(0, itl=0.12, tpot=0.06)
    by_request = limiter(initial=100, itl_slo_s=None, tpot_slo_s=0.1)
    assert by_request.update(0.0, stalled, in_flight=100, waiting=5) == 105
    by_token = limiter(initial=100, itl_slo_s=0.1)
    assert by_token.update(0.0, stalled, in_flight=100, waiting=5) == 80
    assert by_token.reason == "itl"


def test_queue_time_alone_lets_long_prompts_through() -> None:
    """A long prompt's own prefill is most of its time to first token, and no admission
    shortens it: the TTFT p90 breaks while the time requests waited in vLLM's queue holds.
    With only ``queue_time`` the limit grows; with ``ttft`` it is cut. A queue that did grow
    cuts the limit by the same law."""
    long_prompts = sig(0, ttft=1.8, queue=0.2)
    by_wait = limiter(initial=100, ttft_slo_s=None, queue_time_slo_s=0.5)
    assert by_wait.update(0.0, long_prompts, in_flight=100, waiting=5) == 105
    by_ttft = limiter(initial=100)
    assert by_ttft.update(0.0, long_prompts, in_flight=100, waiting=5) == 55  # 1 / 1.8
    assert by_ttft.reason == "ttft"
    queued = limiter(initial=100, ttft_slo_s=None, queue_time_slo_s=0.5)
    assert queued.update(0.0, sig(0, ttft=1.8, queue=1.0), in_flight=100, waiting=5) == 50
    assert queued.reason == "queue_time"


def test_queue_time_breach_cuts_the_least_urgent_band_first() -> None:
    """Batch's long prompts take vLLM's prefill budget, so the urgent band's requests wait
    behind them in vLLM's queue: a ``queue_time`` breach cuts the band above its floor, like
    the other latency objectives, not the limit."""
    a = limiter(initial=100, ttft_slo_s=None, queue_time_slo_s=0.5)
    band = BandLoad(running=40, waiting=5, floor=10, top=90)
    assert a.update(0.0, sig(0, queue=0.6), in_flight=100, waiting=5, band=band) == 100
    assert a.reason == "band_queue_time"
    assert a.band_cut.cap is not None


def test_cooldown_after_a_decrease() -> None:
    a = limiter(initial=100, window_s=10.0)
    assert a.update(0.0, sig(0, ttft=1.1), in_flight=100, waiting=9) == 80
    for t in (1.0, 5.0, 9.9):
        # Still breaking (the window lags): no second cut; all fine: no climb either.
        assert a.update(t, sig(t, ttft=1.1), in_flight=80, waiting=9) == 80
        assert a.update(t, sig(t), in_flight=80, waiting=9) == 80
    assert a.update(10.0, sig(10, ttft=1.1), in_flight=80, waiting=9) == 64
    assert a.update(20.0, sig(20), in_flight=64, waiting=9) == 67  # 64 + floor(3.2)


def test_no_second_cut_until_the_first_has_landed() -> None:
    """After a cut the requests admitted under the old limit still run; while more run than
    the limit, the signals describe the old load, so a breach then does not cut again."""
    a = limiter(initial=100, window_s=10.0)
    assert a.update(0.0, sig(0, itl=0.1), in_flight=100, waiting=9) == 50
    for t in (10.0, 20.0, 30.0):  # cooldown over, still breaking, 51..90 still running
        assert a.update(t, sig(t, itl=0.1), in_flight=90 - int(t), waiting=9) == 50
    assert a.reason == "itl"
    assert a.update(40.0, sig(40, itl=0.06), in_flight=50, waiting=9) == 40  # landed: cut again
    # A limit that was never cut has nothing landing: more in flight than the limit (a reload
    # lowered it) does not stop the first cut.
    b = limiter(initial=100)
    assert b.update(0.0, sig(0, kv=0.95), in_flight=150, waiting=0) == 80


def test_objectives_left_out_while_only_the_least_urgent_band_runs() -> None:
    """``objectives=False``: slow TTFT and ITL neither cut nor hold back the climb; vLLM's
    queue and KV still do."""
    a = limiter(initial=100)
    slow = {"ttft": 30.0, "itl": 0.5}
    assert a.update(0.0, sig(0, **slow), in_flight=100, waiting=1, objectives=False) == 105
    assert a.update(1.0, sig(1, **slow, kv=0.95), in_flight=105, waiting=1, objectives=False) == 84
    assert a.reason == "kv"
    b = limiter(initial=100)
    assert b.update(0.0, sig(0, **slow), in_flight=100, waiting=1, objectives=True) == 50


def test_bounds() -> None:
    assert limiter(initial=1000).limit == 400
    assert limiter(initial=1).limit == 4
    a = limiter(initial=5, window_s=0.0)
    assert a.update(0.0, sig(0, kv=0.95), in_flight=5, waiting=0) == 4
    assert a.update(1.0, sig(1, kv=0.95), in_flight=5, waiting=0) == 4  # never below min
    top = limiter(initial=399)
    assert top.update(0.0, sig(0), in_flight=399, waiting=1) == 400
    assert top.update(1.0, sig(1), in_flight=400, waiting=1) == 400
    with pytest.raises(ValueError):
        limiter(min_limit=0)
    with pytest.raises(ValueError):
        limiter(min_limit=10, max_limit=5)
    with pytest.raises(ValueError):
        limiter(stale_after_s=10.0, fallback_after_s=5.0)


def test_stale_data_holds_then_falls_back_then_tracks_again() -> None:
    a = limiter(initial=100, fallback_limit=50)
    assert a.update(0.0, sig(0), in_flight=100, waiting=1) == 105
    # A missed scrape is normal: the limit and the state stay.
    assert a.update(1.0, None, in_flight=100, waiting=1) == 105
    assert a.update(4.9, sig(4.9, ok=0), in_flight=100, waiting=1) == 105
    assert a.state is LimitState.TRACKING
    assert a.update(5.0, None, in_flight=100, waiting=1) == 105
    assert (a.state, a.reason) == (LimitState.HOLDING, "stale")
    # Signals that are themselves old are no data either.
    assert a.update(29.9, sig(20.0), in_flight=100, waiting=1) == 105
    assert a.state is LimitState.HOLDING
    assert a.update(30.0, None, in_flight=100, waiting=1) == 50
    assert (a.state, a.reason) == (LimitState.FALLBACK, "fallback")
    assert a.update(300.0, None, in_flight=100, waiting=1) == 50
    # Data again: tracking at once, from the fallback limit.
    assert a.update(301.0, sig(301), in_flight=0, waiting=0) == 50
    assert (a.state, a.reason) == (LimitState.TRACKING, "resumed")
    assert a.update(302.0, sig(302), in_flight=50, waiting=0) == 52
    assert a.update(303.0, None, in_flight=50, waiting=0) == 52  # the clock starts again


def test_never_any_data_counts_from_the_first_update() -> None:
    a = limiter(initial=100)  # fallback: the initial limit
    assert a.update(1000.0, None, in_flight=0, waiting=0) == 100
    assert a.state is LimitState.TRACKING
    a.update(1005.0, None, in_flight=0, waiting=0)
    assert a.state is LimitState.HOLDING
    assert a.update(1030.0, None, in_flight=0, waiting=0) == 100
    assert a.state is LimitState.FALLBACK
    assert repr(a) == "<AdaptiveLimit 100 fallback (fallback)>"


def gone(at: float) -> Signals:
    """A round in which no host of backend.metrics had an address (NXDOMAIN)."""
    return replace(sig(at, ok=0, ttft=None, itl=None), endpoints_failed=1, no_backend=True)


def test_no_backend_queues_at_limit_0_then_a_backend_starts_from_initial() -> None:
    a = limiter(initial=20, fallback_limit=50, queue_while_no_backend=True)
    assert a.update(0.0, gone(0.0), in_flight=0, waiting=3) == 0
    assert (a.state, a.reason) == (LimitState.NO_BACKEND, "no_backend")
    assert a.update(100.0, gone(100.0), in_flight=0, waiting=3) == 0  # no fallback: an answer
    # A DNS failure (not "no address") is no data: held, then the fallback, never 0 for it.
    assert a.update(104.9, sig(104.9, ok=0), in_flight=0, waiting=3) == 0
    assert a.update(130.0, None, in_flight=0, waiting=3) == 50
    assert a.state is LimitState.FALLBACK
    assert a.update(131.0, gone(131.0), in_flight=0, waiting=3) == 0
    assert a.update(131.5, gone(120.0), in_flight=0, waiting=3) == 0  # old: no data, held
    # The first replica is ready: its page is read, tracking resumes from the initial limit.
    assert a.update(132.0, sig(132.0), in_flight=0, waiting=3) == 21
    assert (a.state, a.reason) == (LimitState.TRACKING, "increase")


def test_without_the_opt_in_no_backend_is_no_data_and_never_0() -> None:
    a = limiter(initial=20)
    assert a.update(0.0, gone(0.0), in_flight=0, waiting=3) == 20
    assert a.update(30.0, gone(30.0), in_flight=0, waiting=3) == 20
    assert (a.state, a.reason) == (LimitState.FALLBACK, "fallback")


# --- the poller --------------------------------------------------------------------------------


class FakeScraper:
    """Answers from a script: a Signals, an exception to raise, or a delay first."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.calls = 0
        self.started: list[float] = []  # the loop time of each call
        self.in_flight = 0
        self.max_in_flight = 0

    async def scrape(self, now: float) -> Signals:
        self.calls += 1
        self.started.append(round(asyncio.get_running_loop().time(), 9))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            if self.calls % 2 == 0:
                raise RuntimeError("scrape broke")
            return sig(now)
        finally:
            self.in_flight -= 1


def test_poller_rounds_survive_exceptions(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        scraper = FakeScraper()
        updates: list[tuple[int, Signals | None]] = []
        six = asyncio.Event()

        def on_update(limit: int, signals: Signals | None) -> None:
            updates.append((limit, signals))
            if len(updates) == 6:
                six.set()
            if len(updates) == 3:
                raise RuntimeError("callback broke")

        demands = iter([(10, 0), (11, 0)])

        def demand() -> tuple[int, int]:
            return next(demands)  # StopIteration from the third round on: logged, (0, 0)

        poller = Poller(scraper, limiter(initial=10, interval_s=0.01), on_update, demand)
        poller.start()
        await six.wait()
        await poller.stop()
        await poller.stop()  # idempotent
        assert len(updates) == 6
        # Every interval, whatever broke in the round before.
        assert scraper.started == [0.0, 0.01, 0.02, 0.03, 0.04, 0.05]
        assert [u[1] is None for u in updates[:4]] == [False, True, False, True]
        # Round 2 had no data (hold); round 3 would have climbed, but demand() broke: no demand.
        assert [u[0] for u in updates[:3]] == [11, 11, 11]

    with caplog.at_level(logging.ERROR, logger="extproc.backend"):
        run(main())
    messages = [r.getMessage() for r in caplog.records]
    assert "backend scrape failed" in messages
    assert "backend demand callback failed" in messages
    assert "backend on_update callback failed" in messages


def test_poller_asks_whether_the_objectives_apply(caplog: pytest.LogCaptureFixture) -> None:
    """Each round reads ``objectives()``; a callback that raises counts as True (the
    objectives apply: the safe side)."""

    class Slow:
        async def scrape(self, now: float) -> Signals:
            return sig(now, ttft=30.0)  # far over the 1 s objective

    async def main() -> None:
        answers = iter([False, False])

        def objectives() -> bool:
            return next(answers)  # StopIteration on the third round

        a = limiter(initial=100, interval_s=1.0)
        poller = Poller(Slow(), a, lambda limit, s: None, lambda: (100, 1), objectives)
        assert await poller.poll_once() == 105  # left out: climbs on queue and KV alone
        assert await poller.poll_once() == 110
        assert await poller.poll_once() == 55  # the callback broke: the objectives apply

    with caplog.at_level(logging.ERROR, logger="extproc.backend"):
        run(main())
    assert "backend objectives callback failed" in [r.getMessage() for r in caplog.records]


def test_poller_never_overlaps_scrapes() -> None:
    async def main() -> None:
        scraper = FakeScraper(delay_s=0.05)  # five intervals per scrape
        poller = Poller(scraper, limiter(interval_s=0.01), lambda limit, s: None, lambda: (0, 0))
        poller.start()
        extra = asyncio.ensure_future(poller.poll_once())  # a round from outside waits its turn
        await asyncio.sleep(0.3)  # the scenario: the poller runs for 0.3 s (of the loop's clock)
        await poller.stop()
        await extra
        assert scraper.max_in_flight == 1
        # Back to back, the outside round among them: a late round starts when the last one
        # ends, none skipped and none caught up.
        assert scraper.started == [0.0, 0.05, 0.1, 0.15, 0.2, 0.25]
        with pytest.raises(ValueError):
            Poller(scraper, limiter(interval_s=0.0), lambda limit, s: None, lambda: (0, 0))

    run(main())


def test_poller_goes_on_after_a_round_that_raised_outside_its_callbacks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The adaptive limit's own update raising (not one of the callbacks the round guards one
    by one) ended the poller's task; under its guard (``extproc.loops``) it is logged with
    its traceback and the next round comes an interval later."""

    class Steady:
        async def scrape(self, now: float) -> Signals:
            return sig(now)

    async def main() -> None:
        a = limiter(interval_s=0.5)
        update, calls = a.update, []
        three = asyncio.Event()

        def updating(now: float, *args: object, **kw: object) -> int:
            calls.append(round(now, 9))
            if len(calls) == 3:
                three.set()
            if len(calls) == 1:
                raise ZeroDivisionError("update broke")
            return update(now, *args, **kw)  # type: ignore[arg-type]

        a.update = updating  # type: ignore[method-assign]
        poller = Poller(Steady(), a, lambda limit, s: None, lambda: (0, 0))
        poller.start()
        await three.wait()
        await poller.stop()
        assert calls == [0.0, 0.5, 1.0] and poller.rounds == 2

    with caplog.at_level(logging.ERROR, logger="extproc.backend"):
        run(main())
    (record,) = caplog.records
    assert record.getMessage() == (
        "backend-poller: a round failed (1 in a row); the loop goes on in 0.50 s"
    )
    assert record.exc_info is not None


def test_abandoned_answers_cut_the_limit() -> None:
    """``slo.abandoned``: of the slot time of the admitted requests that ended in the window (at
    least 10 of them), a larger share than the objective went to answers that ended after their
    client had gone: cut by 20 %, with or without the latency objectives; within 0.9x of it the
    limit holds, below it grows."""
    a = limiter(initial=100, abandoned_max=0.02)
    assert a.update(0.0, sig(0), in_flight=100, waiting=5, ended=(100, 0.03)) == 80
    assert a.reason == "abandoned"
    b = limiter(initial=100, abandoned_max=0.02)
    alone = {"ended": (100, 0.03), "objectives": False}
    assert b.update(0.0, sig(0), in_flight=100, waiting=5, **alone) == 80  # type: ignore[arg-type]
    c = limiter(initial=100, abandoned_max=0.02)
    assert c.update(0.0, sig(0), in_flight=100, waiting=5, ended=(100, 0.02)) == 100  # 2 %
    assert c.update(1.0, sig(1), in_flight=100, waiting=5, ended=(1000, 0.019)) == 100  # 1.9 %
    assert c.update(2.0, sig(2), in_flight=100, waiting=5, ended=(1000, 0.017)) == 105  # 1.7 %
    few = limiter(initial=100, abandoned_max=0.02)
    assert few.update(0.0, sig(0), in_flight=100, waiting=5, ended=(9, 1.0)) == 105  # too few
    none = limiter(initial=100)  # no objective: abandoned ends change nothing
    assert none.update(0.0, sig(0), in_flight=100, waiting=5, ended=(100, 1.0)) == 105


def test_abandoned_answers_cut_the_limit_not_the_band() -> None:
    """Every band's streams slow down together: a band held above its floor is not cut first,
    the limit is."""
    a = limiter(initial=100, abandoned_max=0.02)
    band = BandLoad(running=40, waiting=5, floor=10, top=90)
    assert a.update(0.0, sig(0), in_flight=100, waiting=5, band=band, ended=(50, 0.1)) == 80
    assert a.band_cut.cap is None


def test_poller_passes_the_ends_of_its_window(caplog: pytest.LogCaptureFixture) -> None:
    """Each round reads ``ended(now, window)``; a callback that raises counts as no ends."""

    class Fine:
        async def scrape(self, now: float) -> Signals:
            return sig(now)

    async def main() -> None:
        asked: list[float] = []
        answers = iter([(100, 0.5)])

        def ended(now: float, window_s: float) -> tuple[int, float]:
            asked.append(window_s)
            return next(answers)  # StopIteration on the second round

        a = limiter(initial=100, interval_s=1.0, window_s=7.0, abandoned_max=0.1)
        poller = Poller(Fine(), a, lambda limit, s: None, lambda: (100, 1), ended=ended)
        assert await poller.poll_once() == 80
        assert asked == [7.0]
        a._decreased_at = None  # the cooldown aside: this round is about the callback
        assert await poller.poll_once() == 84  # no count: grows

    with caplog.at_level(logging.ERROR, logger="extproc.backend"):
        run(main())
    assert "backend ended callback failed" in [r.getMessage() for r in caplog.records]
