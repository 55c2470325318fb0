"""The token bound counts every output sequence (issue 31), through the real Envoy: a batched
``/v1/completions`` of 50 prompts at ``max_tokens: 200`` (10,000 output tokens) runs alone
under ``max_tokens_in_flight: 4096``, and an ordinary request waits for it instead of running
beside it, as it did while a request's cost counted one sequence. The pure side:
tests/unit/test_sequences.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from testing.clients import chat, post, slow_stream
from testing.harness import scrape, start_stack, until_in_flight, until_queued, wait_idle
from testing.stack import Stack
from tests.e2e.test_e2e import run

POLICY = """
pool: {max_concurrency: 8, max_tokens_in_flight: 4096}
limits: {max_output_tokens: 1000, max_sequences: 64}
buckets:
  - name: all
    queue_timeout: 60s
    max_queue: 10
"""


@pytest.fixture(scope="module")
def stack(module_tmp: Path) -> Iterator[Stack]:
    yield from start_stack(module_tmp / "sequences", POLICY)


def tokens_in_flight(stack: Stack) -> float:
    (value,) = [v for (name, _), v in scrape(stack).items() if name.endswith("tokens_in_flight")]
    return value


def test_a_batch_of_prompts_holds_the_token_bound_for_all_its_outputs(stack: Stack) -> None:
    batch = json.dumps({"prompt": ["hi"] * 50, "max_tokens": 200, "stream": True}).encode()

    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            holder = asyncio.ensure_future(
                post(s, f"{stack.url}/v1/completions", batch, slow_stream(20, 100), limit_s=60)
            )
            await until_in_flight(stack, "all", 1)
            assert tokens_in_flight(stack) >= 50 * 200
            # 1 of 8 slots taken, but the token bound is spent: the next one waits.
            ordinary = asyncio.ensure_future(post(s, f"{stack.url}/v1/chat/completions", chat()))
            await until_queued(stack, "all", 1)
            assert (await holder).status == 200
            answer = await ordinary
            assert answer.status == 200 and int(answer.echo["headers"]["x-llm-queue-ms"]) > 0

    run(main())
    wait_idle(stack)
