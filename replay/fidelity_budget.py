"""A tenant's replay fidelity as an error budget, and the span that meets it, from a measured table.

A fidelity setting (`parse_budget`) is one of:

- `exact`: exact replay only (layers x window tokens; the window state is bit-exact);
- `windows:N`: a bounded replay of N windows, as `CostModel.replay_windows`;
- `kl:X`: the KL(exact || approx) per continued token, in nats, may be at most X;
- `fastllm:P`: at least P% of resumes meet the fastllm fixture's criteria
  (cosine >= 0.9975 and max |diff| <= 4% of the logit range).

A budget is met by a span from the worker's table for its model (`FidelityTable`,
`replay/fidelity/<model>.json`, written by `kvstore bench replay --write-table`; a planner picks the
table measured on its geometry, `table_for_geometry`):
the planner picks the **smallest span whose measured upper bound meets the budget
in every case of the table** (`choose_span`). The bound of a KL budget is the
95% bootstrap interval's upper end (`ci_high`) of the mean KL per continued
token; the bound of a pass-rate budget is the worst seed group's pass rate
(`worst`). A budget no measured span meets gives exact replay (the one setting
whose error is 0 by construction), and says so; so does a budget with no table.

The default budget (`DEFAULT_BUDGET`, a tenant's policy field
`replay_fidelity` unless set) is "fastllm:95": fastllm's criteria are the
accuracy bar the engines' fixtures test against, and 95% of resumes is the most
the shipped table's resumes can bound (docs/REPLAY.md, "Fidelity budgets").
torch is never imported here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvstore.errors import InvalidArgument

#: The table format this version reads and the bench writes.
TABLE_FORMAT = 1
#: Where the shipped tables live: one JSON file per model.
TABLE_FOLDER = Path(__file__).resolve().parent / "fidelity"
#: Largest KL budget accepted, nats per continued token: above it every span passes, a mistake's sign.
MAX_KL = 10.0
#: The default budget (see the module docstring for why).
DEFAULT_BUDGET = "fastllm:95"
#: The figure each budget kind is bounded by, and which end of its interval.
_BOUND: dict[str, tuple[str, str]] = {"kl": ("kl_per_token", "ci_high"), "fastllm": ("fastllm_pass", "worst")}

Kind = Literal["exact", "windows", "kl", "fastllm"]


@dataclass(frozen=True)
class FidelityBudget:
    """One fidelity setting: exact replay, a span in windows, or an error budget (module docstring)."""

    kind: Kind
    value: float = 0.0

    @property
    def text(self) -> str:
        """The setting as `parse_budget` reads it back (canonical)."""
        if self.kind == "exact":
            return "exact"
        if self.kind == "windows":
            return f"windows:{int(self.value)}"
        return f"{self.kind}:{self.value:g}"

    def describe(self) -> str:
        """The setting in words, for a plan's reason line."""
        if self.kind == "kl":
            return f"KL <= {self.value:g} nats per continued token"
        if self.kind == "fastllm":
            return f"fastllm criteria on >= {self.value:g}% of resumes"
        return self.text


