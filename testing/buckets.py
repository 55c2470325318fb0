"""A bucket rule for the admission core's tests: ``rule("hi", priority=0, max_share=0.5)``."""

from __future__ import annotations

from typing import Any

from extproc.config.policy import BucketPolicy
from extproc.pool.core.relegate import Relegation
from extproc.pool.core.state import BucketRule


def rule(
    name: str,
    *,
    max_queue: int = 100,
    cap: int | None = None,
    relegate_to: Relegation | None = None,
    **policy: Any,
) -> BucketRule:
    """``name``'s rule in a shared pool, its share and cap the policy's; ``policy``: more
    ``BucketPolicy`` fields (their defaults are the policy's)."""
    p = BucketPolicy(
        name=name, max_concurrency=cap or 0, queue_timeout_s=1.0, max_queue=max_queue, **policy
    )
    return BucketRule(policy=p, max_share=p.max_share, cap=cap, relegate=relegate_to)
