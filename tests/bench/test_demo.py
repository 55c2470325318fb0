"""``make demo``'s table on made-up answers: every answer has a column, the columns of a row
add up to what was sent, and only the counters that are not zero are printed. The real run
is tests/e2e/test_demo.py."""

from __future__ import annotations

import re

from bench.demo import column, columns, nonzero_counters, table
from bench.load.client import Reply


def reply(status: int | None, code: str | None = None, *, outcome: str | None = None) -> Reply:
    if outcome is None:
        outcome = "ok" if status == 200 else "http_error"
    r = Reply(status=status, code=code, outcome=outcome)  # type: ignore[arg-type]
    r.sent_at, r.done_at = 0.0, 0.5
    if status == 429:
        r.headers = {"retry-after": "3"}
    return r


RESULTS = [
    *(("interactive", reply(200)) for _ in range(5)),
    *(("interactive", reply(429, "queue_full")) for _ in range(3)),
    *(("interactive", reply(429, "queue_timeout")) for _ in range(2)),
    ("interactive", reply(429, "queue_wait_too_long")),
    ("interactive", reply(None, outcome="timeout")),
    ("interactive", reply(200, outcome="conn_error")),  # a 200 whose answer broke
    ("interactive-retry", reply(200)),
    ("batch", reply(200)),
    ("batch", reply(503)),  # no error body: the status alone
    *(("oversize", reply(413, "prompt_too_long")) for _ in range(3)),
]


def test_every_answer_has_a_column() -> None:
    assert column(reply(200)) == "200"
    assert column(reply(413, "prompt_too_long")) == "413"  # 413 is one column whatever the code
    assert column(reply(429, "queue_timeout")) == "429 queue_timeout"
    assert column(reply(503)) == "503"
    assert column(reply(None, outcome="timeout")) == "other"
    assert column(reply(200, outcome="conn_error")) == "other"
    assert columns(RESULTS) == [
        "200",
        "413",
        "429 queue_full",
        "429 queue_timeout",
        "429 queue_wait_too_long",
        "503",
        "other",
    ]
    assert columns([]) == ["200", "413", "other"]  # 200 and 413 always


def rows(text: str) -> dict[str, dict[str, str]]:
    """The table as {kind: {header: cell}} (columns are two spaces apart or more)."""
    head, _, *body = text.splitlines()
    headers = re.split(r"\s{2,}", head.strip())
    out = {}
    for line in body:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == len(headers):
            out[cells[0]] = dict(zip(headers, cells, strict=True))
    return out


def test_each_row_adds_up_to_sent() -> None:
    text = table(RESULTS)
    got = rows(text)
    assert set(got) == {"interactive", "interactive-retry", "batch", "oversize"}
    answers = columns(RESULTS)
    for kind, row in got.items():
        assert sum(int(row[c]) for c in answers) == int(row["sent"]), kind
    i = got["interactive"]
    assert (i["sent"], i["200"], i["429 queue_wait_too_long"], i["other"]) == ("13", "5", "1", "2")
    assert i["retry-after"] == "3-3s" and got["batch"]["503"] == "1"
    assert got["oversize"]["413"] == "3"
    assert (got["interactive-retry"]["sent"], got["interactive-retry"]["200"]) == ("1", "1")
    # The refusal codes the table shows are explained under it.
    assert "  queue_wait_too_long: refused at once" in text


def test_only_counters_that_are_not_zero() -> None:
    metrics = "\n".join(
        [
            "# HELP llm_extproc_requests_total Finished requests.",
            'llm_extproc_requests_total{bucket="a",outcome="admitted"} 3.0',
            'llm_extproc_requests_total{bucket="a",outcome="rejected_busy"} 0.0',
            'llm_extproc_requests_total{bucket="none",outcome="rejected_too_large"} 1.0',
            'llm_extproc_in_flight{bucket="a"} 2.0',
        ]
    )
    assert nonzero_counters(metrics) == [
        'llm_extproc_requests_total{bucket="a",outcome="admitted"} 3.0',
        'llm_extproc_requests_total{bucket="none",outcome="rejected_too_large"} 1.0',
    ]
