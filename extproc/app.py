"""Assembly: one policy, one gate, one metrics registry, one gRPC server.

``Sidecar`` wires the stages together and owns the listeners. Everything runs on one asyncio
event loop in one process, which is what keeps admission exact: the gate's state is touched by
one thread only.

Two gRPC transports run the same servicer: ``h2`` (default; ``extproc.transport.h2``, HTTP/2
framing on the event loop's own sockets) and ``grpc`` (grpc.aio). Both serve ext_proc and the
standard ``grpc.health.v1`` service on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc.config.policy import Policy, load_policy, policy_from_yaml
from extproc.contract import EXT_PROC_SERVICE, PROCESS_METHOD
from extproc.ops.metrics import Metrics, serve_metrics
from extproc.pool.control import PoolControl
from extproc.pool.gate import Gate
from extproc.request import respond
from extproc.service import ExtProcService
from extproc.transport import h2
from extproc.transport.health import H2Health

__all__ = ["TRANSPORTS", "Sidecar", "TlsFiles", "default_policy", "split_host_port"]

TRANSPORTS = ("h2", "grpc")

log = logging.getLogger("extproc")

# Envoy buffers the whole request body and sends it in one gRPC message: allow large ones.
# Envoy's own buffer limit (413 before we see the body) is the real bound on body size.
# grpc.aio (--transport grpc, kept for comparison) takes this fixed limit; the h2 transport
# sizes its windows and buffers from the policy instead (_start_h2, docs/transport.md): the
# largest body Envoy forwards plus room for the ProcessingRequest around it, at least 8 MiB.
MAX_GRPC_MESSAGE = 64 * 1024 * 1024
H2_MIN_MESSAGE = 8 * 1024 * 1024
H2_MESSAGE_MARGIN = 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsFiles:
    """PEM files for the gRPC listener: TLS with cert+key; mutual TLS when client_ca is set
    (clients, i.e. Envoy, must then present a certificate signed by it)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.client_ca.read_bytes() if self.client_ca else None,
            require_client_auth=self.client_ca is not None,
        )

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        if self.client_ca is not None:
            ctx.load_verify_locations(self.client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.set_alpn_protocols(["h2"])
        return ctx


def default_policy() -> Policy:
    text = resources.files("extproc.config").joinpath("default_policy.yaml").read_text("utf-8")
    return policy_from_yaml(text, "<embedded default policy>")


def split_host_port(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _grpc_handler(service: ExtProcService) -> grpc.GenericRpcHandler:
    """grpc.aio: the Process method, registered so that pre-encoded answers (bytes from
    ``request.respond``) and messages can both be written to the stream."""
    return grpc.method_handlers_generic_handler(
        EXT_PROC_SERVICE,
        {
            "Process": grpc.stream_stream_rpc_method_handler(
                service.Process,
                request_deserializer=ext_pb.ProcessingRequest.FromString,
                response_serializer=respond.serialize,
            )
        },
    )


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
        transport: str = "h2",
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
        self.transport = transport
        self.tls = tls
        self.policy = policy
        self.policy_path = Path(policy_path) if policy_path is not None else None
        self.watch_interval_s = watch_interval_s
        self._watch_task: asyncio.Task[None] | None = None
        self.service: ExtProcService | None = None
        self.listen = listen
        self.metrics_listen = metrics_listen
        self.grpc_port: int | None = None
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | h2.H2Server | None = None
        self._metrics_server: asyncio.Server | None = None
        self._health: health.aio.HealthServicer | H2Health = (
            H2Health() if transport == "h2" else health.aio.HealthServicer()
        )
        self.gate: Gate | None = None
        self.metrics: Metrics | None = None
        self.control: PoolControl | None = None

    async def start(self) -> None:
        self.gate = gate = Gate(self.policy)
        self.metrics = metrics = Metrics(gate.statistics, lambda: control.gauges())
        self.service = ExtProcService(self.policy, gate, metrics)
        self.control = control = PoolControl(gate, metrics)
        control.apply(self.policy)
        control.start()
        if self.transport == "h2":
            self._server = await self._start_h2()
        else:
            self._server = await self._start_grpc()
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._health.set(EXT_PROC_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        if self.metrics_listen:
            host, mport = split_host_port(self.metrics_listen)
            self._metrics_server = await serve_metrics(host, mport, metrics, self.debug_queues)
            self.metrics_port = self._metrics_server.sockets[0].getsockname()[1]
        if self.policy_path is not None and self.watch_interval_s > 0:
            self._watch_task = asyncio.ensure_future(self._watch())
        log.info(
            "serving ext_proc on %s (%s), metrics on %s; mode %s; buckets: %s",
            self.listen,
            self.transport,
            self.metrics_listen or "-",
            self.policy.mode,
            gate,
        )

    async def _start_h2(self) -> h2.H2Server:
        assert self.service is not None and isinstance(self._health, H2Health)
        service = self.service

        def process(call: h2.Call) -> Any:
            return service.Process(None, call)

        parse = ext_pb.ProcessingRequest.FromString
        methods = {PROCESS_METHOD: h2.Method(process, parse, respond.serialize)}
        methods.update(self._health.methods())
        from extproc.config.envoy import body_buffer_bytes, extproc_streams

        # Both from the policy: Envoy refuses bodies above body_buffer_bytes itself, and its
        # circuit breakers let at most extproc_streams streams open.
        server = h2.H2Server(
            methods,
            max_message=max(H2_MIN_MESSAGE, body_buffer_bytes(self.policy) + H2_MESSAGE_MARGIN),
            max_streams=extproc_streams(self.policy),
        )
        ctx = self.tls.ssl_context() if self.tls is not None else None
        if self.listen.startswith("unix:"):
            path = self.listen.removeprefix("unix:")
            await server.listen_unix(path.removeprefix("//"), ctx)
        else:
            host, port = split_host_port(self.listen)
            self.grpc_port = await server.listen(host, port, ctx)
        return server

    async def _start_grpc(self) -> grpc.aio.Server:
        assert self.service is not None and isinstance(self._health, health.aio.HealthServicer)
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE),
                ("grpc.max_send_message_length", MAX_GRPC_MESSAGE),
                # Fail loudly if the port is taken instead of sharing it.
                ("grpc.so_reuseport", 0),
            ]
        )
        server.add_generic_rpc_handlers((_grpc_handler(self.service),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        if self.tls is not None:
            port = server.add_secure_port(self.listen, self.tls.server_credentials())
        else:
            port = server.add_insecure_port(self.listen)
        if not self.listen.startswith("unix:"):
            if port == 0:
                raise OSError(f"cannot listen on {self.listen}")
            self.grpc_port = port
        await server.start()
        return server

    # --- policy reload -------------------------------------------------------------------------

    def reload(self) -> bool:
        """Re-read the policy file and switch to it atomically; on any error keep the old
        policy. Called on SIGHUP and when the file changes."""
        assert self.service is not None and self.metrics is not None
        if self.policy_path is None:
            log.warning("reload asked, but the sidecar runs on the embedded policy")
            return False
        try:
            policy = load_policy(self.policy_path)
            self.service.apply_policy(policy)
            if self.control is not None:
                self.control.apply(policy)
        except Exception as e:  # PolicyError, or a tokenizer that does not load
            self.metrics.policy_reloads.labels("error").inc()
            log.error("policy reload refused, keeping the current policy: %s", e)
            return False
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
        """Poll the policy file (an atomic `mv` over it changes its inode; an edit in place
        its mtime or size). Polling needs no extra dependency and sees Kubernetes ConfigMap
        symlink swaps too."""
        last = self._file_state()
        while True:
            await asyncio.sleep(self.watch_interval_s)
            now = self._file_state()
            if now is not None and now != last:
                self.reload()
            last = now

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

    async def stop(self, grace: float | None = 5.0) -> None:
        """Graceful stop: health says NOT_SERVING, queued and new requests get 503 with
        Retry-After, admitted requests may finish for up to ``grace`` seconds, then the server
        closes (cancelling whatever is left)."""
        if self._watch_task is not None:
            self._watch_task.cancel()
        if self.control is not None:
            await self.control.stop()
        await self._health.enter_graceful_shutdown()
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
        if self._server is not None:
            # Answers already written are flushed; streams still open are cancelled.
            await self._server.stop(0.5)
        if self.service is not None:
            self.service.close()

    async def wait(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()
