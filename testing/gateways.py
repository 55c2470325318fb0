"""Several gateways (sidecar + Envoy each) in front of one backend, sharing one Redis: the
shared pool's end-to-end tests (``tests/shared/``).

``Gateways(n, policy, log_dir)`` starts a throwaway ``redis-server``, one backend (by default
the vLLM-like simulator, ``python -m bench.sim --speedup 20``), then ``n`` stacks that route to
it, all on one policy file, in which ``{redis}`` is replaced by the Redis URL and ``{backend}``
by the backend's. ``policy`` may
also be one policy per gateway (``policy-<i>.yaml``: each replica's own Redis URL in
``testing.faults``), and ``sidecar_args`` are more flags for every sidecar. ``Sampler``
polls the simulator's ``/sim/stats`` from a thread and keeps the most requests it ever had
(running + waiting): what the backend itself says was in flight, whatever the gateways think.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from testing.redis import RedisServer
from testing.stack import Stack

__all__ = ["SIM", "Gateways", "Sampler"]

SIM = [sys.executable, "-m", "bench.sim", "--port", "{port}", "--speedup", "20"]


class Gateways:
    def __init__(
        self,
        n: int,
        policy: str | Sequence[str],
        log_dir: Path,
        *,
        backend_argv: Sequence[str] = SIM,
        envoy_patch: Callable[[dict[str, Any]], None] | None = None,
        sidecar_args: Sequence[str] = (),
    ) -> None:
        if not isinstance(policy, str) and len(policy) != n:
            raise ValueError(f"{len(policy)} policies for {n} gateways")
        self.n = n
        self.policy = policy
        self.log_dir = log_dir
        self.backend_argv = list(backend_argv)
        self.envoy_patch = envoy_patch
        self.sidecar_args = list(sidecar_args)
        self.redis = RedisServer(log_dir)
        self.backend: Stack | None = None
        self.stacks: list[Stack] = []

    @property
    def backend_url(self) -> str:
        assert self.backend is not None
        return self.backend.backend_url

    @property
    def policy_path(self) -> Path:
        return self.log_dir / "policy.yaml"

    @property
    def policy_paths(self) -> list[Path]:
        """Each gateway's policy file (the one ``policy.yaml`` unless given one per gateway)."""
        if isinstance(self.policy, str):
            return [self.policy_path] * self.n
        return [self.log_dir / f"policy-{i}.yaml" for i in range(self.n)]

    @property
    def urls(self) -> list[str]:
        """Each gateway's Envoy listener."""
        return [stack.url for stack in self.stacks]

    def start(self) -> Gateways:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.redis.start()
            self.backend = Stack(
                backend_argv=self.backend_argv,
                start_sidecar=False,
                start_envoy=False,
                log_dir=self._dir("backend"),
            ).start()
            texts = [self.policy] * self.n if isinstance(self.policy, str) else self.policy
            for path, text in dict(zip(self.policy_paths, texts, strict=True)).items():
                text = text.replace("{backend}", self.backend.backend_url)
                path.write_text(text.replace("{redis}", self.redis.url))
            for i in range(self.n):
                stack = Stack(
                    backend_argv=[],
                    running_backends=[self.backend.backend_port],
                    policy_path=self.policy_paths[i],
                    log_dir=self._dir(f"gateway-{i}"),
                    envoy_patch=self.envoy_patch,
                    sidecar_args=self.sidecar_args,
                )
                self.stacks.append(stack)
                stack.start()
        except BaseException:
            self.dump_logs()
            self.stop()
            raise
        return self

    def _dir(self, name: str) -> Path:
        path = self.log_dir / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def stop(self) -> None:
        for stack in self.stacks:
            stack.stop()
        if self.backend is not None:
            self.backend.stop()
        self.redis.stop()

    def dump_logs(self, tail: int = 4000) -> None:
        for stack in [*self.stacks, *([self.backend] if self.backend else [])]:
            stack.dump_logs(tail)
        if self.redis.proc is not None:
            print(f"----- redis -----\n{self.redis.proc.log_text()[-tail:]}", file=sys.stderr)

    def __enter__(self) -> Gateways:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.dump_logs()
        self.stop()


def sim_stats(backend_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{backend_url}/sim/stats", timeout=2) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


class Sampler:
    """The simulator's requests in flight (running + waiting), every ``every_s``, from a
    thread: ``max`` since the start, or since ``reset``; ``samples`` (time, count)."""

    def __init__(self, backend_url: str, every_s: float = 0.01) -> None:
        self.backend_url = backend_url
        self.every_s = every_s
        self.max = 0
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                s = sim_stats(self.backend_url)
            except OSError:
                self._stop.wait(self.every_s)
                continue
            n = int(s["num_requests_running"]) + int(s["num_requests_waiting"])
            self.samples.append((time.monotonic(), n))
            self.max = max(self.max, n)
            self._stop.wait(self.every_s)

    def reset(self) -> None:
        self.max = 0

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
