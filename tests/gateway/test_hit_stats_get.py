"""`HitStats.record_get` (the request ring's per-read counting) counts exactly what the general
path counts: the same calls as lookups go through `record`'s general adds, and every window, the
series and the saved file agree, across minute and half-hour rolls, a wall clock set back and
forth past the kept buckets, and several tenants. `TransferCounters.count_read_done` is `count`
of an all-DONE read batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.hit_stats import FIELDS, WINDOWS, HitStats
from gateway.transfer_sessions import TransferCounters
from kvstore.clock import ManualClock
from kvstore.transfer import DONE, BatchResults

BLOCK_TOKENS = 16


def as_lookups(counts: dict[str, int]) -> dict[str, int]:
    """The get counters of `counts` under the lookup counters' names (same order, same meaning)."""
    gets = [f for f in FIELDS if f.startswith("get")]
    lookups = [f for f in FIELDS if f.startswith("lookup")]
    return {lookup: counts[get] for get, lookup in zip(gets, lookups, strict=True)}


def only_lookups(counts: dict[str, int]) -> dict[str, int]:
    return {f: v for f, v in counts.items() if f.startswith("lookup")}


def steps(clock: ManualClock) -> list[tuple[str, int, int, float]]:
    """(tenant, asked, found, then move the wall clock by seconds) calls crossing every kind of roll."""
    out = []
    for i in range(40):
        out.append(("a" if i % 3 else "b", i % 9 + 1, i % 5, 0.0))
        out.append(("a", 8, 8, [0.0, 1.0, 59.0, 61.0, 1800.0, 7200.0, -7200.0, -30.0, 90_000.0][i % 9]))
    return out


def test_record_get_counts_what_the_general_path_counts(tmp_path: Path) -> None:
    fast_clock, slow_clock = ManualClock(start=1_800_000_030.0), ManualClock(start=1_800_000_030.0)
    fast = HitStats(tmp_path / "fast", fast_clock, block_tokens=BLOCK_TOKENS)
    slow = HitStats(tmp_path / "slow", slow_clock, block_tokens=BLOCK_TOKENS)
    checked = 0
    for tenant, asked, found, move in steps(fast_clock):
        fast.record_get(tenant, asked, found)
        slow.record(tenant, "lookup", asked, found)  # the general adds, into counters of the same shape
        for clock in (fast_clock, slow_clock):
            clock.jump(move) if move < 0 else clock.advance(move)
        for tenant_ in (None, "a", "b"):
            got = [as_lookups(w.counts) for w in fast.windows(tenant_, WINDOWS)]
            want = [only_lookups(w.counts) for w in slow.windows(tenant_, WINDOWS)]
            assert got == want
            assert ([as_lookups(p.counts) for p in fast.series(tenant_, 48)]
                    == [only_lookups(p.counts) for p in slow.series(tenant_, 48)])
            checked += 1
    assert checked == 240
    total = fast.windows(None, ["all"])[0].counts
    assert total["gets"] == 80 and total["get_tokens_asked"] == total["get_blocks_asked"] * BLOCK_TOKENS
    fast.close()
    slow.close()
    fast_file = json.loads((tmp_path / "fast" / "hits.json").read_text())
    slow_file = json.loads((tmp_path / "slow" / "hits.json").read_text())
    g, lk = FIELDS.index("gets"), FIELDS.index("lookups")

    def gets(state: dict[str, dict[str, list[int]]]) -> dict[str, list[int]]:
        return {t: c[g:g + 5] for t, c in state.items()}

    def lookups(state: dict[str, dict[str, list[int]]]) -> dict[str, list[int]]:
        return {t: c[lk:lk + 5] for t, c in state.items()}

    assert gets(fast_file["all"]) == lookups(slow_file["all"])
    for size, by_tenant in slow_file["buckets"].items():  # the same buckets kept, holding the same counts
        assert {t: gets(by) for t, by in fast_file["buckets"][size].items()} == \
            {t: lookups(by) for t, by in by_tenant.items()}

def test_record_get_is_record_of_a_get(tmp_path: Path) -> None:
    clock = ManualClock()
    one, other = (HitStats(None, clock, block_tokens=BLOCK_TOKENS) for _ in range(2))
    for asked, found in ((8, 8), (3, 0), (16, 2)):
        one.record_get("t", asked, found)
        other.record("t", "get", asked, found)
        clock.advance(61.0)
    assert one.windows("t") == other.windows("t")
    counts = one.windows("t", ["start"])[0].counts
    assert (counts["gets"], counts["get_blocks_asked"], counts["get_blocks_returned"],
            counts["get_tokens_returned"]) == (3, 27, 10, 10 * BLOCK_TOKENS)


def test_count_read_done_is_count_of_an_all_done_read() -> None:
    fast, slow = TransferCounters(), TransferCounters()
    for n in (1, 8, 16):
        results = BatchResults(n)
        results.statuses[:] = bytes([DONE]) * n
        results.bytes_moved = n * 4096
        slow.count(results)
        fast.count_read_done(n, n * 4096)
    assert fast == slow and fast.read_batches == 3 and fast.descriptors_done == 25


@pytest.mark.parametrize("first_read", ["windows", "series", "file", "a minute later"])
def test_counts_pending_since_the_last_read_are_in_whichever_read_comes_first(tmp_path: Path,
                                                                               first_read: str) -> None:
    clock = ManualClock(start=1_800_000_030.0)
    stats = HitStats(tmp_path, clock, block_tokens=BLOCK_TOKENS)
    for asked, found in ((8, 8), (8, 8), (4, 1), (2, 0)):  # the first finds the lists, the rest are pending
        stats.record_get("t", asked, found)
    want = {"gets": 4, "get_blocks_asked": 22, "get_blocks_returned": 17, "get_tokens_returned": 17 * BLOCK_TOKENS}
    if first_read == "windows":
        counts = stats.windows("t", ["5m"])[0].counts
    elif first_read == "series":
        counts = stats.series("t", 48)[-1].counts
    elif first_read == "file":
        stats.write()
        saved = json.loads((tmp_path / "hits.json").read_text())["buckets"]["60"]["t"]
        counts = dict(zip(FIELDS, next(iter(saved.values())), strict=True))
    else:
        clock.advance(60.0)
        stats.record_get("t", 1, 1)  # the minute rolls: the last minute's pending counts are folded first
        counts = stats.series("t", 48)[-1].counts  # both minutes share the half-hour
        want = {"gets": 5, "get_blocks_asked": 23, "get_blocks_returned": 18,
                "get_tokens_returned": 18 * BLOCK_TOKENS}
    assert {k: counts[k] for k in want} == want
    stats.close()
