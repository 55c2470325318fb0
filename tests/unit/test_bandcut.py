"""The band cut (``extproc.pool.control.bandcut``): a latency breach shrinks the least urgent band
before the shared limit. Each rule of the module docstring with plain numbers and a fake clock
(``now`` passed in), then the core applying it and the controller wiring it to the gate."""

from __future__ import annotations

import asyncio

import pytest

from extproc.backend.scrape import Signals
from extproc.config.policy import policy_from_yaml
from extproc.ops.metrics import Metrics
from extproc.pool.control.adaptive import AdaptiveLimit
from extproc.pool.control.bandcut import BandCut, BandLoad, band_load
from extproc.pool.control.wiring import PoolControl
from extproc.pool.core.admission import Admission
from extproc.pool.core.demand import limit_demand
from extproc.pool.core.values import Entry
from extproc.pool.gate import Gate, Slot
from testing.buckets import rule
from testing.clock import run_virtual
from tests.unit.test_adaptive import limiter, sig

POOL = "pool"
WINDOW = 10.0  # the limiters' cooldown (AdaptivePolicy's window_s default)
ITL_BREACH = 0.1  # twice the limiter's 50 ms objective: the deepest cut, 0.5
ITL_SMALL = 0.055  # 10 % over: the mildest cut, 0.8
ITL_OK = 0.02  # far within


def band(running: int, *, waiting: int = 10, floor: int = 10, top: int = 90) -> BandLoad:
    return BandLoad(running=running, waiting=waiting, floor=floor, top=top)


def step(
    a: AdaptiveLimit, now: float, b: BandLoad | None, itl: float, *, in_flight: int = 90
) -> int:
    return a.update(now, sig(now, itl=itl), in_flight=in_flight, waiting=5, band=b)


# --- rule 1: who is cut first --------------------------------------------------------------


def test_a_latency_breach_cuts_the_band_above_its_floor_not_the_limit() -> None:
    a = limiter(initial=100)
    assert step(a, 0.0, band(40), ITL_BREACH) == 100  # the limit holds
    assert (a.reason, a.band_cut.cap) == ("band_itl", 20)  # 40 x 0.5
    assert a.band_cut.factor(band(40)) == pytest.approx(20 / 90)


def test_the_band_cut_takes_the_limits_factor_and_starts_from_what_the_band_holds() -> None:
    a = limiter(initial=100)
    step(a, 0.0, band(30), ITL_SMALL)  # 10 % over: 0.8 of the 30 it runs, not of its cap of 90
    assert a.band_cut.cap == 24
    a = limiter(initial=100)
    a.update(0.0, sig(0, ttft=1.5), in_flight=90, waiting=5, band=band(30))
    assert (a.reason, a.band_cut.cap) == ("band_ttft", 20)  # 1 s / 1.5 s of 30


@pytest.mark.parametrize(
    ("signals", "reason"), [({"waiting": 50}, "vllm_queue"), ({"kv": 0.95}, "kv")]
)
def test_vllm_queue_and_kv_still_cut_the_limit(signals: dict[str, float], reason: str) -> None:
    """They measure what the whole pool admitted, not the band's interference."""
    a = limiter(initial=100)
    limit = 100
    for t in range(3):  # the queue needs three rounds in a row
        limit = a.update(float(t), sig(t, **signals), in_flight=90, waiting=5, band=band(40))  # type: ignore[arg-type]
    assert (limit, a.reason, a.band_cut.cap) == (80, reason, None)


def test_without_a_band_every_breach_cuts_the_limit_as_before() -> None:
    a = limiter(initial=100)
    assert step(a, 0.0, None, ITL_BREACH) == 50
    assert a.reason == "itl"


# --- rules 2 and 3: the floor, and when the limit is cut -----------------------------------


def test_the_cut_stops_at_the_floor_and_then_the_breach_cuts_the_limit() -> None:
    a = limiter(initial=100)
    step(a, 0.0, band(16), ITL_BREACH)
    assert (a.band_cut.cap, step(a, 0.0, band(16), ITL_BREACH)) == (10, 100)  # 8 < floor 10
    # Landed (the band runs its floor), the cooldown over, the breach persists: the limit.
    assert step(a, WINDOW, band(10), ITL_BREACH) == 50
    assert a.reason == "itl" and a.band_cut.cap == 10


