"""Counted nouns in what kvstore prints: "1 block", "2 blocks", "1,024 threads".

One place for the plural, so a message or a report line never reads "1 threads"
or "(1 blocks of 64)". Nouns whose plural is not the noun plus "s" pass it.
"""

from __future__ import annotations


def counted(n: int | float, noun: str, plural: str | None = None) -> str:
    """`n` with thousands separators, then `noun`, in the plural unless `n` is 1.

    Args:
        n: the count (an integral float prints without decimals).
        noun: the singular ("block").
        plural: the plural when it is not `noun + "s"` ("entries").
    """
    shown = f"{int(n):,}" if float(n).is_integer() else f"{n:,}"
    return f"{shown} {noun if n == 1 else plural or noun + 's'}"


__all__ = ["counted"]
