"""gateway.hit_stats on its own: minute buckets, windows, the 24-hour series and the file in the data dir
(real files in a temp dir, a ManualClock; no server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.hit_stats import FILE_NAME, HitStats
from kvstore.clock import ManualClock


def counts(stats: HitStats, window: str, tenant: str | None = None) -> dict[str, int]:
    return next(w.counts for w in stats.windows(tenant, [window]))


def test_a_window_holds_its_minutes_and_nothing_older(tmp_path: Path, clock: ManualClock) -> None:
    stats = HitStats(None, clock, block_tokens=16)
    stats.record("a", "lookup", 10, 0)  # a full miss ...
    clock.advance(2 * 3600)
    stats.record("a", "lookup", 10, 10)  # ... two hours before a full hit
    one_hour, day = counts(stats, "1h"), counts(stats, "24h")
    assert (one_hour["lookup_blocks_asked"], one_hour["lookup_blocks_found"]) == (10, 10)
    assert (day["lookup_blocks_asked"], day["lookup_blocks_found"]) == (20, 10)
    assert (day["lookup_tokens_asked"], day["lookup_tokens_found"]) == (320, 160)
    clock.advance(5 * 60)  # the 5-minute window is the current minute and the 4 before it
    assert counts(stats, "5m")["lookups"] == 0 and counts(stats, "1h")["lookups"] == 1


def test_buckets_older_than_24_hours_are_dropped(clock: ManualClock) -> None:
    stats = HitStats(None, clock, block_tokens=16)
    stats.record("a", "get", 4, 1)  # at the start of a half-hour (the ManualClock starts on one)
    clock.advance(23 * 3600 + 59 * 60)
    assert counts(stats, "24h")["gets"] == 1  # the 24 h window is 48 half-hours, the current one included
    clock.advance(60)
    stats.record("a", "get", 4, 4)  # a new minute prunes the old bucket
    assert counts(stats, "24h")["gets"] == 1
    assert counts(stats, "all")["gets"] == counts(stats, "start")["gets"] == 2
    assert [len(by_tenant["a"]) for by_tenant in stats._buckets.values()] == [1, 1]  # a minute, a half-hour


def test_a_new_minute_writes_the_file_and_a_reload_reads_it(tmp_path: Path, clock: ManualClock) -> None:
    stats = HitStats(tmp_path, clock, block_tokens=16)
    stats.record("a", "swa", 3, 2)
    assert not (tmp_path / FILE_NAME).exists()  # no I/O on the call's path within a minute
    clock.advance(60)
    stats.record("b", "swa", 1, 0)  # the first call of a new minute has the writer write
    assert stats._writer is not None
    stats._writer.submit(lambda: None).result(timeout=10)  # the write queued before it is done
    reloaded = HitStats(tmp_path, clock, block_tokens=16)  # as after a kill -9: only what was written
    assert counts(reloaded, "1h", "a")["swa_snapshots_found"] == 2
    assert counts(reloaded, "start")["swa_gets"] == 0
    assert reloaded.counted_since_s == stats.counted_since_s
    stats.close()  # the last write has the current minute too
    assert counts(HitStats(tmp_path, clock, block_tokens=16), "all", "b")["swa_snapshots_asked"] == 1
    assert not (tmp_path / (FILE_NAME + ".tmp")).exists()


def test_the_file_keeps_counters_by_name(tmp_path: Path, clock: ManualClock) -> None:
    stats = HitStats(tmp_path, clock, block_tokens=16)
    stats.record_resume("a", prompt_tokens=100, found_tokens=64, usable_tokens=64,
                        action_field="resume_bounded_replay_plans")
    stats.close()
    state = json.loads((tmp_path / FILE_NAME).read_text())
    state["fields"] = list(reversed(state["fields"]))  # a later version may order or add fields
    state["all"]["a"] = list(reversed(state["all"]["a"]))
    (tmp_path / FILE_NAME).write_text(json.dumps(state))
    c = counts(HitStats(tmp_path, clock, block_tokens=16), "all", "a")
    assert (c["resume_plans"], c["resume_usable_tokens"], c["resume_bounded_replay_plans"]) == (1, 64, 1)


@pytest.mark.parametrize("text", ["", "{", '{"fields": 3}', '{"format": 1}'])
def test_a_damaged_file_is_set_aside_and_counting_starts_anew(tmp_path: Path, clock: ManualClock,
                                                              caplog: pytest.LogCaptureFixture, text: str) -> None:
    (tmp_path / FILE_NAME).write_text(text)
    stats = HitStats(tmp_path, clock, block_tokens=16)
    assert stats.tenants() == [] and "damaged" in caplog.text
    assert (tmp_path / (FILE_NAME + ".damaged")).read_text() == text


def test_the_series_covers_24_hours_ending_with_the_current_minute(clock: ManualClock) -> None:
    stats = HitStats(None, clock, block_tokens=16)
    stats.record("a", "lookup", 2, 1)
    clock.advance(23 * 3600 + 59 * 60)
    stats.record("a", "lookup", 2, 2)
    points = stats.series(None, 48)
    assert len(points) == 48 and points[0].seconds == 1800
    assert points[-1].start_s <= clock.now() < points[-1].start_s + 1800
    assert points[0].counts["lookup_blocks_found"] == 1 and points[-1].counts["lookup_blocks_found"] == 2
    assert sum(p.counts["lookups"] for p in points[1:-1]) == 0


def test_a_file_where_the_stats_folder_should_be_is_set_aside(tmp_path: Path, clock: ManualClock,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "stats"
    folder.write_bytes(b"\xff" * 10)
    stats = HitStats(folder, clock, block_tokens=16)
    assert (tmp_path / "stats.damaged").read_bytes() == b"\xff" * 10 and "moved to" in caplog.text
    stats.record("a", "lookup", 1, 1)
    stats.close()  # the folder is made again, and the counters written into it
    assert counts(HitStats(folder, clock, block_tokens=16), "all", "a")["lookups"] == 1