def parse_budget(text: str) -> FidelityBudget:
    """A fidelity setting from its text: "exact", "windows:N", "kl:X" or "fastllm:P" (P in percent).

    Raises:
        InvalidArgument: anything else, saying what each form takes.
    """
    if not isinstance(text, str):
        raise InvalidArgument(f"replay fidelity must be text, got {type(text).__name__}")
    raw = text.strip().lower()
    forms = ("'exact', 'windows:N' (N >= 1), 'kl:X' (nats per continued token, 0 < X <= "
             f"{MAX_KL:g}) or 'fastllm:P' (percent of resumes, 0 < P <= 100)")
    if raw == "exact":
        return FidelityBudget("exact")
    kind, sep, number = raw.partition(":")
    number = number.strip().removesuffix("%")
    if not sep or kind not in ("windows", "kl", "fastllm"):
        raise InvalidArgument(f"replay fidelity {text!r} is not a setting: give {forms}")
    try:
        value = float(number)
    except ValueError:
        raise InvalidArgument(f"replay fidelity {text!r}: {number!r} is not a number; give {forms}") from None
    if kind == "windows" and (not value.is_integer() or value < 1):
        raise InvalidArgument(f"replay fidelity {text!r}: a span is a whole number of windows >= 1")
    if kind == "kl" and not (math.isfinite(value) and 0 < value <= MAX_KL):
        raise InvalidArgument(f"replay fidelity {text!r}: a KL budget is nats per continued token in "
                              f"(0, {MAX_KL:g}]")
    if kind == "fastllm" and not (math.isfinite(value) and 0 < value <= 100):
        raise InvalidArgument(f"replay fidelity {text!r}: a pass-rate budget is a percent of resumes in (0, 100]")
    return FidelityBudget(kind, value)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class FidelityTable:
    """A model's measured fidelity per span (windows) and case: each figure's mean, interval and worst case.

    Attributes:
        model: the model measured (its file's name).
        spans: windows -> case -> figure -> {mean, ci_low, ci_high, worst, resumes, seeds}.
        source: where the table was read from (for reason lines).
        meta: the rest of the file (window, seeds, training, command, device, generated).
    """

    model: str
    spans: dict[int, dict[str, dict[str, dict[str, Any]]]]
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "") -> FidelityTable:
        """A table from its JSON object, checked.

        Raises:
            ValueError: not a table of this format (naming what is wrong).
        """
        if not isinstance(data, dict) or data.get("format") != TABLE_FORMAT:
            raise ValueError(f"fidelity table {source}: not format {TABLE_FORMAT}")
        spans = data.get("spans")
        if not isinstance(spans, dict) or not spans:
            raise ValueError(f"fidelity table {source}: no spans")
        out: dict[int, dict[str, dict[str, dict[str, Any]]]] = {}
        for key, cases in spans.items():
            if not str(key).isdigit() or int(key) < 1 or not isinstance(cases, dict) or not cases:
                raise ValueError(f"fidelity table {source}: span {key!r} is not windows >= 1 with cases")
            for case, figures in cases.items():
                for figure, end in _BOUND.values():
                    got = figures.get(figure) if isinstance(figures, dict) else None
                    if not isinstance(got, dict) or not isinstance(got.get(end), int | float) \
                            or not isinstance(got.get("resumes"), int):
                        raise ValueError(f"fidelity table {source}: span {key}, case {case!r} lacks {figure}.{end}")
                    if got["resumes"] < 1:  # its zeros would meet every KL budget
                        raise ValueError(f"fidelity table {source}: span {key}, case {case!r} has no resumes")
            out[int(key)] = cases
        meta = {k: v for k, v in data.items() if k != "spans"}
        return cls(model=str(data.get("model", "")), spans=dict(sorted(out.items())), source=source, meta=meta)

    @classmethod
    def load(cls, path: str | Path) -> FidelityTable:
        """Read a table file.

        Raises:
            ValueError: the file is missing, not JSON, or not a table.
        """
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"fidelity table {p}: cannot be read: {exc}") from None
        try:  # a shipped table is named from the repository's root, in reason lines as in the docs
            shown = str(p.resolve().relative_to(TABLE_FOLDER.parents[1]))
        except ValueError:
            shown = str(p)
        return cls.from_dict(data, source=shown)

    @classmethod
    def shipped(cls, model: str = "tiny") -> FidelityTable:
        """The table shipped for `model` (replay/fidelity/<model>.json)."""
        return cls.load(TABLE_FOLDER / f"{model}.json")

    def bound(self, windows: int, budget: FidelityBudget) -> tuple[float, str, int]:
        """(bound, worst case, fewest resumes): the span's measured bound for a KL or pass-rate budget
        over every case (the largest KL upper bound, the lowest pass-rate worst), and the case giving it."""
        figure, end = _BOUND[budget.kind]
        cases = self.spans[windows]
        values = {case: float(figs[figure][end]) for case, figs in cases.items()}
        worst = max(values, key=values.__getitem__) if budget.kind == "kl" else min(values, key=values.__getitem__)
        return values[worst], worst, min(int(figs[figure]["resumes"]) for figs in cases.values())

    def describe(self) -> str:
        """Where the table came from, for reason lines: file, model, seeds, resumes."""
        m = self.meta
        return (f"{self.source or 'table'} (model {self.model}, prompt seeds {m.get('prompt_seeds', '?')}, "
                f"{len(m.get('training', []) or [])} training seed(s))")


