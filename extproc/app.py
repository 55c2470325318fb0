"""Assembly: one policy, one gate, one metrics registry, one gRPC server.

``Sidecar`` wires the stages together and owns the listeners. Everything runs on one asyncio
event loop in one process, which is what keeps admission exact: the gate's state is touched by
one thread only.

The gRPC server is an ``extproc.transport.Transport`` that serves ext_proc and the standard
``grpc.health.v1`` service on one port: ``Sidecar``'s ``transport`` builds it, by default the h2
transport (``extproc.transport.h2_transport``, HTTP/2 framing on the event loop's own sockets).
Tests pass another, grpc.aio, as an oracle (``testing.grpc_aio``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from grpc_health.v1 import health_pb2

from extproc.config.policy import Policy, load_policy, policy_from_yaml
from extproc.contract import EXT_PROC_SERVICE
from extproc.loops import Guard
from extproc.ops.metrics import Metrics, serve_metrics
from extproc.pool.control.wiring import PoolControl
from extproc.pool.gate import Gate
from extproc.service import ExtProcService
from extproc.transport import Serving, TlsFiles, Transport, split_host_port
from extproc.transport.h2_transport import H2Transport

__all__ = [
    "ListenError",
    "Sidecar",
    "TlsFiles",
    "default_policy",
    "split_host_port",
]

log = logging.getLogger("extproc")


class ListenError(Exception):
    """A listener of the sidecar could not be opened (the port is taken, the host unknown):
    ``listener`` is ``listen`` (ext_proc's gRPC address) or ``metrics`` (metrics and probes).
    ``Sidecar.start`` raises it after stopping what it had started."""

    def __init__(self, listener: str, address: str, cause: OSError) -> None:
        # The errno's own words ("Address already in use"); a resolver error has no errno.
        errno = cause.errno or 0
        reason = os.strerror(errno) if errno > 0 else cause.strerror
        super().__init__(f"cannot listen on {address}: {reason or cause}")
        self.listener = listener


def _event_loop_name() -> str:
    """The running event loop's kind, for llm_extproc_build_info: uvloop or asyncio."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"


def default_policy() -> Policy:
    text = resources.files("extproc.config").joinpath("default_policy.yaml").read_text("utf-8")
    return policy_from_yaml(text, "<embedded default policy>")


class Sidecar:
    def __init__(
        self,
        policy: Policy,
        *,
        listen: str = "127.0.0.1:50051",
        metrics_listen: str | None = "127.0.0.1:9464",
        policy_path: str | Path | None = None,
        watch_interval_s: float = 1.0,
        tls: TlsFiles | None = None,
        transport: Callable[[], Transport] = H2Transport,
        transport_name: str = "h2",
    ) -> None:
        # ``transport`` builds the gRPC server; ``transport_name`` names it in
        # llm_extproc_build_info and the start log.
        self.transport = transport_name
        self._transport: Transport = transport()
        self.tls = tls
        self.policy = policy
        self.policy_path = Path(policy_path) if policy_path is not None else None
        self.watch_interval_s = watch_interval_s
        self._watch_task: asyncio.Task[None] | None = None
        self._watched: tuple[int, int, int] | None = None  # the policy file as last seen
        self.service: ExtProcService | None = None
        self.listen = listen
        self.metrics_listen = metrics_listen
        self.grpc_port: int | None = None
        self.metrics_port: int | None = None
        self._metrics_server: asyncio.Server | None = None
        self.gate: Gate | None = None
        self.metrics: Metrics | None = None
        self.control: PoolControl | None = None
        # Ready (/readyz): from the moment the health service says SERVING until stop begins.
        self._serving = False

    def ready(self) -> bool:
        """Whether the sidecar serves ext_proc with its policy loaded: from the end of
        ``start`` (health SERVING) until ``stop`` begins (health turns NOT_SERVING in it)."""
        return self._serving

    async def start(self) -> None:
        self.gate = gate = Gate(self.policy)
        self.metrics = metrics = Metrics(
            gate.statistics,
            lambda: control.gauges(),
            self._heaviest,
            transport=self.transport,
            event_loop=_event_loop_name(),
        )
        self.service = ExtProcService(self.policy, gate, metrics)
        self.control = control = PoolControl(gate, metrics)
        control.apply(self.policy)
        control.start()
        # Both from the policy: Envoy refuses bodies above body_buffer_bytes itself, and its
        # circuit breakers let at most extproc_streams streams open.
        from extproc.config.envoy import body_buffer_bytes, extproc_streams

        serving = Serving(
            process=self.service.Process,
            listen=self.listen,
            tls=self.tls,
            body_limit=body_buffer_bytes(self.policy),
            max_streams=extproc_streams(self.policy),
        )
        try:
            self.grpc_port = await self._transport.start(serving)
        except OSError as e:
            await self.stop(0)
            raise ListenError("listen", self.listen, e) from e
        health = self._transport.health
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        await health.set(EXT_PROC_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self._serving = True
        if self.metrics_listen:
            host, mport = split_host_port(self.metrics_listen)
            try:
                self._metrics_server = await serve_metrics(
                    host, mport, metrics, self.debug_queues, self.ready
                )
            except OSError as e:
                await self.stop(0)
                raise ListenError("metrics", self.metrics_listen, e) from e
            self.metrics_port = self._metrics_server.sockets[0].getsockname()[1]
        if self.policy_path is not None and self.watch_interval_s > 0:
            self._watched = self._file_state()
            guard = Guard("policy-watch", log, lambda loop: metrics.loop_errors.labels(loop).inc())
            every = self.watch_interval_s
            self._watch_task = guard.start(self._watch, every, first_s=every)
        log.info(
            "serving ext_proc on %s (%s), metrics on %s; mode %s; buckets: %s",
            self.listen,
            self.transport,
            self.metrics_listen or "-",
            self.policy.mode,
            gate,
        )

    # --- policy reload -------------------------------------------------------------------------

    def reload(self) -> bool:
        """Re-read the policy file and switch to it atomically; on any error keep the old
        policy, untouched: everything the new one needs that can fail is built first (the
        pool's controllers, ``PoolControl.prepare``; the token counter, in
        ``ExtProcService.apply_policy``), then the switch happens, which cannot. Called on
        SIGHUP and when the file changes."""
        assert self.service is not None and self.metrics is not None
        if self.policy_path is None:
            log.warning("reload asked, but the sidecar runs on the embedded policy")
            return False
        control = self.control
        assert control is not None
        try:
            policy = load_policy(self.policy_path)
            prepared = control.prepare(policy)  # builds what it needs, changes nothing
            try:
                self.service.apply_policy(policy)
            except Exception:
                control.discard(prepared)
                raise
        except Exception as e:  # PolicyError, a tokenizer or a Redis URL that cannot be used
            self.metrics.policy_reloads.labels("error").inc()
            log.error("policy reload refused, keeping the current policy: %s", e)
            return False
        control.apply(prepared)
        self.policy = policy
        self.metrics.policy_reloads.labels("ok").inc()
        log.info("policy reloaded from %s; buckets: %s", self.policy_path, self.gate)
        return True

    def _file_state(self) -> tuple[int, int, int] | None:
        assert self.policy_path is not None
        try:
            st = self.policy_path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    async def _watch(self) -> None:
        """One look at the policy file, every ``watch_interval_s`` (an atomic `mv` over it
        changes its inode; an edit in place its mtime or size): one reload per change.
        Polling needs no extra dependency and sees Kubernetes ConfigMap symlink swaps too. A
        look that raises is the loop's guard's (``extproc.loops``)."""
        now, last = self._file_state(), self._watched
        self._watched = now
        if now is not None and now != last:
            self.reload()

    def debug_queues(self) -> dict[str, object]:
        """Each bucket, each live route share and the shared pool, as JSON."""
        assert self.gate is not None and self.service is not None
        out: dict[str, object] = {
            name: {
                "capacity": s.capacity,
                "in_flight": s.in_flight,
                "queued": s.queued,
                "max_queue": s.max_queue,
                "mean_hold_s": s.mean_hold_s,
                "queued_bytes": s.queued_bytes,
                **(
                    {"pool": s.pool, "priority": s.priority, "tokens_in_flight": s.tokens_in_flight}
                    if s.pool is not None
                    else {}
                ),
                **(
                    {"tenants": s.tenants, "heaviest": self.gate.heaviest(name)}
                    if s.tenants
                    else {}
                ),
            }
            for name, s in self.gate.statistics().items()
        }
        # Route shares are named "<bucket>/route-<n>" and the pool "/pool": never a bucket
        # name (no "/" allowed in those).
        for key, share in self.service.route_shares().items():
            out[key] = {**share, "route_share": True}
        pool = self.control.debug() if self.control is not None else None
        if pool is not None:
            out["/pool"] = {**pool, "pool": True}
        return out

    def _heaviest(self) -> dict[str, list[tuple[str | None, float]]]:
        """The buckets that export their heaviest tenants (tenant.export_top), and those."""
        gate = self.gate
        assert gate is not None
        return {
            b.name: gate.heaviest(b.name, b.tenant.export_top)
            for b in self.policy.buckets
            if b.tenant is not None and b.tenant.export_top
        }

    async def stop(self, grace: float | None = 5.0) -> None:
        """Graceful stop: health says NOT_SERVING, queued and new requests get 503 with
        Retry-After, admitted requests may finish for up to ``grace`` seconds, then the server
        closes (cancelling whatever is left). /readyz answers 503 from the first line."""
        self._serving = False
        watch, self._watch_task = self._watch_task, None
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        if self.control is not None:
            await self.control.stop()
        await self._transport.health.enter_graceful_shutdown()
        if self.service is not None:
            self.service.stop_admitting()
        if self.gate is not None:
            self.gate.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.gate.drained(), grace or 0.0)
        if self.control is not None:
            await self.control.close()  # a shared pool's leases go back
        if self._metrics_server is not None:
            self._metrics_server.close()
        # Answers already written are flushed; streams still open are cancelled.
        await self._transport.stop(0.5)
        if self.service is not None:
            self.service.close()

    async def wait(self) -> None:
        await self._transport.wait_for_termination()
