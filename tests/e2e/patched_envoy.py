"""A stack (backend + sidecar, ``testing.harness.running_stack``) behind an Envoy whose config a
test changes first: the shipped config with its ports replaced (``render_envoy_config``), then
``patch`` applied to the parsed dict. For the Envoy facts that need a setting shorter or
smaller than the shipped one to show in seconds (a 1 s route timeout, circuit breakers of 100)
while everything else stays as shipped.

Envoy runs as the stack's own would (``stack.procs["envoy"]``, the same flags), so
``stack.envoy_stat``, ``stack.access_log_path`` and the logs printed on failure work as usual.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from testing.envoy import SHIPPED_ENVOY, envoy_binary, render_envoy_config
from testing.harness import running_stack
from testing.stack import Proc, Stack, wait_http

__all__ = ["running_patched"]


@contextlib.contextmanager
def running_patched(
    tmp: Path,
    policy: str | None,
    patch: Callable[[dict[str, Any]], None],
    *,
    source: Path = SHIPPED_ENVOY,
    **stack_kwargs: Any,
) -> Iterator[Stack]:
    """Backend and sidecar as ``running_stack`` starts them, then Envoy on ``source`` (the
    shipped envoy/envoy.yaml by default) with the stack's ports, changed by ``patch``."""
    with running_stack(tmp, policy, start_envoy=False, **stack_kwargs) as stack:
        cfg = yaml.safe_load(
            render_envoy_config(
                listener_port=stack.listener_port,
                backend_port=stack.backend_port,
                extproc_port=stack.extproc_port,
                admin_port=stack.admin_port,
                source=source,
                access_log=stack.access_log_path,
            )
        )
        patch(cfg)
        path = tmp / "envoy.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        argv = [envoy_binary(), "-c", str(path), "--concurrency", "1", "--disable-hot-restart"]
        # Access-log lines reach the file within 100 ms (default 10 s).
        argv += ["--log-level", "warning", "--file-flush-interval-msec", "100"]
        envoy = stack.procs["envoy"] = Proc("envoy", argv, tmp)
        try:
            wait_http(f"http://127.0.0.1:{stack.admin_port}/ready", proc=envoy)
            yield stack
        except BaseException:
            stack.dump_logs()
            raise
