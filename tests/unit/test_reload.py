"""``shared_change`` (``extproc.pool.control.reload``): a reload that changes ``pool.shared`` is
refused, and the message says which key and that a restart applies it; any other change of the
pool is not its business."""

from __future__ import annotations

from dataclasses import replace

import pytest

from extproc.config.policy import PoolPolicy, SharedPolicy
from extproc.pool.control.reload import shared_change

SHARED = SharedPolicy(redis="redis://127.0.0.1:1/0", lease_s=1.0)
RESTART = "; restart the sidecar (a rolling restart) to apply it"
MANAGER = "changed: a reload cannot change a running pool's lease manager"


def pool(shared: SharedPolicy | None = SHARED, limit: int = 4) -> PoolPolicy:
    return PoolPolicy(max_concurrency=limit, shared=shared)


@pytest.mark.parametrize(
    ("before", "after", "why"),
    [
        (pool(None), pool(), "pool.shared added: a reload cannot turn shared mode on"),
        (None, pool(), "pool.shared added: a reload cannot turn shared mode on"),
        (pool(), pool(None), "pool.shared removed: a reload cannot turn shared mode off"),
        (pool(), None, "pool.shared removed: a reload cannot turn shared mode off"),
        (
            pool(),
            pool(replace(SHARED, redis="redis://127.0.0.1:1/1")),
            "pool.shared.redis changed: a reload cannot move a running pool to another Redis",
        ),
        (  # the Redis first, whatever else changed
            pool(),
            pool(replace(SHARED, redis="redis://other:6379/0", key_prefix="other", lease_s=2.0)),
            "pool.shared.redis changed: a reload cannot move a running pool to another Redis",
        ),
        (
            pool(),
            pool(replace(SHARED, key_prefix="other", replicas=3)),
            "pool.shared.key_prefix changed: a reload cannot move a running pool to another "
            "pool on its Redis",
        ),
        (
            pool(),
            pool(replace(SHARED, lease_s=2.0, timeout_s=0.2)),
            f"pool.shared.lease and pool.shared.timeout {MANAGER}",
        ),
        (pool(), pool(replace(SHARED, replicas=3)), f"pool.shared.replicas {MANAGER}"),
    ],
)
def test_a_change_of_pool_shared_is_refused_with_why(
    before: PoolPolicy | None, after: PoolPolicy | None, why: str
) -> None:
    assert shared_change(before, after) == why + RESTART


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (pool(), pool(limit=8)),  # the limit of a shared pool: applied in place
        (pool(None), pool(None, limit=8)),
        (None, None),
        (None, pool(None)),
        (pool(None), None),
        (pool(), pool(SharedPolicy(redis="redis://127.0.0.1:1/0", lease_s=1.0))),  # equal
    ],
)
def test_a_reload_that_keeps_pool_shared_is_not_refused(
    before: PoolPolicy | None, after: PoolPolicy | None
) -> None:
    assert shared_change(before, after) is None
