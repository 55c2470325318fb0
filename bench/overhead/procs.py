"""The processes of one run: Envoy with one listener per way, the naive server, the sidecar,
the shared-pool sidecar and its redis-server (``testing.redis.RedisServer``), and the held-queue
sidecar, all on free ports of 127.0.0.1, started and stopped by ``testing.stack.Proc``."""

from __future__ import annotations

import contextlib
import sys
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import redis

from bench.overhead.ways import (
    CHAT_PATH,
    HELD,
    NAIVE,
    REDIS,
    SIDECAR,
    SIDECAR_POLICY,
    SIDECAR_SHARED,
    Ports,
    envoy_config,
    held_policy,
    shared_policy,
)
from testing.redis import RedisServer
from testing.stack import Proc, envoy_binary, wait_http, wait_tcp

__all__ = ["Bench", "script_calls"]

# The sidecars, in the order they are started and waited for.
_SIDECARS = (SIDECAR, SIDECAR_SHARED, HELD)


def script_calls(commandstats: Mapping[str, Any]) -> int:
    """Lua script calls (EVAL, EVALSHA and their read-only forms) in Redis's ``INFO
    commandstats``, as redis-py parses it (``{"cmdstat_evalsha": {"calls": 12, ...}}``): one
    per round trip of the lease manager (``extproc.pool.shared.scripts``)."""
    total = 0
    for name, stats in commandstats.items():
        command = name.removeprefix("cmdstat_")
        if command in ("eval", "evalsha", "eval_ro", "evalsha_ro") and isinstance(stats, Mapping):
            total += int(stats.get("calls", 0))
    return total


class Bench:
    """Envoy with five listeners, the naive server, the two sidecars of the ways (the second
    with its redis-server) and the held-queue sidecar. A context manager: everything is
    stopped on exit (logs printed to stderr when the block raised)."""

    def __init__(self, log_dir: Path, held_max_queue: int) -> None:
        self.log_dir = log_dir
        self.ports = Ports.pick()
        self.held_max_queue = held_max_queue
        self.procs: dict[str, Proc] = {}
        self.redis = RedisServer(log_dir)

    def url(self, listener: str) -> str:
        return f"http://127.0.0.1:{self.ports.listeners[listener]}{CHAT_PATH}"

    def pid(self, name: str) -> int:
        return self.procs[name].popen.pid

    def metrics_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports.metrics[name]}/metrics"

    def redis_script_calls(self) -> int:
        """Script calls the redis-server has served so far (:func:`script_calls`)."""
        client = redis.Redis.from_url(self.redis.url)
        try:
            return script_calls(client.info("commandstats"))
        finally:
            client.close()

    def start(self) -> None:
        py = sys.executable
        p = self.ports
        self.redis.start()
        assert self.redis.proc is not None
        self.procs[REDIS] = self.redis.proc
        naive = self.procs[NAIVE] = Proc(
            NAIVE,
            [
                py,
                "-m",
                "bench.overhead.naive",
                "--listen",
                f"127.0.0.1:{p.grpc[NAIVE]}",
            ],
            self.log_dir,
        )
        for name, text in (
            (SIDECAR, SIDECAR_POLICY),
            (SIDECAR_SHARED, shared_policy(self.redis.url)),
            (HELD, held_policy(self.held_max_queue)),
        ):
            policy = self.log_dir / f"{name}-policy.yaml"
            policy.write_text(text)
            self.procs[name] = Proc(
                name,
                [
                    py,
                    "-m",
                    "extproc",
                    "serve",
                    "--policy",
                    str(policy),
                    "--listen",
                    f"127.0.0.1:{p.grpc[name]}",
                    "--metrics",
                    f"127.0.0.1:{p.metrics[name]}",
                ],
                self.log_dir,
            )
        wait_tcp(p.grpc[NAIVE], proc=naive)
        for name in _SIDECARS:
            wait_http(self.metrics_url(name), proc=self.procs[name])
            wait_tcp(p.grpc[name], proc=self.procs[name])
        cfg = self.log_dir / "envoy.yaml"
        cfg.write_text(envoy_config(p))
        envoy = self.procs["envoy"] = Proc(
            "envoy",
            [
                envoy_binary(),
                "-c",
                str(cfg),
                "--concurrency",
                "1",
                "--disable-hot-restart",
                "--log-level",
                "warning",
            ],
            self.log_dir,
        )
        wait_http(f"http://127.0.0.1:{p.admin}/ready", proc=envoy)

    def stop(self) -> None:
        for name in ("envoy", *_SIDECARS, NAIVE):
            proc = self.procs.get(name)
            if proc is not None:
                proc.stop()
        # After the sidecars: the shared one gives its leases back on the way out.
        self.redis.stop()

    def check_alive(self) -> None:
        for proc in self.procs.values():
            proc.check_alive()

    def dump_logs(self, tail: int = 4000) -> None:
        for name, proc in self.procs.items():
            print(
                f"----- {name} log ({proc.log_path}) -----\n{proc.log_text()[-tail:]}",
                file=sys.stderr,
            )

    def envoy_stats(self, prefix: str) -> dict[str, int]:
        """Envoy's counters and gauges whose name starts with ``prefix`` (histograms, which
        are not integers, are left out)."""
        url = f"http://127.0.0.1:{self.ports.admin}/stats?filter=^{prefix}"
        out: dict[str, int] = {}
        with urllib.request.urlopen(url, timeout=5) as r:
            for line in r.read().decode().splitlines():
                key, _, value = line.partition(": ")
                with contextlib.suppress(ValueError):
                    out[key] = int(value)
        return out

    def scrape(self, name: str) -> dict[str, float]:
        """A sidecar's metrics as {'name{labels}': value}."""
        with urllib.request.urlopen(self.metrics_url(name), timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def __enter__(self) -> Bench:
        try:
            self.start()
        except BaseException:
            self.dump_logs()
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None and exc[0] is not KeyboardInterrupt:
            self.dump_logs()
        self.stop()
