"""Tier 2: which answers the adaptive limit's ``slo.abandoned`` judges, through the service.

An answer that ends past its deadline is abandoned and counted
(``llm_extproc_abandoned_total``) whatever set the deadline. The share the limit follows
(``Gate.ends``) leaves out the answers whose deadline was the client's own and sooner than
its bucket's queue timeout (an ``x-stainless-timeout`` shorter than the policy lets anyone
wait): a client's impatience of its own choosing does not cut the limit for everyone."""

from __future__ import annotations

import asyncio

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.app import Sidecar
from extproc.config.policy import policy_from_yaml
from tests.service.test_service import CHAT, Exchange, body_msg, headers_msg

# The default margin (0.5 s) is more than the client states below: its deadline has passed
# by the time its headers are read, so its answer ends past it without the test waiting.
POLICY = policy_from_yaml(
    """
limits: {max_prompt_tokens: 100, default_max_tokens: 16, max_output_tokens: 32}
client_deadline: {margin: 500ms}
buckets:
  - {name: solo, max_concurrency: 4, queue_timeout: 30s, max_queue: 1}
"""
)


def abandoned_total(sidecar: Sidecar) -> float:
    assert sidecar.metrics is not None
    return sum(
        s.value
        for m in sidecar.metrics.abandoned.collect()
        for s in m.samples
        if s.name.endswith("_total")
    )


async def admitted_then_ended(stub: pb_grpc.ExternalProcessorStub, **headers: str) -> None:
    """One request with ``headers``, admitted, and its stream ended."""
    ex = Exchange(stub)
    await ex.send(headers_msg(content_type="application/json", **headers))
    await ex.recv()
    await ex.send(body_msg(CHAT))
    resp = await ex.recv()
    assert resp.request_body.response.body_mutation.body  # admitted
    await ex.close()


def test_a_clients_own_short_timeout_is_counted_but_does_not_drive_the_limit() -> None:
    async def main() -> None:
        sidecar = Sidecar(POLICY, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")
        await sidecar.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as ch:
                stub = pb_grpc.ExternalProcessorStub(ch)
                await admitted_then_ended(stub, x_stainless_timeout="0.1")
            assert sidecar.gate is not None
            now = asyncio.get_running_loop().time()
            assert abandoned_total(sidecar) == 1.0  # counted: its client had left
            assert sidecar.gate.ends.count(now, 60.0) == (0, 0.0)  # not the limit's to judge
        finally:
            await sidecar.stop(0)

    asyncio.run(asyncio.wait_for(main(), 10))
