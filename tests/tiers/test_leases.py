"""The lease table (tiers/leases.py): pins end at their time or on release, in any order, and what
`pinned()` answers (each Put's commit asks) is always the live pins, never an earlier answer."""

from __future__ import annotations

import random

from kvstore.clock import ManualClock
from tiers.leases import LeaseTable


def test_leases_end_at_their_own_times_in_any_order() -> None:
    clock, rng = ManualClock(), random.Random(7)
    table = LeaseTable(clock)
    ends = {bytes([i]): rng.uniform(1, 50) for i in range(200)}
    for key, seconds in ends.items():
        table.grant(key, seconds)
    for t in range(0, 52, 3):
        assert table.pinned() == {k for k, end in ends.items() if end > t}, f"at {t} s"
        clock.advance(3)
    assert table.active() == 0


def test_a_released_lease_does_not_end_a_later_lease_on_the_same_key() -> None:
    clock = ManualClock()
    table = LeaseTable(clock)
    first = table.grant(b"k", 5)
    assert table.release(first.lease_id)
    table.grant(b"k", 20)  # the same key leased again, for longer
    clock.advance(10)  # past the released lease's time
    assert table.pinned() == {b"k"} and table.active() == 1
    clock.advance(11)
    assert table.pinned() == frozenset()


def test_pinned_follows_every_grant_release_and_expiry() -> None:
    clock = ManualClock()
    table = LeaseTable(clock)
    assert table.pinned() == frozenset()
    a = table.grant(b"a", 10)
    assert table.pinned() == {b"a"}
    table.grant_together([b"b", b"c"], 5)
    assert table.pinned() == {b"a", b"b", b"c"}
    table.grant_many([b"d"], 30)
    assert table.pinned() == {b"a", b"b", b"c", b"d"}
    clock.advance(6)
    assert table.pinned() == {b"a", b"d"}
    assert table.release(a.lease_id)
    assert table.pinned() == {b"d"}
