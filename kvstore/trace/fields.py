"""Checking a trace record's fields: each bad value is one `InvalidArgument` naming where it is."""

from __future__ import annotations

import math
from typing import Any

from kvstore.errors import InvalidArgument

_HINT = "the file is not as its trace format says: fix or cut that record (docs/CAPACITY.md, 'Traces')"


def bad(where: str, what: str) -> InvalidArgument:
    """The error for a bad record: `where` (file and line or request path), then what is wrong."""
    return InvalidArgument(f"{where}: {what}", hint=_HINT)


def field(record: Any, name: str, where: str) -> Any:
    """`record[name]`, or an error naming the missing field."""
    if not isinstance(record, dict):
        raise bad(where, f"expected a JSON object, got {type(record).__name__}")
    if name not in record:
        raise bad(where, f"missing field {name!r}")
    return record[name]


def seconds(record: Any, name: str, where: str, *, scale: float = 1.0) -> float:
    """A finite number >= 0 (times `scale`)."""
    value = field(record, name, where)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise bad(where, f"{name} must be a number >= 0, got {value!r}")
    return float(value) * scale


def count(record: Any, name: str, where: str) -> int:
    """An integer >= 0."""
    value = field(record, name, where)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad(where, f"{name} must be an integer >= 0, got {value!r}")
    return value


def block_ids(record: Any, name: str, where: str) -> list[int]:
    """A list of integer block ids >= 0.

    Checked with `min` and `sum`, which run in C: a string among the ids makes them raise,
    a float makes the sum a float (78 million ids in the weka trace: a Python loop per id
    would cost seconds).
    """
    ids = field(record, name, where)
    if not isinstance(ids, list):
        raise bad(where, f"{name} must be a list of block ids, got {type(ids).__name__}")
    if not ids:
        return ids
    try:
        low, total = min(ids), sum(ids)
    except TypeError:
        low, total = -1, 0
    if low < 0 or type(total) is not int:
        first = next((i for i, x in enumerate(ids) if isinstance(x, bool) or not isinstance(x, int) or x < 0), 0)
        raise bad(where, f"{name}[{first}] must be an integer block id >= 0, got {ids[first]!r}")
    return ids
