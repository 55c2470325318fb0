"""The adaptive limit's latency objectives, one row each: a new one is a row here and its two
keys in the policy's schema (``Slo`` in ``protos/llm_extproc/v1/policy.proto``, ``make protos``).
It imports nothing of extproc, so that the policy, the scraper and the pool all read it from
below them (the bottom layer of tests/unit/test_imports.py).

The rest reads the rows, by ``name``, in the table's order (that a breach is named in and
everything printed):

- the policy: ``pool.adaptive.slo.<key>``, the objective (a duration; unset: none), and
  ``slo.<key>_quantile`` (default ``quantile``): ``AdaptivePolicy.slo_s``, ``quantiles``;
- the scraper: the ``_bucket`` samples of ``family`` (``old``: older vLLM's name, read where
  ``family`` is absent; ``extproc.backend.vllm``), windowed: ``Signals.latency``
  (``extproc.backend.scrape``);
- the law: a quantile above its objective cuts the limit (reason ``name``), or first the least
  urgent band (``band_<name>``; ``extproc.pool.control.adaptive``);
- the gauge ``llm_extproc_backend_<name>_seconds``, "Windowed quantile of ``what``", and
  ``<name>_s`` in /debug/queues (``extproc.pool.control.poller.BackendSnapshot``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["OBJECTIVES", "Objective"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Objective:
    name: str
    family: str
    key: str
    what: str
    old: str | None = None
    quantile: float = 0.9

    @property
    def quantile_key(self) -> str:
        return f"{self.key}_quantile"


OBJECTIVES: Final = (
    Objective(
        name="ttft",
        family="vllm:time_to_first_token_seconds",
        key="ttft",
        what="vLLM's time to first token",
    ),
    # Every token's gap (a version with both names carries the same observations in each).
    Objective(
        name="itl",
        family="vllm:inter_token_latency_seconds",
        old="vllm:time_per_output_token_seconds",
        key="inter_token",
        what="vLLM's inter-token latency",
    ),
    # Each finished request's mean gap: one prefill step of 115 ms in a stream of 50 ms steps
    # breaks an itl p90 of 100 ms once a tenth of the steps carry one, while the client reads
    # its answer at the speed of the mean.
    Objective(
        name="tpot",
        family="vllm:request_time_per_output_token_seconds",
        key="tpot",
        what="vLLM's time per output token per request",
    ),
    # Each finished request's wait in vLLM's queue before its first scheduling step (vLLM's
    # ``queued_time = scheduled_ts - queued_ts``, ``vllm/v1/metrics/stats.py``): its time to
    # first token less its prefill, which grows with the prompt and no admission shortens; the
    # wait is what admitting too much adds, whatever the prompt's size. It lags, as tpot does,
    # by the answers' length (both are observed when a request finishes).
    Objective(
        name="queue_time",
        family="vllm:request_queue_time_seconds",
        key="queue_time",
        what="the time requests waited in vLLM's own queue",
    ),
)
