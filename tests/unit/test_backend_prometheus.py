"""The Prometheus text scanner and the vLLM page reader: pure, table-driven, no sockets."""

from __future__ import annotations

import math
import time

import pytest

from extproc.backend.prometheus import MAX_LINES, label, samples, split_label
from extproc.backend.vllm import EndpointSample, parse_metrics

INF = float("inf")

# page, families asked for, the (name, labels, value) found in order.
SAMPLES = [
    ("m 1\n", ["m"], [("m", "", 1.0)]),
    ("m 1", ["m"], [("m", "", 1.0)]),  # no newline at the end
    ("m\t2.5\r\n", ["m"], [("m", "", 2.5)]),
    ("m 3 1700000000000\n", ["m"], [("m", "", 3.0)]),  # the timestamp is ignored
    ('m{a="1"} 4\n', ["m"], [("m", 'a="1"', 4.0)]),
    ('m{a="}"} 5\n', ["m"], [("m", 'a="}"', 5.0)]),  # the last brace closes the labels
    ("m{} 6\n", ["m"], [("m", "", 6.0)]),
    ("# HELP m doc\n# TYPE m gauge\nm 7\n", ["m"], [("m", "", 7.0)]),
    ("m_total 1\nmx 2\nm:y 3\n", ["m"], []),  # longer names are other families
    ("other 1\n", ["m"], []),
    (" m 1\n", ["m"], []),  # a sample line starts with its name
    ("m NaN\nm -1\nm +Inf\n", ["m"], [("m", "", math.nan), ("m", "", -1.0), ("m", "", INF)]),
    ("b 1\na 2\nb 3\n", ["a", "b"], [("a", "", 2.0), ("b", "", 1.0), ("b", "", 3.0)]),
]


@pytest.mark.parametrize(("page", "names", "expected"), SAMPLES)
def test_samples(page: str, names: list[str], expected: list[tuple[str, str, float]]) -> None:
    found = [(name, labels, value) for name, labels, value, _ in samples(page, names)]
    assert len(found) == len(expected)
    for (name, labels, value), want in zip(found, expected, strict=True):
        assert (name, labels) == want[:2]
        assert value == want[2] or (math.isnan(value) and math.isnan(want[2]))


def test_a_sample_keeps_its_whole_line() -> None:
    lines = [line for *_, line in samples('x 1\r\nm{a="1"} 2 99\r\n', ["m"])]
    assert lines == ['m{a="1"} 2 99']


