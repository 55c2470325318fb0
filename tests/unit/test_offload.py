"""Large bodies are parsed in a worker process: the same answers as on the loop, bounded."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from extproc.config.policy import policy_from_yaml
from extproc.outcome import RequestError
from extproc.request.classify import token_counter
from extproc.request.offload import INLINE_BODY_BYTES, Busy, Offload, parse_and_classify
from extproc.request.parse import Endpoint
from testing.wait import until_async

POLICY = policy_from_yaml(
    """
limits: {max_prompt_tokens: 100000, default_max_tokens: 16, max_output_tokens: 32}
buckets:
  - name: small
    match: {max_prompt_tokens: 1000}
    max_concurrency: 1
    queue_timeout: 1s
    max_queue: 1
  - {name: big, max_concurrency: 1, queue_timeout: 1s, max_queue: 1}
"""
)
COUNT = token_counter(POLICY.tokens)
LONG = "x" * (INLINE_BODY_BYTES * 2)


def chat(content: str, **extra: object) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], **extra}).encode()


BODIES = [
    chat(LONG),
    chat(LONG, max_tokens=500),  # clamped: a rewritten body comes back from the worker
    chat(LONG, stream=True, max_tokens=8),
    json.dumps({"prompt": [LONG, LONG]}).encode(),
]
BAD = [
    (chat(LONG)[:-1], 400, "invalid_json"),
    (chat("y" * 500_000), 413, "prompt_too_long"),
    (b'{"messages": [], "pad": "' + b"z" * INLINE_BODY_BYTES + b'"}', 400, "invalid_value"),
]


def run(coro: object) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))  # type: ignore[arg-type]


def endpoint(body: bytes) -> Endpoint:
    return Endpoint.COMPLETIONS if b'"prompt"' in body else Endpoint.CHAT


def test_the_worker_answers_exactly_as_the_loop_does() -> None:
    async def main() -> None:
        offload = Offload()
        try:
            for body in BODIES:
                here = parse_and_classify(POLICY, COUNT, {}, endpoint(body), body, None)
                there = await offload.parse(POLICY, COUNT, {}, endpoint(body), body, None)
                assert there == here
                assert there.classification.new_body == here.classification.new_body
            for body, status, code in BAD:
                with pytest.raises(RequestError) as e:
                    await offload.parse(POLICY, COUNT, {}, Endpoint.CHAT, body, None)
                assert (e.value.status, e.value.code) == (status, code)
            assert offload.pending == 0
        finally:
            offload.close()

    run(main())


def test_beyond_the_bound_large_bodies_are_refused_at_once() -> None:
    async def main() -> None:
        offload = Offload(max_pending=2)
        try:
            body = BODIES[0]
            jobs = [
                asyncio.ensure_future(offload.parse(POLICY, COUNT, {}, Endpoint.CHAT, body, None))
                for _ in range(2)
            ]
            await asyncio.sleep(0)  # one loop turn: both tasks submit, then await the worker
            assert offload.pending == 2
            with pytest.raises(Busy):
                await offload.parse(POLICY, COUNT, {}, Endpoint.CHAT, body, None)
            await asyncio.gather(*jobs)
            # The count comes down on the loop, after the job.
            await until_async(lambda: offload.pending == 0, "both counted down")
            # A cancelled waiter still counts until the worker is done with its job.
            job = asyncio.ensure_future(offload.parse(POLICY, COUNT, {}, Endpoint.CHAT, body, None))
            await asyncio.sleep(0)  # one loop turn: submitted, awaiting the worker
            assert offload.pending == 1
            job.cancel()
            await until_async(lambda: offload.pending == 0, "the cancelled job counted down")
        finally:
            offload.close()

    run(main())


def test_a_dead_worker_means_the_body_is_parsed_on_the_loop_and_a_new_one_starts() -> None:
    async def main() -> None:
        offload = Offload()
        try:
            body = BODIES[1]
            expected = parse_and_classify(POLICY, COUNT, {}, Endpoint.CHAT, body, None)
            assert await offload.parse(POLICY, COUNT, {}, Endpoint.CHAT, body, None) == expected
            assert offload._pool is not None
            for pid in list(offload._pool._processes):  # type: ignore[attr-defined]
                os.kill(pid, signal.SIGKILL)
            pool = offload._pool
            await until_async(lambda: pool._broken, "the executor saw its worker die")  # type: ignore[attr-defined]
            assert await offload.parse(POLICY, COUNT, {}, Endpoint.CHAT, body, None) == expected
            assert await offload.parse(POLICY, COUNT, {}, Endpoint.CHAT, body, None) == expected
            assert offload.pending == 0
        finally:
            offload.close()

    run(main())
