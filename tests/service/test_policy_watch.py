"""Tier 2: the policy file's watcher outlives a look that raised (``extproc.loops``): the
next change of the file is still reloaded, and the failure is logged and counted."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from extproc.app import Sidecar
from extproc.config.policy import load_policy
from testing.wait import until_async

POLICY = "buckets:\n  - {{name: b, max_concurrency: {n}, queue_timeout: 2s}}\n"


def test_the_watcher_goes_on_after_a_look_that_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception while looking at the file ended the watcher: no reload after it."""
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY.format(n=3))

    async def main() -> None:
        sidecar = Sidecar(
            load_policy(path),
            listen="127.0.0.1:0",
            metrics_listen=None,
            policy_path=path,
            watch_interval_s=0.02,
        )
        await sidecar.start()
        try:
            look, looks = sidecar._file_state, list[None]()

            def failing() -> tuple[int, int, int] | None:
                looks.append(None)
                if len(looks) == 1:
                    raise RuntimeError("stat broke")
                return look()

            sidecar._file_state = failing  # type: ignore[method-assign]
            await until_async(lambda: len(looks) >= 2, "the watcher looked again")
            path.write_text(POLICY.format(n=12))  # another size: a coarse mtime cannot hide it
            assert sidecar.gate is not None
            gate = sidecar.gate
            await until_async(lambda: gate.statistics()["b"].capacity == 12, "reloaded")
            assert sidecar.metrics is not None
            errors = sidecar.metrics.registry.get_sample_value(
                "llm_extproc_loop_errors_total", {"loop": "policy-watch"}
            )
            assert errors == 1
        finally:
            await sidecar.stop(0)

    with caplog.at_level(logging.ERROR, logger="extproc"):
        asyncio.run(asyncio.wait_for(main(), 30))
    failed = [r for r in caplog.records if r.getMessage().startswith("policy-watch:")]
    assert len(failed) == 1 and failed[0].exc_info is not None
