"""TLS and mutual TLS on the sidecar's gRPC listener, with certificates made here by openssl:
in-process with a gRPC client, and end to end with the real Envoy as the TLS client."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.app import Sidecar, TlsFiles, default_policy
from testing.harness import make_certs, running_stack


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_certs(tmp_path_factory.mktemp("certs"))


def check(port: int, creds: grpc.ChannelCredentials) -> int:
    async def main() -> int:
        async with grpc.aio.secure_channel(
            f"127.0.0.1:{port}", creds, options=[("grpc.ssl_target_name_override", "llm-extproc")]
        ) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            return int(resp.status)

    return asyncio.run(main())


def test_mutual_tls_requires_a_client_certificate(certs: dict[str, Path]) -> None:
    async def main() -> None:
        sidecar = Sidecar(
            default_policy(),
            listen="127.0.0.1:0",
            metrics_listen=None,
            tls=TlsFiles(
                cert=certs["server.pem"], key=certs["server.key"], client_ca=certs["ca.pem"]
            ),
        )
        await sidecar.start()
        try:
            port = sidecar.grpc_port
            assert port is not None
            ca = certs["ca.pem"].read_bytes()
            good = grpc.ssl_channel_credentials(
                ca, certs["client.key"].read_bytes(), certs["client.pem"].read_bytes()
            )
            no_client_cert = grpc.ssl_channel_credentials(ca)
            serving = int(health_pb2.HealthCheckResponse.SERVING)
            assert await asyncio.to_thread(check, port, good) == serving
            with pytest.raises(grpc.aio.AioRpcError):
                await asyncio.to_thread(check, port, no_client_cert)
        finally:
            await sidecar.stop(0)

    asyncio.run(main())


def test_envoy_talks_to_the_sidecar_over_mutual_tls(tmp_path: Path, certs: dict[str, Path]) -> None:
    with running_stack(tmp_path, None, tls=certs) as stack:
        req = urllib.request.Request(
            stack.url + "/v1/chat/completions",
            data=json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
            headers={"content-type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            body = json.loads(r.read())
        assert json.loads(body["echo"]["body"])["max_tokens"] == 256  # admitted by the sidecar
        assert body["echo"]["headers"]["x-llm-bucket"] == "batch"
        assert stack.envoy_stat("cluster.llm_extproc.ssl.handshake") >= 1