def test_a_band_at_or_below_its_floor_or_idle_leaves_the_limit_to_cut() -> None:
    for b in (band(10), band(3), band(0, waiting=0), band(0, floor=0)):
        a = limiter(initial=100)
        assert step(a, 0.0, b, ITL_BREACH) == 50, b
        assert a.band_cut.cap is None


def test_with_no_guaranteed_share_the_band_may_be_cut_to_nothing() -> None:
    c = BandCut()
    assert c.cut(band(3, floor=0), 0.5) and c.cap == 1
    assert c.cut(band(1, floor=0), 0.5) and c.cap == 0
    assert not c.cut(band(0, floor=0), 0.5)  # nothing held: the limit's turn
    assert c.factor(band(0, floor=0)) == 0.0


# --- rule 4: a cut lands before the next ---------------------------------------------------


def test_after_a_band_cut_nothing_is_cut_or_grown_for_a_cooldown() -> None:
    a = limiter(initial=100)
    step(a, 0.0, band(40), ITL_BREACH)
    for t in (1.0, 5.0, WINDOW - 0.5):
        assert step(a, t, band(20), ITL_BREACH) == 100  # no cut ...
        assert a.band_cut.cap == 20
        assert step(a, t, band(20), ITL_OK) == 100  # ... and no growth, no lending
        assert a.band_cut.cap == 20


def test_while_the_band_runs_more_than_its_cut_a_latency_breach_cuts_nothing() -> None:
    a = limiter(initial=100)
    step(a, 0.0, band(40), ITL_BREACH)
    for t in (WINDOW, 30.0, 60.0):  # its requests admitted before the cut still run
        assert step(a, t, band(35), ITL_BREACH) == 100
        assert a.band_cut.cap == 20
    a.update(61.0, sig(61, kv=0.95), in_flight=90, waiting=5, band=band(35))
    assert a.limit == 80  # KV is not the band's landing: it cuts the limit


def test_a_long_breach_cuts_the_band_to_its_floor_then_the_limit_once_per_cooldown() -> None:
    """A breach twice the objective that nothing clears, the band landing at once: the band
    is cut to its floor, a cooldown apart, and only then the limit, once per cooldown."""
    a = limiter(initial=100)
    limits, caps = [], []
    running = 40
    for i in range(100):
        now = i * 0.5
        cap = a.band_cut.cap
        running = min(running, cap) if cap is not None else running
        limits.append(step(a, now, band(running), ITL_BREACH, in_flight=min(90, a.limit)))
        caps.append(a.band_cut.cap)
    assert caps[0] == 20 and caps[20] == 10  # 40 -> 20 -> the floor, a cooldown apart
    assert limits[:40] == [100] * 40  # the limit untouched while the band had more to give
    assert [limits[i] for i in (40, 60, 80)] == [50, 25, 12]  # then one cut per cooldown


def test_a_breach_the_band_causes_never_moves_the_limit() -> None:
    """The inter-token latency breaks while the band runs more than 12 and holds below: the
    band settles between its floor and a step above it, the limit stays where it was. With
    the limit as the only lever (no band), the same breach takes it to ``min_limit``."""
    a = limiter(initial=100)
    running, caps = 40, set()
    for i in range(600):  # five minutes
        cap = a.band_cut.cap
        running = cap if cap is not None else 40  # the band has work, and lands at once
        assert step(a, i * 0.5, band(running), ITL_BREACH if running > 12 else ITL_OK) == 100
        caps.add(a.band_cut.cap)
    assert caps == {20, 10, 15}  # 40 -> 20 -> 10, then lent 15, cut back to the floor
    alone = limiter(initial=100)
    for i in range(600):  # the limit cut takes no batch away: its 40 keep running
        alone.update(i * 0.5, sig(i * 0.5, itl=ITL_BREACH), in_flight=alone.limit, waiting=5)
    assert alone.limit == 4


def test_requests_running_above_the_limit_hold_off_a_second_cut() -> None:
    a = limiter(initial=100)
    for i in range(240):  # in flight stays above the limit: the cut has not landed
        step(a, i * 0.5, band(10), ITL_BREACH, in_flight=90)
    assert a.limit == 50


# --- rule 5: lend back ---------------------------------------------------------------------


