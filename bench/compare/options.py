"""The options of one comparison, and how to start its simulator."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final, Literal

from bench.load.workload import ClassSpec, default_classes
from bench.sim.profiles import PROFILES, EngineConfig
from testing.stack import REPO

Strategy = Literal["direct", "envoy-cb", "sidecar"]
STRATEGIES: Final[tuple[Strategy, ...]] = ("direct", "envoy-cb", "sidecar")
DEFAULT_OUT: Final = REPO / "bench" / "results"
CLASSES: Final = ("interactive", "batch")


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """One comparison. Durations are simulated seconds."""

    profile: str = "a100"
    speedup: float = 3.0
    duration_s: float = 200.0  # arrivals; the measurement window is [warmup_s, duration_s)
    warmup_s: float = 90.0  # (max_retries + 1) x the interactive timeout
    loads: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    strategies: tuple[Strategy, ...] = STRATEGIES
    seed: int = 0
    arrivals: Literal["poisson", "trace"] = "poisson"
    interactive_share: float = 0.8
    interactive_timeout_s: float = 30.0
    batch_timeout_s: float = 300.0
    max_retries: int = 2
    interactive_queue_timeout_s: float = 1.5
    batch_queue_timeout_frac: float = 0.8
    queue_bound: Literal["deadline", "drain"] = "drain"
    cb_pending_s: float = 2.0
    concurrency: int | None = None  # None: derived (see capacity.determine_capacity)
    model_requests: int = 4000
    live_capacity_s: float = 45.0
    max_lag_s: float = 1.0
    traces_dir: str | None = None
    out_dir: Path = DEFAULT_OUT
    max_requests: int = 200_000

    def classes(self, rate: float) -> tuple[ClassSpec, ...]:
        """The two-class mix at ``rate`` requests per simulated second, with our timeouts."""
        return tuple(
            replace(c, timeout_s=self.timeouts_s[c.name])
            for c in default_classes(
                rate, interactive_share=self.interactive_share, arrivals=self.arrivals
            )
        )

    @property
    def engine(self) -> EngineConfig:
        """The simulator's engine: vLLM's defaults, this profile."""
        return EngineConfig(profile=PROFILES[self.profile])

    @property
    def queue_timeouts_s(self) -> dict[str, float]:
        """The sidecar's queue deadline per class, simulated seconds."""
        return {
            "interactive": self.interactive_queue_timeout_s,
            "batch": self.batch_queue_timeout_frac * self.batch_timeout_s,
        }

    @property
    def timeouts_s(self) -> dict[str, float]:
        """The clients' timeout per class (per attempt), simulated seconds."""
        return {"interactive": self.interactive_timeout_s, "batch": self.batch_timeout_s}


def backend_argv(opts: Options) -> list[str]:
    """The simulator's command line (``{port}`` is filled in by :class:`~testing.stack.Stack`)."""
    return [
        sys.executable,
        "-m",
        "bench.sim",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--profile",
        opts.profile,
        "--speedup",
        f"{opts.speedup:g}",
    ]
