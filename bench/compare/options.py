"""The options of one comparison, and how to start its simulator."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, Literal

from bench.load.presets import default_classes
from bench.load.workload import ClassSpec, LogNormal
from bench.sim.profiles import PROFILES, EngineConfig
from testing.stack import REPO

Strategy = Literal[
    "direct",
    "envoy-cb-default",
    "envoy-cb",
    "envoy-adaptive",
    "priority-gateway",
    "sidecar-static",
    "sidecar",
    "sidecar-fair",
    "replicas-shared",
    "replicas-shared-fair",
]
# The peers the sidecar is measured against (bench.compare.baselines), in report order.
BASELINES: Final[tuple[Strategy, ...]] = (
    "direct",
    "envoy-cb-default",
    "envoy-cb",
    "envoy-adaptive",
    "priority-gateway",
)
# The default comparison: one gateway (or none) in front of the simulator.
STRATEGIES: Final[tuple[Strategy, ...]] = (*BASELINES, "sidecar-static", "sidecar")
# Several gateways (Envoy + sidecar each, ``Options.replicas``) sharing one pool through Redis,
# in front of ONE simulator: run only when asked for (``--strategies replicas-shared``).
REPLICA_STRATEGIES: Final[tuple[Strategy, ...]] = ("replicas-shared", "replicas-shared-fair")
# ``sidecar`` with fairness between tenants (bench.compare.strategies): run only when asked for.
FAIR_STRATEGY: Final[Strategy] = "sidecar-fair"
KNOWN_STRATEGIES: Final[tuple[Strategy, ...]] = (*STRATEGIES, FAIR_STRATEGY, *REPLICA_STRATEGIES)
# The noisy-neighbour scenario's strategies when none are named (bench.compare.scenarios).
NOISY_STRATEGIES: Final[tuple[Strategy, ...]] = (
    FAIR_STRATEGY,
    "sidecar",
    "priority-gateway",
    "envoy-cb",
)
# The strategies whose Envoy runs the ext_proc filter and the sidecar.
SIDECAR_STRATEGIES: Final[frozenset[Strategy]] = frozenset(
    {"sidecar-static", "sidecar", FAIR_STRATEGY, *REPLICA_STRATEGIES}
)
# Envoy in front without ext_proc.
PLAIN_ENVOY_STRATEGIES: Final[frozenset[Strategy]] = frozenset(
    {"envoy-cb-default", "envoy-cb", "envoy-adaptive"}
)
ScenarioName = Literal["steady", "shift", "halve", "spike", "noisy"]
# ``--scenario all``: the two-class scenarios; the noisy neighbour only when named.
SCENARIOS: Final[tuple[ScenarioName, ...]] = ("steady", "shift", "halve", "spike")
KNOWN_SCENARIOS: Final[tuple[ScenarioName, ...]] = (*SCENARIOS, "noisy")
DEFAULT_OUT: Final = REPO / "bench" / "results"
CLASSES: Final = ("interactive", "batch")
# --backend vllm-cpu (capacity.vllm_engine): one real vLLM (testing/vllm.py, the tiny random
# model on one CPU core) running this many sequences at once, lengths scaled to it (interactive
# chat, batch prompt-heavy; prompt + output within its max_model_len), three strategies.
VLLM_SEQS: Final = 32
VLLM_MAX_MODEL_LEN: Final = 2048
VLLM_STRATEGIES: Final[tuple[Strategy, ...]] = ("direct", "envoy-cb", "sidecar")
_LN = LogNormal
VLLM_LENGTHS: Final = {  # (prompt, output)
    "interactive": (_LN(median=96, sigma=0.6, lo=8, hi=768), _LN(median=48, sigma=0.6, hi=256)),
    "batch": (_LN(median=384, sigma=0.5, lo=32, hi=1024), _LN(median=16, sigma=0.6, hi=128)),
}  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """One comparison. Durations are simulated seconds."""

    backend: Literal["sim", "vllm-cpu"] = "sim"
    engine_port: int | None = None  # vllm-cpu: the running engine's, once it runs
    profile: str = "a100"
    speedup: float = 3.0
    duration_s: float = 200.0  # arrivals; the measurement window is [warmup_s, duration_s)
    warmup_s: float = 90.0  # (max_retries + 1) x the interactive timeout
    loads: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)  # the steady scenario's offered loads
    strategies: tuple[Strategy, ...] = STRATEGIES
    scenarios: tuple[ScenarioName, ...] = ("steady",)
    seed: int = 0
    interactive_share: float = 0.8
    interactive_timeout_s: float = 30.0
    batch_timeout_s: float = 300.0
    max_retries: int = 2
    interactive_queue_timeout_s: float = 1.0
    batch_min_share: float = 0.0  # the sidecar pool's batch bucket: its guaranteed share
    # The pool policies' interactive bucket relegates to its retries' band (``relegate_to``).
    relegate: bool = False
    # The adaptive sidecar's streaming objective: every token's gap
    # (``inter_token``) or each answer's mean gap (``tpot``).
    stream_objective: Literal["inter_token", "tpot"] = "inter_token"
    stream_slo_ms: float = 100.0  # that objective, at p90
    # The adaptive sidecar's ``slo.abandoned``: the most admitted answers, as a share, that may
    # end after their client's stated timeout (None: no such objective).
    abandoned: float | None = None
    # The adaptive sidecar's admission objective: ``ttft`` 1 s p90 (the time to first token,
    # the prompt's own prefill included), ``queue_time`` (vLLM's queue wait alone, p90, at
    # ``queue_time_ms`` simulated ms) or ``both``.
    admission_objective: Literal["ttft", "queue_time", "both"] = "ttft"
    queue_time_ms: float = 500.0
    batch_queue_timeout_frac: float = 0.8
    cb_pending_s: float = 2.0
    concurrency: int | None = None  # None: derived (see capacity.determine_capacity)
    model_requests: int = 4000
    live_capacity_s: float = 45.0
    max_lag_s: float = 1.0
    traces_dir: str | None = None
    out_dir: Path = DEFAULT_OUT
    max_requests: int = 200_000
    # The time-varying scenarios (see bench.compare.scenarios): multiples of capacity.
    base_load: float = 1.0  # halve and spike: the load before and after the change
    flood_load: float = 2.0  # shift: batch's flood and interactive's burst, of each one's capacity
    spike_load: float = 4.0
    spike_s: float = 30.0
    slow_factor: float = 0.5  # halve: the backend's speed after the change
    # noisy: one heavy tenant and a few light ones, all interactive, multiples of interactive's
    # own capacity; each seed a run of its own (and its no-flood reference).
    heavy_load: float = 5.0
    light_load: float = 0.2
    light_tenants: int = 4
    noisy_seeds: tuple[int, ...] = (0, 1)
    pool_fail_fast: bool = True  # sidecar, sidecar-fair: pool.fail_fast (off: a diagnostic)
    sample_every_s: float = 2.0  # backend and limit gauges sampled this often during a run
    replicas: int = 3  # the replica strategies' gateways (requests round robin over them)

    def classes(self, rate: float) -> tuple[ClassSpec, ...]:
        """The two-class mix at ``rate`` requests per simulated second, with our timeouts
        (vllm-cpu: Poisson arrivals, :data:`VLLM_LENGTHS`)."""

        def lengths(name: str) -> dict[str, Any]:
            if self.backend != "vllm-cpu":
                return {}
            prompt, output = VLLM_LENGTHS[name]
            return {"trace": None, "prompt": prompt, "output": output}

        return tuple(
            replace(c, timeout_s=self.timeouts_s[c.name], **lengths(c.name))
            for c in default_classes(rate, interactive_share=self.interactive_share)
        )

    @property
    def engine(self) -> EngineConfig:
        """The simulator's engine: vLLM's defaults, this profile (vllm-cpu: the real engine's
        limits)."""
        if self.backend == "vllm-cpu":
            return EngineConfig(max_num_seqs=VLLM_SEQS, max_model_len=VLLM_MAX_MODEL_LEN)
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
