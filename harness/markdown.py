"""Markdown for the run's tables: numbers as cells (NaN as a dash) and GitHub pipe tables; bool columns as
read back from summary.csv."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def flag(value: Any) -> bool:
    """A bool column's value as read back: a bool from `harness.results.summarize`, "True"/"False" from
    summary.csv, NaN or absent (a table written before the column existed) as False."""
    return str(value).strip().lower() == "true"


def fmt_float(value: Any, digits: int) -> str:
    """`value` with `digits` decimals; NaN or a value that is no number as a dash."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "—"
    return "—" if math.isnan(number) else f"{number:.{digits}f}"


def fmt_sci(value: Any) -> str:
    """A small non-negative number compactly (0, 3.1e-06, 0.258); NaN as a dash."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return "0" if value == 0 else f"{value:.2g}"


def cell(value: Any) -> str:
    """`value` as one table cell: whitespace runs collapsed, pipes escaped."""
    text = "" if value is None else str(value)
    return " ".join(text.split()).replace("|", "\\|")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub pipe table (no tabulate needed); cells are escaped and padded to column width."""
    cells = [[cell(c) for c in header]] + [[cell(c) for c in row] for row in rows]
    widths = [max(3, *(len(r[i]) for r in cells)) for i in range(len(header))]

    def line(values: Sequence[str]) -> str:
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)) + " |"

    out = [line(cells[0]), "| " + " | ".join("-" * w for w in widths) + " |"]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)
