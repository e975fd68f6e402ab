"""Counted nouns: the singular for exactly one, the plural otherwise, thousands separated."""

from __future__ import annotations

from kvstore.counted import counted


def test_one_is_singular_and_every_other_count_plural() -> None:
    assert counted(1, "thread") == "1 thread"
    assert [counted(n, "block") for n in (0, 2, 1024)] == ["0 blocks", "2 blocks", "1,024 blocks"]
    assert counted(1, "index entry", "index entries") == "1 index entry"
    assert counted(3, "index entry", "index entries") == "3 index entries"
    assert counted(1.0, "token") == "1 token" and counted(1.5, "hour") == "1.5 hours"