@dataclass(frozen=True, kw_only=True)
class SpanChoice:
    """The span a budget resolves to: windows (None: exact replay) and the reason line."""

    replay_windows: int | None
    reason: str
    expected: float | None = None


def _meets(budget: FidelityBudget, bound: float) -> bool:
    return bound <= budget.value if budget.kind == "kl" else bound * 100 >= budget.value


def _shown(budget: FidelityBudget, bound: float) -> str:
    return f"{bound:.3g} nats" if budget.kind == "kl" else f"{bound:.1%} passing"


def choose_span(budget: FidelityBudget, table: FidelityTable | None) -> SpanChoice:
    """The smallest span of `table` whose measured bound meets `budget` in every case (module docstring).

    "exact" and "windows:N" need no table. A budget no span meets, or no table, gives exact replay.
    """
    if budget.kind == "exact":
        return SpanChoice(replay_windows=None, reason="fidelity exact: exact replay (bit-exact window state)")
    if budget.kind == "windows":
        k = int(budget.value)
        return SpanChoice(replay_windows=k, reason=f"fidelity {budget.text}: a bounded replay of {k} window(s), "
                                                   "as set (no error budget)")
    name, end = _BOUND[budget.kind]
    what = f"fidelity budget {budget.describe()} ({budget.text})"
    if table is None:
        return SpanChoice(replay_windows=None, reason=f"{what}: exact replay: no fidelity table for this model "
                                                      "(kvstore bench replay --write-table makes one)")
    rejected: list[str] = []
    for k in table.spans:
        bound, case, resumes = table.bound(k, budget)
        if _meets(budget, bound):
            smaller = f"; smaller spans miss it: {', '.join(rejected)}" if rejected else ""
            return SpanChoice(replay_windows=k, expected=bound, reason=(
                f"{what}: {k} x window, the smallest span whose measured bound meets it: expected "
                f"{name} {end} {_shown(budget, bound)} (worst case {case!r}, >= {resumes} resumes a case), "
                f"from {table.describe()}{smaller}"))
        rejected.append(f"{k} x window {_shown(budget, bound)} ({case!r})")
    return SpanChoice(replay_windows=None, reason=(
        f"{what}: exact replay: no measured span meets it ({', '.join(rejected)}; {table.describe()})"))


def table_for(model: str) -> FidelityTable | None:
    """The shipped table of `model`, or None when there is none."""
    path = TABLE_FOLDER / f"{model}.json"
    return FidelityTable.load(path) if path.is_file() else None


def table_for_geometry(geometry: Any, folder: Path | None = None) -> FidelityTable | None:
    """The table measured on `geometry`'s model shape, from the tables in `folder` (default: the shipped ones).

    A table names the cache geometry it was measured on (`geometry_config`: the config.json fields of
    kvstore.geometry.ModelGeometry.to_config, written by `kvstore bench replay --write-table`); the
    record layout an engine keeps its rows in is no part of the match (it changes the stored bytes,
    not the model whose replay error the table measures). So adding replay/fidelity/<model>.json for
    a geometry is all a planner of that geometry needs. Several tables of one geometry: the newest
    (`generated`), then the file name. None when no table matches (a budget then replays exactly).
    A damaged file is skipped with a warning, not raised: one bad table must not stop every planner.
    """
    import logging

    want = geometry.to_config()
    found: list[tuple[str, str, FidelityTable]] = []
    for path in sorted((folder or TABLE_FOLDER).glob("*.json")):
        try:
            table = FidelityTable.load(path)
        except ValueError as exc:
            logging.getLogger(__name__).warning("fidelity table skipped: %s", exc)
            continue
        if table.meta.get("geometry_config") == want:
            found.append((str(table.meta.get("generated", "")), path.name, table))
    # max keeps the first of equal keys, and `found` is in file-name order
    return max(found, key=lambda item: item[0])[2] if found else None