@pytest.mark.parametrize(
    ("page", "message"),
    [
        ('m{a="1" 2\n', "bad labels"),
        ("m\n", "no value"),
        ("m{} \n", "no value"),
        ("m abc\n", "could not convert"),
        ("m 1\nm 2 3\nm x\n", "could not convert"),  # the good lines before do not help
    ],
)
def test_a_malformed_line_of_a_wanted_family_raises(page: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        list(samples(page, ["m"]))


@pytest.mark.parametrize(
    ("labels", "key", "value"),
    [
        ('le="0.5"', "le", "0.5"),
        ('model_name="x",le="+Inf"', "le", "+Inf"),
        (' a = "1" , le = "2" ', "le", "2"),
        ('a="le=\\"9\\"",le="1"', "le", "1"),  # a quoted le= is inside a value
        ('a="\\"b\\""', "a", '\\"b\\"'),  # escapes are kept as written
        ('a="1"', "le", None),
        ("", "le", None),
    ],
)
def test_label(labels: str, key: str, value: str | None) -> None:
    assert label(labels, key) == value


@pytest.mark.parametrize(
    ("labels", "value", "rest"),
    [
        ('engine="0",model_name="m",le="0.5"', "0.5", 'engine="0",model_name="m",'),
        ('le="0.5",engine="0"', "0.5", 'engine="0"'),
        (' engine = "0" , le = "1" ', "1", ' engine = "0" ,'),
        ('a="x\\",le=\\"9\\"",le="1"', "1", 'a="x\\",le=\\"9\\"",'),  # an escaped le=
        ('a="1"', None, 'a="1"'),
        ('garbage le="1"', None, 'garbage le="1"'),  # read up to the first pair that is not one
    ],
)
def test_split_label(labels: str, value: str | None, rest: str) -> None:
    assert split_label(labels, "le") == (value, rest)


@pytest.mark.parametrize(
    "labels", ["a" * 200_000, 'a="' + "x" * 200_000, "a=" * 100_000, 'a="1",' * 40_000]
)
def test_label_text_costs_one_scan(labels: str) -> None:
    """Linear in the text: searching for a pair at every position took seconds for 16 KB."""
    t0 = time.perf_counter()
    assert split_label(labels, "le")[0] is None
    assert time.perf_counter() - t0 < 0.5


def test_the_lines_read_are_bounded() -> None:
    page = "m 1\n" * 10 + "other 1\n" * 100
    assert len(list(samples(page, ["m"], max_lines=10))) == 10
    with pytest.raises(ValueError, match="over 9 lines of the families read"):
        list(samples(page, ["m"], max_lines=9))
    with pytest.raises(ValueError, match=f"over {MAX_LINES} lines"):  # longer names count
        list(samples("m_total 1\n" * (MAX_LINES + 1), ["m"]))


# --- the vLLM reader ---------------------------------------------------------------------------

TTFT = "vllm:time_to_first_token_seconds_bucket"
ITL = "vllm:inter_token_latency_seconds_bucket"
ITL_OLD = "vllm:time_per_output_token_seconds_bucket"

PAGES = [
    ("", EndpointSample()),
    ("process_cpu_seconds_total 5\nvllm:num_requests_waiting_by_reason 3\n", EndpointSample()),
    (
        'vllm:num_requests_waiting{e="0"} 1\nvllm:num_requests_waiting{e="1"} 2\n',
        EndpointSample(waiting=3.0),
    ),
    ("vllm:num_requests_running 0\n", EndpointSample(running=0.0)),  # present, though 0
    (
        'vllm:kv_cache_usage_perc{e="0"} 0.2\nvllm:kv_cache_usage_perc{e="1"} 0.7\n',
        EndpointSample(kv_usage=0.7),  # the fullest, not the sum
    ),
    ("vllm:gpu_cache_usage_perc 0.4\n", EndpointSample(kv_usage=0.4)),
    (
        "vllm:gpu_cache_usage_perc 0.4\nvllm:kv_cache_usage_perc 0.3\n",
        EndpointSample(kv_usage=0.3),  # the new name wins
    ),
    (
        f'{TTFT}{{e="0",le="0.1"}} 1\n{TTFT}{{e="1",le="0.1"}} 2\n{TTFT}{{e="0",le="+Inf"}} 4\n',
        EndpointSample(histograms={"ttft": {0.1: 3.0, INF: 4.0}}),
    ),
    (f'{ITL_OLD}{{le="0.5"}} 2\n', EndpointSample(histograms={"itl": {0.5: 2.0}})),
    (
        f'{ITL_OLD}{{le="0.5"}} 2\n{ITL}{{le="0.5"}} 2\n',
        EndpointSample(histograms={"itl": {0.5: 2.0}}),
    ),
    (  # a histogram's _count and _sum are not its buckets
        "vllm:time_to_first_token_seconds_count 9\nvllm:time_to_first_token_seconds_sum 1\n",
        EndpointSample(),
    ),
]


@pytest.mark.parametrize(("page", "expected"), PAGES)
def test_parse_metrics(page: str, expected: EndpointSample) -> None:
    assert parse_metrics(page) == expected
    assert parse_metrics(page.encode()) == expected


def test_parse_metrics_replaces_bytes_that_are_not_utf8() -> None:
    page = b'vllm:num_requests_waiting{model_name="\xff"} 2\n'
    assert parse_metrics(page) == EndpointSample(waiting=2.0)


def test_series_are_told_apart_by_their_labels_without_le() -> None:
    """Each series is checked on its own (two engines, each monotonic), then summed; bounds
    that differ between series are not a fall."""
    page = (
        f'{TTFT}{{e="0",le="0.1"}} 5\n{TTFT}{{e="0",le="+Inf"}} 5\n'
        f'{TTFT}{{le="1.0",e="1"}} 3\n{TTFT}{{e="1",le="+Inf"}} 3\n'
    )
    assert parse_metrics(page) == EndpointSample(
        histograms={"ttft": {0.1: 5.0, 1.0: 3.0, INF: 8.0}}
    )


@pytest.mark.parametrize(
    ("page", "message"),
    [
        ("vllm:num_requests_waiting NaN\n", "bad value"),
        ("vllm:num_requests_running -1\n", "bad value"),
        ("vllm:kv_cache_usage_perc +Inf\n", "bad value"),
        (f'{TTFT}{{e="0"}} 1\n', "bucket without le"),
        (f'{TTFT}{{le="x"}} 1\n', "could not convert"),
        ("vllm:num_requests_waiting abc\n", "could not convert"),
        ('vllm:num_requests_waiting{engine="0"\n', "bad labels"),
        ("vllm:num_requests_waiting 1e16\n", "bad value"),  # over 2**53
        (f'{TTFT}{{le="NaN"}} 1\n', f"{TTFT}: le='NaN' is not a number >= 0"),
        (f'{TTFT}{{le="-0.5"}} 1\n', f"{TTFT}: le='-0.5' is not a number >= 0"),
        (f'{TTFT}{{le="1"}} 2\n{TTFT}{{le="1"}} 2\n', f"{TTFT}: le='1' twice in one series"),
        (
            f'{TTFT}{{e="0",le="+Inf"}} 1\n{TTFT}{{e="0",le="0.1"}} 2\n',
            rf"{TTFT}: counts fall to 1 at le=inf",  # in order of the bounds, not the page's
        ),
        ("".join(f'{TTFT}{{le="{i}"}} {i}\n' for i in range(65)), "65 bucket bounds, over 64"),
    ],
)
def test_parse_metrics_rejects(page: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_metrics(page)
