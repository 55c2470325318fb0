"""Gauges and debug views rendered from snapshot dataclasses: a field's metadata says how it
is shown, so adding a gauge is one edit. Pure, except the last test (a real gate)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from enum import StrEnum

from extproc.backend.scrape import Latency, Signals
from extproc.config.policy import policy_from_yaml
from extproc.ops.metrics import POOL_GAUGES, Metrics
from extproc.pool.control.wiring import PoolControl
from extproc.pool.gate import Gate
from extproc.pool.view import HIDDEN, Gauge, gauge, gauges_of, render_debug, render_gauges


class Light(StrEnum):
    GREEN = "green"
    RED = "red"


@dataclass(frozen=True, slots=True, kw_only=True)
class Snap:
    light: Light = field(metadata=gauge("light", "0 green, 1 red.", codes={"green": 0, "red": 1}))
    on: bool = field(metadata=gauge("on", "1 when on."))
    count: int = field(metadata=gauge("count", "How many.", key="how_many"))
    rate: float | None = field(metadata=gauge("rate", "Per second."))
    bound: int | None = field(metadata=gauge("bound", "The bound (0: none).", if_none=0))
    seen: int = field(metadata=gauge("seen", "Seen while on.", when="on"))
    why: str | None
    notes: tuple[str, ...]
    secret: float = field(metadata=HIDDEN)


def snap(**kw: object) -> Snap:
    values: dict[str, object] = {
        "light": Light.RED,
        "on": True,
        "count": 3,
        "rate": None,
        "bound": None,
        "seen": 7,
        "why": None,
        "notes": ("a", "b"),
        "secret": 1.5,
    }
    values.update(kw)
    return Snap(**values)  # type: ignore[arg-type]


def test_gauges_render_by_their_rules() -> None:
    out: dict[str, float] = {}
    render_gauges(snap(), out)
    assert out == {"light": 1, "on": 1, "count": 3, "bound": 0, "seen": 7}
    assert list(out) == ["light", "on", "count", "bound", "seen"]  # field order
    out = {}
    render_gauges(snap(on=False, rate=2.5, bound=9), out)
    assert out == {"light": 1, "on": 0, "count": 3, "rate": 2.5, "bound": 9}


def test_debug_renders_every_shown_field_under_its_key() -> None:
    assert render_debug(snap(why="because")) == {
        "light": "red",
        "on": True,
        "how_many": 3,
        "rate": None,
        "bound": None,
        "seen": 7,
        "why": "because",
        "notes": ["a", "b"],
    }


def test_the_gauges_of_a_class_carry_name_and_help() -> None:
    assert [g.name for g in gauges_of(Snap)] == ["light", "on", "count", "rate", "bound", "seen"]
    assert gauges_of(Snap)[0] == Gauge(
        name="light", help="0 green, 1 red.", codes={"green": 0, "red": 1}
    )


def test_every_gauge_the_pool_reports_has_its_help() -> None:
    """POOL_GAUGES comes from the snapshots; a controller's gauges are a subset of it."""

    async def main() -> None:
        policy = policy_from_yaml(
            """
pool: {max_concurrency: 4, max_tokens_in_flight: 1000}
buckets:
  - {name: chat, match: {headers: {x: y}}, priority: 0, queue_timeout: 1s, max_queue: 5}
  - {name: batch, priority: 10, queue_timeout: 1s, max_queue: 5}
"""
        )
        gate = Gate(policy)
        control = PoolControl(gate, Metrics(gate.statistics))
        control.apply(policy)
        control.tick(0.0)
        gauges = control.gauges()
        assert set(gauges) <= set(POOL_GAUGES)
        assert gauges["pool_tokens_limit"] == 1000 and gauges["overload_state"] == 0
        debug = control.debug()
        assert debug is not None
        assert list(debug) == [
            "limit",
            "in_flight",
            "queued",
            "max_tokens_in_flight",
            "tokens_in_flight",
            "release_rate",
            "band_cut",
            "overload",
        ]
        assert list(debug["overload"]) == [
            "state",
            "factor",
            "reason",
            "eviction_rate",
            "p95_wait_s",
            "needs_capacity",
        ]
        assert debug["overload"]["state"] == "normal" and debug["overload"]["factor"] == 1.0

    asyncio.run(main())


def test_the_adaptive_entry_and_the_backend_gauges_keep_their_keys() -> None:
    async def main() -> None:
        policy = policy_from_yaml(
            """
pool: {adaptive: {min: 1, max: 16, initial: 4}}
backend: {metrics: ["http://127.0.0.1:1/metrics"]}
buckets: [{name: a, queue_timeout: 1s, max_queue: 5}]
"""
        )
        gate = Gate(policy)
        control = PoolControl(gate, Metrics(gate.statistics))
        control.apply(policy)  # the poller exists, not started
        debug = control.debug()
        assert debug is not None
        assert debug["adaptive"] == {"state": "tracking", "reason": "initial", "signals": None}
        assert "backend_up" not in control.gauges()
        down = Signals(
            at=0.0,
            endpoints_ok=0,
            endpoints_failed=1,
            waiting=0,
            running=0,
            kv_usage=0.0,
            errors=("refused",),
        )
        control._on_limit(4, down)
        gauges = control.gauges()
        assert gauges["backend_up"] == 0 and gauges["adaptive_state"] == 0
        assert not {"backend_waiting", "backend_ttft_seconds"} & set(gauges)  # nobody answered
        up = replace(
            down,
            endpoints_ok=2,
            endpoints_failed=0,
            waiting=3,
            running=5,
            kv_usage=0.5,
            latency={
                "ttft": Latency(0.2, 20),
                "itl": Latency(),
                "tpot": Latency(0.05, 12),
                "queue_time": Latency(0.4, 12),
            },
            errors=(),
        )
        control._on_limit(4, up)
        gauges = control.gauges()
        assert {k: v for k, v in gauges.items() if k.startswith("backend_")} == {
            "backend_up": 2,
            "backend_waiting": 3,
            "backend_running": 5,
            "backend_kv_usage": 0.5,
            "backend_ttft_seconds": 0.2,
            "backend_tpot_seconds": 0.05,
            "backend_queue_time_seconds": 0.4,
        }
        signals = control.debug()["adaptive"]["signals"]  # type: ignore[index]
        assert signals == {
            "endpoints_ok": 2,
            "endpoints_failed": 0,
            "waiting": 3,
            "running": 5,
            "kv_usage": 0.5,
            "ttft_s": 0.2,
            "itl_s": None,
            "tpot_s": 0.05,
            "queue_time_s": 0.4,
            "errors": [],
        }

    asyncio.run(main())
