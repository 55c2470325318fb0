"""The one table formatter the benchmarks print with: fixed-width, right-aligned columns.

>>> print(format_table(["way", "req/s"], [["floor", "33,180"], ["sidecar", "7,493"]]))
way       req/s
floor    33,180
sidecar   7,493

The first column is left-aligned (it names the row), the others right-aligned; each column is
as wide as its widest cell. Cells are strings: the caller decides the number format.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["fmt", "fmt_spread", "format_table"]


def fmt(value: float | None, digits: int = 2, none: str = "-") -> str:
    """A number with ``digits`` decimals, or ``none`` for a missing one."""
    return none if value is None or value != value else f"{value:.{digits}f}"


def fmt_spread(values: Sequence[float | None], digits: int = 2) -> str:
    """Several seeds' figure: the mean of those there and, after ``+-``, half their spread
    (max - min) when there are several; ``-`` when there is none."""
    nums = [v for v in values if v is not None]
    if not nums:
        return "-"
    mean = fmt(sum(nums) / len(nums), digits)
    return mean if len(nums) == 1 else f"{mean}+-{(max(nums) - min(nums)) / 2:.{digits}f}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], gap: int = 2) -> str:
    """Rows of string cells under their headers (every row as long as ``headers``)."""
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {list(row)!r} has {len(row)} cells for {len(headers)} headers")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    pad = " " * gap

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return pad.join([first, *rest]).rstrip()

    return "\n".join(line(r) for r in [headers, *rows])
