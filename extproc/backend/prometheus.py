"""The sample lines of named families in a Prometheus text page: a pure scanner.

A sample line is ``name``, optionally ``{labels}``, then the value and an optional timestamp,
separated by blanks. Only the lines of the families asked for are parsed: ``str.find`` jumps
from one line of a family to the next in C, and everything else on the page (comments, other
families, most of a vLLM page) is never looked at. A name that merely starts with a wanted name
(``vllm:num_requests_waiting_by_reason`` for ``vllm:num_requests_waiting``) is not that family.

``samples`` raises ValueError for a malformed line of a wanted family: labels without their
closing brace, no value, or a value that is not a float (``float()``'s own message), and for a
page with more than ``max_lines`` lines of the wanted families (``MAX_LINES``, 2,048, by
default): each line costs Python work on the event loop, so their number bounds a page's
parse; the bytes between them are skipped in C. It checks nothing about the value itself; what
a value may be is the reader's rule (``vllm.parse_metrics``).

Label values are kept as written (escapes are not undone). ``label`` and ``split_label`` read
the label text pair by pair from its start, each pair anchored where the last one ended, so the
cost is linear in the text (a search for a pair anywhere in it would try every position).

The scanner's cost against ``prometheus_client.parser``, which builds every family of a page:
``scrape``'s docstring.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator

__all__ = ["MAX_LINES", "Sample", "label", "samples", "split_label"]

# Lines of the wanted families read in one page, at most: vLLM's page has 66 an engine
# (docs/pool.md, "What the scraper trusts", for the measure).
MAX_LINES = 2048

# A label name; a quoted value's text, its escapes unrolled. Possessive (``*+``): a failed
# match gives nothing back, so it costs one scan of the text, whatever the text.
_NAME = r"[a-zA-Z_][a-zA-Z0-9_]*+"
_VALUE = r'[^"\\]*+(?:\\.[^"\\]*+)*+'
_LABEL = re.compile(rf'\s*+({_NAME})\s*+=\s*+"({_VALUE})"\s*+(?:,|$)')  # one pair, then ","


# One sample line: (its family, the text between its braces or "", its value, the whole line
# for error messages); a plain tuple, the cheapest to make, as there is one per line read.
Sample = tuple[str, str, float, str]


def samples(page: str, names: Iterable[str], max_lines: int = MAX_LINES) -> Iterator[Sample]:
    """The samples of the families ``names`` in ``page``, family by family, each family's in
    page order."""
    text = "\n" + page  # every sample line now starts after a newline
    lines = 0
    for name in names:
        needle = "\n" + name
        pos = text.find(needle)
        while pos != -1:
            lines += 1  # a longer name that starts with this one counts too: it was looked at
            if lines > max_lines:
                raise ValueError(f"over {max_lines} lines of the families read")
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
    return split_label(labels, key)[0]


def split_label(labels: str, key: str) -> tuple[str | None, str]:
    """(the value of label ``key``, as written, or None; the label text without that pair).
    The pairs are read from the start up to the first that is not one: a key after it is not
    found."""
    fast = _written(key).fullmatch(labels)
    if fast is not None:
        before, value, after = fast.groups()
        return value, before + after[1:]
    pos = 0
    while (m := _LABEL.match(labels, pos)) is not None:
        if m.group(1) == key:
            return m.group(2), labels[: m.start()] + labels[m.end() :]
        pos = m.end()
    return None, labels


@functools.cache
def _written(key: str) -> re.Pattern[str]:
    """The label text as prometheus_client writes it (no blanks): the pairs before ``key``'s,
    its value, the pairs after. One match for the whole text, where ``_LABEL`` takes one a
    pair; the pairs before are tried one more at a time, each read once."""
    pair = rf'{_NAME}="{_VALUE}"'
    return re.compile(rf'((?:{pair},)*?){re.escape(key)}="({_VALUE})"((?:,{pair})*+)')
