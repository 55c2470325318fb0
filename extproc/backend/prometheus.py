"""The sample lines of named families in a Prometheus text page: a pure scanner.

A sample line is ``name``, optionally ``{labels}``, then the value and an optional timestamp,
separated by blanks. Only the lines of the families asked for are parsed: ``str.find`` jumps
from one line of a family to the next in C, and everything else on the page (comments, other
families, most of a vLLM page) is never looked at. A name that merely starts with a wanted name
(``vllm:num_requests_waiting_by_reason`` for ``vllm:num_requests_waiting``) is not that family.

``samples`` raises ValueError for a malformed line of a wanted family: labels without their
closing brace, no value, or a value that is not a float (``float()``'s own message). It checks
nothing about the value itself; what a value may be is the reader's rule (``vllm.parse_metrics``).
Label values are kept as written (``label`` finds one; escapes are not undone).

The scanner's cost against ``prometheus_client.parser``, which builds every family of a page:
``python -m bench.micro.metrics_parser``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

__all__ = ["Sample", "label", "samples"]

_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')


# One sample line: (its family, the text between its braces or "", its value, the whole line
# for error messages); a plain tuple, the cheapest to make, as there is one per line read.
Sample = tuple[str, str, float, str]


def samples(page: str, names: Iterable[str]) -> Iterator[Sample]:
    """The samples of the families ``names`` in ``page``, family by family, each family's in
    page order."""
    text = "\n" + page  # every sample line now starts after a newline
    for name in names:
        needle = "\n" + name
        pos = text.find(needle)
        while pos != -1:
            end = text.find("\n", pos + 1)
            line = text[pos + 1 : end if end != -1 else len(text)].rstrip("\r")
            pos = text.find(needle, end) if end != -1 else -1
            sep = line[len(name) : len(name) + 1]
            labels = ""
            if sep == "{":
                close = line.rfind("}")  # nothing after the labels (value, timestamp) has one
                if close == -1:
                    raise ValueError(f"bad labels {line[:60]!r}")
                labels = line[len(name) + 1 : close]
                rest = line[close + 1 :]
            elif sep in (" ", "\t", ""):
                rest = line[len(name) :]
            else:
                continue  # a longer name that starts with this one
            fields = rest.split()
            if not fields:
                raise ValueError(f"no value {line[:60]!r}")
            yield (name, labels, float(fields[0]), line)


def label(labels: str, key: str) -> str | None:
    """The value of label ``key`` in a sample's label text, as written; None when absent."""
    for m in _LABEL.finditer(labels):
        if m.group(1) == key:
            return m.group(2)
    return None
