"""The write rate's window (the headroom's denominator): bounded memory however many writes, the rate
within one bucket of exact."""

from __future__ import annotations

from tiers.accounting import WRITE_RATE_BUCKET_S, WriteRate


def test_many_writes_in_the_window_hold_one_entry_per_bucket() -> None:
    rate = WriteRate(window_s=100.0, started_s=0.0)
    for i in range(100_000):  # 1,000 writes a second for 100 s
        rate.note(i / 1000.0, 10)
    assert rate.entries <= 100.0 / WRITE_RATE_BUCKET_S + 1
    assert rate.per_second(100.0) == 100_000 * 10 / 100.0


def test_writes_past_the_window_stop_counting() -> None:
    rate = WriteRate(window_s=10.0, started_s=0.0)
    rate.note(0.5, 1_000)
    rate.note(20.5, 500)
    assert rate.per_second(20.5) == 500 / 10.0
    assert rate.entries == 1
