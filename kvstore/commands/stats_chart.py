"""The hit rate over the last 24 h as a plain-text column chart (ASCII only: it survives pipes and logs)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Rows of the chart: one per 10 percentage points.
CHART_ROWS = 10


@dataclass(frozen=True, kw_only=True)
class Slice:
    """One column: what was asked and found in a slice of the 24 h (asked 0: no traffic)."""

    asked: int
    found: int


def _height(s: Slice) -> int | None:
    """Rows filled for the slice's rate, rounded to the nearest 10%; None without traffic."""
    if not s.asked:
        return None
    return round(s.found / s.asked * CHART_ROWS)


def render(slices: Sequence[Slice], *, title: str, slice_minutes: int) -> list[str]:
    """The chart's lines: `title`, rows from 100% down to 0%, the time axis.

    A column is the rate of one slice (oldest left, the current one right);
    a slice without traffic stays empty, one with traffic at a rate below 5%
    shows `_` on the 0% row.
    """
    heights = [_height(s) for s in slices]
    lines = [title]
    for row in range(CHART_ROWS, -1, -1):
        cells = []
        for h in heights:
            if h is None:
                cells.append(" ")
            elif row == 0:
                cells.append("#" if h > 0 else "_")
            else:
                cells.append("#" if h >= row else " ")
        lines.append(f"{row * 100 // CHART_ROWS:>4}% |{''.join(cells)}")
    width = len(slices)
    lines.append("      +" + "-" * width)
    lines.append("       " + _axis(width, slice_minutes))
    quiet = sum(h is None for h in heights)
    lines.append(f"       ({slice_minutes} min a column; {quiet} of {width} without traffic, left empty)")
    return lines


def _axis(width: int, slice_minutes: int) -> str:
    """Hour labels under the columns: -24h at the left, `now` at the right, every 6 h between."""
    axis = [" "] * width
    total_minutes = width * slice_minutes
    for hours_ago in range(total_minutes // 60, 0, -6):
        column = width - hours_ago * 60 // slice_minutes
        label = f"-{hours_ago}h"
        if column >= 0 and column + len(label) <= width - 3:
            axis[column:column + len(label)] = label
    axis[width - 3:] = "now"
    return "".join(axis)