def test_the_cut_is_lent_back_step_by_step_while_the_objectives_hold() -> None:
    a = limiter(initial=100)
    step(a, 0.0, band(40), ITL_BREACH)
    caps: list[int | None] = []
    now = WINDOW
    while a.band_cut.cap is not None and now < 60:
        cap = a.band_cut.cap
        assert step(a, now, band(cap), ITL_OK) == 100  # the limit holds while it lends
        assert a.reason == "lend"
        caps.append(a.band_cut.cap)
        now += 0.5
    assert caps[:4] == [25, 30, 35, 40]  # + max(1, 5 % of the limit of 100), a round each
    assert len(caps) == 14 and caps[-1] is None  # 20 + 14 x 5 = 90, its usual cap: lifted
    assert step(a, now, band(90), ITL_OK) == 105  # then the limit grows again


def test_between_headroom_and_the_objective_the_cut_holds() -> None:
    a = limiter(initial=100)
    step(a, 0.0, band(40), ITL_BREACH)
    assert step(a, WINDOW, band(20), 0.048) == 100  # 0.96 of the objective: no headroom
    assert a.band_cut.cap == 20


def test_a_band_the_cut_does_not_hold_is_not_lent_to_and_the_limit_grows() -> None:
    a = limiter(initial=100)
    step(a, 0.0, band(40), ITL_BREACH)
    assert step(a, WINDOW, band(20, waiting=0), ITL_OK) == 105  # no waiter: the limit's turn
    assert step(a, WINDOW + 0.5, band(12), ITL_OK) == 110  # runs below its cut (interactive won)
    assert (a.band_cut.cap, a.reason) == (20, "increase")


def test_lending_starts_from_the_floor_when_the_floor_rose_above_the_cut() -> None:
    c = BandCut()
    c.cut(band(40), 0.5)
    assert not c.lend(band(20, floor=30), 5)  # below its floor: the floor binds, not the cut
    assert c.lend(band(30, floor=30), 5) and c.cap == 35


def test_stale_data_that_falls_back_lifts_the_band_cut() -> None:
    a = limiter(initial=100)
    step(a, 0.0, band(40), ITL_BREACH)
    a.update(100.0, None, in_flight=0, waiting=0, band=band(40))
    assert a.band_cut.cap is None and a.band_cut.factor(band(40)) == 1.0


# --- the band, and the core applying the cut -----------------------------------------------

POLICY = policy_from_yaml(
    """
pool: {max_concurrency: 20}
buckets:
  - {name: chat, match: {headers: {x: y}}, priority: 0, queue_timeout: 1s, max_queue: 100}
  - {name: batch, match: {headers: {b: c}}, priority: 10, min_share: 0.1, max_share: 0.5,
     queue_timeout: 9s, max_queue: 100}
  - {name: bulk, priority: 10, max_share: 0.5, max_concurrency: 3, queue_timeout: 9s, max_queue: 9}
"""
)


def test_band_load_is_the_least_urgent_bands_requests_floor_and_caps() -> None:
    async def main() -> None:
        gate = Gate(POLICY)
        held = [gate.enter(Entry(bucket="batch", timeout_s=9.0)) for _ in range(12)]
        b = band_load(20, POLICY.buckets, gate.statistics())
        assert b == BandLoad(running=10, waiting=2, floor=2, top=13)  # 2 + 0; 10 + min(10, 3)
        assert band_load(40, POLICY.buckets, gate.statistics()) == BandLoad(
            running=10, waiting=2, floor=4, top=23
        )
        for h in held:
            h.release() if isinstance(h, Slot) else h.cancel()  # type: ignore[union-attr]

    run_virtual(main())
    one = policy_from_yaml("pool: {max_concurrency: 2}\nbuckets: [{name: a, queue_timeout: 1s}]")
    assert band_load(2, one.buckets, {}) is None  # one band: nothing to cut first


def core(limit: int = 20) -> Admission:
    a = Admission({})
    a.set_pool(POOL, limit, 0.0, fail_fast=False)
    a.set_bucket(POOL, rule("chat", max_queue=100, priority=0), 0.0)
    a.set_bucket(POOL, rule("batch", max_queue=100, priority=10, min_share=0.1), 0.0)
    return a


def test_the_core_keeps_the_guaranteed_share_in_requests_whatever_the_cuts() -> None:
    a = core()
    a.enqueue(Entry(bucket="chat", timeout_s=1.0), 0.0)  # a more urgent band runs: the cuts apply
    a.set_cut(POOL, 0.0, 0.0, band=True)
    for _ in range(10):
        a.enqueue(Entry(bucket="batch", timeout_s=60.0), 0.0)
    assert a.statistics()["batch"].in_flight == 2  # floor(0.1 x 20), not 0
    a.set_cut(POOL, 0.0, 0.0)  # and the overload cut besides: still its share
    assert a.statistics()["batch"].in_flight == 2


