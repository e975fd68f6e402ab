"""Benchmark figures, their ratios against a baseline, and how they are printed."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

#: Units where a smaller value is better; for these the ratio is baseline / value,
#: so a ratio above 1 always means faster than the baseline.
TIME_UNITS = frozenset({"s", "ms", "us", "ns"})


@dataclass(frozen=True, kw_only=True)
class Figure:
    """One measured figure beside the baseline measured in the same run.

    `ratio` is value / baseline_value for rates and baseline_value / value for
    times: above 1 is better than the baseline either way. Figures with no
    baseline (an absolute latency target) have None there.
    """

    name: str
    value: float
    unit: str
    baseline: str | None = None
    baseline_value: float | None = None
    ratio: float | None = None

    @classmethod
    def against(cls, name: str, value: float, unit: str, baseline: str, baseline_value: float) -> Figure:
        """A figure with its ratio computed from the baseline."""
        if unit in TIME_UNITS:
            ratio = baseline_value / value if value else float("inf")
        else:
            ratio = value / baseline_value if baseline_value else float("inf")
        return cls(name=name, value=value, unit=unit, baseline=baseline,
                   baseline_value=baseline_value, ratio=ratio)


@dataclass(kw_only=True)
class Report:
    """What one benchmark run measured."""

    bench: str
    figures: list[Figure] = field(default_factory=list)
    notes: dict[str, object] = field(default_factory=dict)

    def add(self, figure: Figure) -> None:
        """Append a figure."""
        self.figures.append(figure)

    def to_json(self) -> str:
        """One JSON object: bench, figures, notes."""
        return json.dumps({"bench": self.bench, "figures": [asdict(f) for f in self.figures],
                           "notes": self.notes})

    def to_table(self) -> str:
        """A readable table of the figures and notes."""
        rows = [("figure", "value", "baseline", "baseline value", "ratio")]
        for f in self.figures:
            rows.append((
                f.name,
                f"{f.value:,.3f} {f.unit}",
                f.baseline or "-",
                "-" if f.baseline_value is None else f"{f.baseline_value:,.3f} {f.unit}",
                "-" if f.ratio is None else f"{f.ratio:.2f}x",
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.extend(f"{k}: {v}" for k, v in self.notes.items())
        return "\n".join(lines)


class Progress:
    """Progress bars on stderr for long phases; silent when disabled or when stderr is not a terminal.

    A bar redraws itself with carriage returns: in a file or a pipe its frames would stay, glued to
    whatever is written next (a report, a log line).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and sys.stderr.isatty()

    @contextmanager
    def bar(self, desc: str, total: float, unit: str = "B", *, scale: bool = True) -> Iterator[tqdm]:
        """A bar for one phase; call `.update(n)` on what it yields (`scale`: 1.5M rather than 1500000)."""
        with tqdm(total=total, desc=desc, unit=unit, unit_scale=scale, file=sys.stderr,
                  disable=not self.enabled, leave=False) as bar:
            yield bar
