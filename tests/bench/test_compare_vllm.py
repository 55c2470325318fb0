"""``python -m bench.compare --backend vllm-cpu``: its options and workload, pure (the run itself
needs the engine and a quarter of an hour: docs/benchmarks.md, "The real engine on a CPU")."""

from __future__ import annotations

import pytest
import yaml

from bench.compare.__main__ import parse_args
from bench.compare.capacity import workload_mix
from bench.compare.options import VLLM_STRATEGIES, Options
from bench.compare.strategies import METRICS_PLACEHOLDER, pool_policy
from tests.bench.test_compare import OPTS


def test_its_defaults_and_what_it_refuses() -> None:
    opts = parse_args(["--backend", "vllm-cpu"])
    assert (opts.loads, opts.strategies, opts.speedup) == ((1.0, 3.0), VLLM_STRATEGIES, 1.0)
    assert (opts.duration_s, opts.warmup_s, opts.interactive_timeout_s) == (100.0, 30.0, 10.0)
    assert parse_args(["--backend", "vllm-cpu", "--loads", "2"]).loads == (2.0,)
    assert parse_args([]) == Options()  # the simulator's: unchanged
    for bad in (["--scenario", "halve"], ["--speedup", "3"], ["--strategies", "sidecar-static"]):
        with pytest.raises(SystemExit):
            parse_args(["--backend", "vllm-cpu", *bad])


def test_the_workload_fits_the_tiny_engine_and_the_limit_has_room_above_it() -> None:
    opts = Options(backend="vllm-cpu", model_requests=1000)
    mix = workload_mix(opts)
    assert len(mix) == 1000  # none over max_model_len
    # The tiny model's tokenizer reads the load's text as about 1.5 tokens per 4 characters.
    assert 1.6 * max(r.prompt_tokens + r.output_tokens for r in mix) < opts.engine.max_model_len
    cap = type("Cap", (), {"concurrency": 32})()
    policy = yaml.safe_load(pool_policy(cap, opts, [METRICS_PLACEHOLDER]))  # type: ignore[arg-type]
    assert policy["pool"]["adaptive"]["max"] == 2 * opts.engine.max_num_seqs
    assert OPTS.engine.max_num_seqs == 256  # the simulator's engine: unchanged
