"""The simulator held to the real engine (issue 32, item 2): pages a real vLLM 0.32 (its CPU
build, tests/bench/fixtures/vllm-0.32.0-cpu/README.md says how they were captured) served are
checked in; the simulator must expose the families the sidecar reads under the same sample
names, label names and bucket edges, expose no ``vllm:`` family the real engine does not (but
the named exceptions), and frame its answers as the real engine does (SSE ``data:`` events, a
usage chunk with no choices, ``data: [DONE]``; the keys clients and the sidecar's tests read).
A vLLM release that renames a family fails here once its pages are captured anew."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from bench.sim.api import Render, token_usage
from bench.sim.engine import SimEngine
from bench.sim.metrics import make_registry
from bench.sim.profiles import EngineConfig

REAL = Path(__file__).parent / "fixtures" / "vllm-0.32.0-cpu"
# What the sidecar reads (extproc/backend/vllm.py): the gauges, and the histograms' buckets.
READ = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket",
)
# The simulator's families that vLLM 0.32 no longer has, and why it keeps them.
SIM_ONLY = {
    # The inter-token histogram's name before vLLM 0.9, which the sidecar still reads when the
    # new one is missing: the simulator serves both so that path is exercised.
    "vllm:time_per_output_token_seconds",
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? \S+$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class Page:
    """A Prometheus text page by sample name: the label names seen, and the ``le`` edges."""

    def __init__(self, text: str) -> None:
        self.labels: dict[str, set[frozenset[str]]] = defaultdict(set)
        self.edges: dict[str, list[str]] = defaultdict(list)
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = _SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            name, labels = m.group(1), dict(_LABEL.findall(m.group(2) or ""))
            le = labels.pop("le", None)
            self.labels[name].add(frozenset(labels))
            if le is not None and le not in self.edges[name]:
                self.edges[name].append(le)

    def family(self, sample: str) -> str:
        return re.sub(r"_(bucket|sum|count|total|created)$", "", sample)


def real_page() -> Page:
    return Page((REAL / "metrics.txt").read_text())


def sim_page() -> Page:
    engine = SimEngine(EngineConfig())
    registry = make_registry(engine, "m")
    # Some observations, so that every histogram has its buckets on the page.
    for hist in (engine.ttft_hist, engine.e2e_hist, engine.queue_hist, engine.tpot_hist):
        hist.observe(0.05)
    engine.itl_hist.observe(0.05)
    return Page(generate_latest(registry).decode())


@pytest.mark.parametrize("sample", READ)
def test_every_family_the_sidecar_reads_is_on_both_pages_alike(sample: str) -> None:
    real, sim = real_page(), sim_page()
    assert sample in real.labels, f"vLLM 0.32 has no {sample}: the sidecar reads it"
    assert sample in sim.labels, f"the simulator has no {sample}"
    assert sim.labels[sample] == real.labels[sample], sample  # model_name, engine
    assert [float(e) for e in sim.edges[sample]] == [float(e) for e in real.edges[sample]], sample


def test_the_simulator_has_no_family_the_engine_does_not() -> None:
    real, sim = real_page(), sim_page()
    real_families = {real.family(s) for s in real.labels}
    for sample, labels in sim.labels.items():
        if not sample.startswith("vllm:") or sim.family(sample) in SIM_ONLY:
            continue
        assert sample in real.labels or sim.family(sample) in real_families, sample
        if sample in real.labels:
            assert labels <= real.labels[sample] | {frozenset()}, sample
            if sample.endswith("_bucket"):
                assert [float(e) for e in sim.edges[sample]] == [
                    float(e) for e in real.edges[sample]
                ], sample
    assert not SIM_ONLY & real_families, "vLLM has it again: drop it from SIM_ONLY"


def events(raw: bytes) -> list[str]:
    """The data of each SSE event: every event is ``data: ...`` and a blank line."""
    text = raw.decode()
    assert text.endswith("\n\n")
    blocks = text[:-2].split("\n\n")
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), blocks
    return [b.removeprefix("data: ") for b in blocks]


@pytest.mark.parametrize(
    ("chat", "real_file"), [(True, "chat_stream.txt"), (False, "completions_stream.txt")]
)
def test_streams_are_framed_as_the_engine_frames_them(chat: bool, real_file: str) -> None:
    real = events((REAL / real_file).read_bytes())
    r = Render(chat=chat, model="m")
    chunks = [r.role_chunk()] if chat else []
    chunks += [r.token_chunk(), r.token_chunk("length")]
    if chat:
        chunks.append(r.usage_chunk(token_usage(3, 2)))
    sim = events(b"".join(chunks) + b"data: [DONE]\n\n")
    assert real[-1] == sim[-1] == "[DONE]"
    real_chunks = [json.loads(e) for e in real[:-1]]
    sim_chunks = [json.loads(e) for e in sim[:-1]]
    assert {c["object"] for c in sim_chunks} == {c["object"] for c in real_chunks}
    for sim_chunk in sim_chunks:
        like = next(c for c in real_chunks if bool(c["choices"]) == bool(sim_chunk["choices"]))
        assert set(sim_chunk) <= set(like), (sim_chunk, like)
        for choice in sim_chunk["choices"]:
            assert set(choice) <= set(like["choices"][0]) | {"stop_reason"}, (choice, like)
    if chat:  # the usage chunk: no choices, the usage keys
        (real_usage,) = [c for c in real_chunks if not c["choices"]]
        (sim_usage,) = [c for c in sim_chunks if not c["choices"]]
        assert set(sim_usage["usage"]) == set(real_usage["usage"])


@pytest.mark.parametrize(("chat", "real_file"), [(True, "chat.json"), (False, "completions.json")])
def test_whole_answers_carry_the_keys_of_the_engines(chat: bool, real_file: str) -> None:
    real: dict[str, Any] = json.loads((REAL / real_file).read_text())
    sim = Render(chat=chat, model="m").full_response(3, token_usage(2, 3))
    assert sim["object"] == real["object"]
    assert set(sim) <= set(real)
    assert set(sim["choices"][0]) <= set(real["choices"][0])
    assert {"prompt_tokens", "completion_tokens", "total_tokens"} <= set(sim["usage"])


# What the captured pages say about vLLM 0.32 that the sidecar relies on (docs/vllm.md).


def fixture(name: str) -> dict[str, Any]:
    return json.loads((REAL / name).read_text())  # type: ignore[no-any-return]


def test_a_batch_of_prompts_is_prompts_times_n_sequences() -> None:
    """``prompt: [2 prompts], n: 2, max_tokens: 3``: 4 choices, 12 tokens; and vLLM counts each
    prompt as its own request (``vllm:request_params_n`` has 2 observations at n=2): the
    sidecar's ``sequences`` (tests/unit/test_sequences.py)."""
    answer = fixture("completions.json")
    assert len(answer["choices"]) == 4 and answer["usage"]["completion_tokens"] == 4 * 3
    page = (REAL / "metrics.txt").read_text()
    at = {
        le: float(v)
        for le, v in re.findall(
            r'vllm:request_params_n_bucket\{[^}]*le="([^"]+)"[^}]*\} (\S+)', page
        )
    }
    assert at["2.0"] - at["1.0"] == 2


def test_the_other_apis_honour_their_own_output_bounds() -> None:
    """The keys the sidecar rewrites: ``max_output_tokens`` on the Responses API,
    ``max_tokens`` on Anthropic's Messages (tests/unit/test_apis.py)."""
    responses = fixture("responses.json")  # asked max_output_tokens: 5
    assert responses["usage"]["output_tokens"] <= 5
    assert responses["incomplete_details"] == {"reason": "max_output_tokens"}
    messages = fixture("messages.json")  # asked max_tokens: 5
    assert messages["usage"]["output_tokens"] == 5 and messages["stop_reason"] == "max_tokens"
    assert fixture("chat.json")["usage"]["completion_tokens"] == 8  # max_tokens 8, ignore_eos


def test_the_engines_own_admission_counter_has_no_engine_label() -> None:
    """``vllm:admission_rejections_total`` is labelled ``model_name`` and ``reason``
    (``max_num_queued_reqs``, ``max_num_queued_tokens``), not ``engine`` like the others."""
    page = real_page()
    assert page.labels["vllm:admission_rejections_total"] == {frozenset({"model_name", "reason"})}