def test_the_lower_of_the_two_cuts_binds_and_only_while_a_more_urgent_band_runs() -> None:
    a = core()
    ticket = a.enqueue(Entry(bucket="chat", timeout_s=1.0), 0.0).ticket
    for _ in range(12):
        a.enqueue(Entry(bucket="batch", timeout_s=60.0), 0.0)
    assert a.statistics()["batch"].in_flight == 12  # no cut: max_share 1.0, 19 free
    a = core()
    ticket = a.enqueue(Entry(bucket="chat", timeout_s=1.0), 0.0).ticket
    a.set_cut(POOL, 0.8, 0.0)
    a.set_cut(POOL, 0.25, 0.0, band=True)
    for _ in range(12):
        a.enqueue(Entry(bucket="batch", timeout_s=60.0), 0.0)
    st = a.statistics()["batch"]
    assert (st.in_flight, st.capacity) == (5, 5)  # floor(0.25 x 20)
    admitted = a.release(ticket.id, 1.0)  # chat gone: work-conserving, batch may use it all
    assert len(admitted) == 7 and a.statistics()["batch"].capacity == 20
    assert a.pool_statistics(1.0)[POOL].band_cut == 0.25


def test_waiters_held_by_the_band_cut_are_no_demand_for_a_higher_limit() -> None:
    a = core()
    a.enqueue(Entry(bucket="chat", timeout_s=1.0), 0.0)
    a.set_cut(POOL, 0.25, 0.0, band=True)
    for _ in range(12):
        a.enqueue(Entry(bucket="batch", timeout_s=60.0), 0.0)
    pool = a.pool_statistics(0.0)[POOL]
    assert limit_demand(pool, a.statistics(), POLICY.buckets[:2]) == (6, 0)


# --- the controller ------------------------------------------------------------------------

ADAPTIVE = policy_from_yaml(
    """
pool:
  adaptive: {min: 4, max: 64, initial: 20, slo: {inter_token: 50ms}}
backend: {metrics: ["http://127.0.0.1:9/metrics"]}
buckets:
  - {name: chat, match: {headers: {x: y}}, priority: 0, queue_timeout: 1s, max_queue: 100}
  - {name: batch, priority: 10, min_share: 0.1, max_share: 0.9, queue_timeout: 60s,
     max_queue: 100}
"""
)


class FakeScraper:
    def __init__(self) -> None:
        self.itl = ITL_OK

    async def scrape(self, now: float) -> Signals:
        return sig(now, itl=self.itl)


def test_the_controller_cuts_the_band_on_the_gate_and_lends_it_back() -> None:
    async def main() -> None:
        gate = Gate(ADAPTIVE)
        control = PoolControl(gate, Metrics(gate.statistics))
        control.apply(ADAPTIVE)
        poller = control._poller
        assert poller is not None
        scraper = FakeScraper()
        poller.scraper = scraper
        chat = gate.enter(Entry(bucket="chat", timeout_s=1.0))
        batch = [gate.enter(Entry(bucket="batch", timeout_s=60.0)) for _ in range(30)]
        assert isinstance(chat, Slot) and gate.statistics()["batch"].in_flight == 18
        scraper.itl = ITL_BREACH
        assert await poller.poll_once() == 20  # the limit holds ...
        pool = gate.pool_statistics()["pool"]
        assert pool.band_cut == pytest.approx(9 / 18)  # ... batch may hold 18 x 0.5 = 9
        assert gate.statistics()["batch"].capacity == 9
        assert control.gauges()["pool_band_cut"] == pytest.approx(0.5)
        for s in batch[:9]:  # nine finish; nobody new until batch is down to its cut
            assert isinstance(s, Slot)
            s.release()
        assert gate.statistics()["batch"].in_flight == 9
        scraper.itl = ITL_OK
        await asyncio.sleep(poller.adaptive.cooldown_s)  # the cut has landed in the window
        assert await poller.poll_once() == 20
        assert gate.statistics()["batch"].capacity == 10  # + max(1, 5 % of 20)
        assert gate.statistics()["batch"].in_flight == 10
        for s in [chat, *batch]:
            if isinstance(s, Slot):
                s.release()
            else:
                s.cancel()

    run_virtual(main())
