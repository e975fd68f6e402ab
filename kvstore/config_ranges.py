"""What values a numeric setting may take, and the check every settings section runs at creation.

Shared by the service's sections (kvstore/config_sections.py) and the worker's
(replay/worker/settings.py): a section lists its bounds in a `RANGES` class table and
calls `check_ranges` from `__post_init__`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ConfigError

#: Largest value of a uint32 wire field (milliseconds of leases and TTLs).
UINT32_MAX = 2**32 - 1
#: Largest byte size any setting may name (LMDB map sizes and mmap lengths stay far below it).
MAX_BYTES = 1 << 60


@dataclass(frozen=True)
class Range:
    """The values a numeric setting may take: finite, between `lo` and `hi` (inclusive unless open)."""

    lo: float
    hi: float
    lo_open: bool = False
    #: Said after the range when a value is refused (why the bound is there).
    why: str = ""

    def holds(self, value: float) -> bool:
        """Whether `value` is finite and inside the range."""
        above = value > self.lo if self.lo_open else value >= self.lo
        return math.isfinite(value) and above and value <= self.hi

    def __str__(self) -> str:
        def show(x: float) -> str:
            return str(int(x)) if float(x).is_integer() else repr(x)

        return f"{'(' if self.lo_open else '['}{show(self.lo)}, {show(self.hi)}]"


#: Range of a numeric field no section lists: finite and not negative.
NON_NEGATIVE = Range(0, float(MAX_BYTES))


def check_ranges(settings: Any, section: str) -> None:
    """Refuse a numeric field that is NaN, infinite or outside its section's `RANGES`.

    Raises:
        ConfigError: naming the setting, the value and the allowed range.
    """
    ranges: dict[str, Range] = getattr(settings, "RANGES", {})
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        allowed = ranges.get(f.name, NON_NEGATIVE)
        if not allowed.holds(value):
            why = f"; {allowed.why}" if allowed.why else ""
            raise ConfigError(f"{section}.{f.name} = {value!r} is out of range: allowed {allowed}{why}")
