"""Retention rules that each broke once with the suite still green (issue 9): one test per wiring.

Each test here fails when the line it names is removed (docs/RETENTION.md
lists rule -> test). Time moves on a ManualClock; nothing sleeps.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.clock import ManualClock
from kvstore.errors import ResourceExhausted
from tiers.durable import OPEN, read_marker
from tiers.lmdb_tier import TOUCH_GRANULARITY_S

HOUR = 3600.0
PAST_RETENTION = 72 * HOUR + TOUCH_GRANULARITY_S + 1
Kit = Any  # tests/tiers/conftest.py


# -- R12: a Put never evicts what it names, nor the chain above it ------------------


def test_r12_put_keeps_the_parent_chain_it_extends(make_kit: Callable[..., Kit], clock: ManualClock) -> None:
    # Issue 9, item 1: blocks 0-1 stored, 100 h later the store is full, then a Put of
    # blocks 2-11 on parent 1. Blocks 0-1 are the least recently used, but the Put
    # extends them: the other chain must go instead.
    kit = make_kit(12)
    a = kit.chain(0, 12)
    kit.put(a, 0, 2)
    clock.advance(1)
    other = kit.chain(5000, 10)
    kit.put(other)  # the store is full
    clock.advance(100 * HOUR)
    assert kit.put(a, 2) == (10, 0)
    assert kit.stored(a) == [True] * 12
    assert kit.found(a) == 12
    assert kit.stored(other) == [False] * 10


def test_r12_put_keeps_the_blocks_it_reports_existing(kit: Kit, clock: ManualClock) -> None:
    # Issue 9, item 1: a 10-block chain re-put with its first 9 stored, the store full,
    # 100 h later. Block 8 is the least recently used leaf, but the Put names it.
    c = kit.chain(0, 10)
    kit.put(c, 0, 9)
    clock.advance(1)
    newer = kit.chain(5000, 1)
    kit.put(newer)  # the store is full
    clock.advance(100 * HOUR)
    assert kit.put(c) == (1, 9)
    assert kit.stored(c) == [True] * 10  # all it reported existing, and the new one
    assert kit.found(c) == 10
    assert kit.stored(newer) == [False]


def test_r12_a_full_store_refuses_rather_than_break_the_chain(make_kit: Callable[..., Kit], clock: ManualClock) -> None:
    kit = make_kit(12)
    a = kit.chain(0, 12)
    kit.put(a, 0, 2)
    clock.advance(100 * HOUR)
    kit.put(kit.chain(5000, 10))  # fresh blocks fill the store
    with pytest.raises(ResourceExhausted, match="this Put's chain"):
        kit.put(a, 2)
    assert kit.stored(a[:2]) == [True, True] and kit.found(a) == 2


# -- R5: every use restarts the retention clock ----------------------------------------


def test_r5_put_of_stored_blocks_restarts_retention(kit: Kit, clock: ManualClock) -> None:
    a, b = kit.chain(0, 5), kit.chain(1000, 5)
    kit.put(a)
    clock.advance(1)
    kit.put(b)
    clock.advance(40 * HOUR)
    assert kit.put(a) == (0, 5)  # a Put of stored blocks is a use of them
    clock.advance(40 * HOUR)  # a: 40 h since its use; b: 80 h
    kit.put(kit.chain(5000, 5))
    assert kit.stored(a) == [True] * 5
    assert kit.stored(b) == [False] * 5


# -- R3: the LRU index is persistent -----------------------------------------------------


def test_r3_eviction_order_survives_restart(make_kit: Callable[..., Kit], clock: ManualClock) -> None:
    kit = make_kit()
    chains = [kit.chain(1000 * i, 2) for i in range(5)]
    for c in chains:
        kit.put(c)
        clock.advance(HOUR)
    kit.tier.touch(kit.keys(chains[0]))  # chain 0 becomes the most recent
    kit.tier.close()
    again = make_kit()
    clock.advance(80 * HOUR)
    again.put(again.chain(9000, 4))  # the index read from disk says: chains 1 and 2 go
    assert [all(again.stored(c)) for c in chains] == [True, False, False, True, True]


# -- R7: a parent takes its child's time when the child goes -----------------------------


def test_r7_parent_takes_its_childs_time_when_the_child_goes(kit: Kit, clock: ManualClock) -> None:
    a = kit.chain(0, 2)
    kit.put(a)  # a[0] and a[1] used at T0
    clock.advance(HOUR)
    x = kit.chain(1000, 1)
    kit.put(x)  # T1
    clock.advance(HOUR)
    kit.tier.touch(kit.keys(a[1:]))  # a[1] used at T2: a[0] was in use with it
    clock.advance(HOUR)
    kit.put(kit.chain(2000, 7))  # full
    clock.advance(100 * HOUR)
    found, lease = kit.tier.lookup(kit.scope, x, lease_s=30)
    assert found == 1 and lease is not None
    kit.put(kit.chain(3000, 1))  # x is leased: a[1] goes, and a[0] takes its time T2
    assert kit.tier.leases.release(lease.lease_id)
    kit.put(kit.chain(4000, 1))  # x (T1) is now older than a[0] (T2)
    assert kit.stored(x) == [False]
    assert kit.stored(a) == [True, False]


# -- R1: durability, not just visibility -------------------------------------------------


def test_r1_every_commit_is_flushed_and_marked_before_the_put_returns(kit: Kit) -> None:
    # LMDB does not flush (R34: the tier does, outside its write lock); the marker names the durable commit.
    assert not kit.tier.env.flags()["sync"]
    for start in (0, 100, 200):
        kit.put(kit.chain(start, 2))
        last = kit.tier.env.info()["last_txnid"]
        assert read_marker(kit.tier.settings.data_dir) == (last, OPEN)


_PUT_UNDER_STRACE = textwrap.dedent("""
    import os, sys
    from kvstore.config import StoreSettings
    from tiers.lmdb_tier import LmdbBlockTier
    from kvstore.prefix import BlockScope, root_hash
    from kvstore.geometry import V4_1_FLASH
    from pathlib import Path
    tier = LmdbBlockTier(StoreSettings(data_dir=Path(sys.argv[1]), capacity_bytes=1 << 20, block_tokens=16))
    scope = BlockScope(V4_1_FLASH.fingerprint, "default")
    os.write(1, b"PUT-BEGIN\\n")
    tier.put(scope, root_hash(V4_1_FLASH.fingerprint, 16), [b"\\x07" * 32], [b"\\x01" * 1024], True)
    os.write(1, b"PUT-END\\n")
    tier.close()
""")


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_r1_put_syncs_the_file_before_it_returns(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    run = subprocess.run(["strace", "-f", "-qq", "-o", str(trace), "-e", "trace=write,pwrite64,fsync,fdatasync,msync",
                          sys.executable, "-c", _PUT_UNDER_STRACE, str(tmp_path / "store")],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    if run.returncode != 0 and "ptrace" in run.stderr:
        pytest.skip(f"strace cannot trace here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    calls = trace.read_text().splitlines()
    begin = next(i for i, line in enumerate(calls) if "PUT-BEGIN" in line)
    end = next(i for i, line in enumerate(calls) if "PUT-END" in line)
    during = calls[begin:end]
    wrote = [i for i, line in enumerate(during) if "pwrite64(" in line or " write(" in line.split("<")[0]]
    synced = [i for i, line in enumerate(during) if "fdatasync(" in line or "fsync(" in line or "msync(" in line]
    assert synced and wrote and max(synced) > min(wrote), "\n".join(during)


# -- R13: the retention clock is guarded ---------------------------------------------------


def test_r13_wall_clock_set_forward_does_not_age_blocks(kit: Kit, clock: ManualClock) -> None:
    kit.put(kit.chain(0, 10))  # full
    clock.jump(100 * HOUR)  # someone sets the wall clock 100 h ahead
    with pytest.raises(ResourceExhausted):
        kit.put(kit.chain(1000, 1))
    clock.advance(PAST_RETENTION)  # real time passes
    kit.put(kit.chain(1000, 1))


def test_r13_wall_clock_set_back_never_stamps_earlier(make_kit: Callable[..., Kit], clock: ManualClock) -> None:
    kit = make_kit()
    a, b, c = kit.chain(0, 1), kit.chain(1000, 1), kit.chain(2000, 1)
    kit.put(a)
    clock.jump(-10 * HOUR)
    kit.put(b)
    assert kit.meta(b[0]).last_access_s >= kit.meta(a[0]).last_access_s
    kit.tier.close()
    clock.jump(-10 * HOUR)  # and again while the server is down
    kit = make_kit()
    kit.put(c)
    assert kit.meta(c[0]).last_access_s >= kit.meta(b[0]).last_access_s


def test_r13_blocks_stamped_while_the_clock_runs_behind_keep_their_retention(kit: Kit, clock: ManualClock) -> None:
    old = kit.chain(0, 9)
    kit.put(old)  # at T
    clock.jump(-10 * HOUR)  # the wall clock is set 10 h back
    clock.advance(5 * HOUR)  # 5 h later the wall clock says T - 5 h
    new = kit.chain(1000, 1)
    kit.put(new)  # stamped T, not T - 5 h: it is younger than `old`, not older
    assert kit.meta(new[0]).last_access_s >= kit.meta(old[0]).last_access_s
    clock.advance(PAST_RETENTION + 3 * HOUR)  # past retention for a block stamped T - 5 h, not for T
    with pytest.raises(ResourceExhausted):
        kit.put(kit.chain(2000, 1))
    assert kit.stored(new) == [True]


def test_r13_time_while_the_server_is_down_does_not_age_blocks(make_kit: Callable[..., Kit],
                                                               clock: ManualClock) -> None:
    kit = make_kit()
    kit.put(kit.chain(0, 10))  # full
    kit.tier.close()
    clock.advance(100 * HOUR)  # down (a wall clock set forward while down looks the same)
    kit = make_kit()
    with pytest.raises(ResourceExhausted):
        kit.put(kit.chain(1000, 1))
    clock.advance(PAST_RETENTION)
    kit.put(kit.chain(1000, 1))


def test_r9_a_lease_runs_on_the_monotonic_clock(kit: Kit, clock: ManualClock) -> None:
    a = kit.chain(0, 2)
    kit.put(a)
    _, lease = kit.tier.lookup(kit.scope, a, lease_s=30)
    clock.jump(HOUR)
    assert kit.tier.leases.active() == 1
    clock.advance(31)
    assert kit.tier.leases.active() == 0
    assert lease is not None and not kit.tier.leases.release(lease.lease_id)


def test_r13_time_the_server_ran_before_a_restart_still_counts(make_kit: Callable[..., Kit],
                                                               clock: ManualClock) -> None:
    kit = make_kit()
    old = kit.chain(0, 10)
    kit.put(old)  # full
    clock.advance(PAST_RETENTION)  # running, idle: no write since
    kit.tier.close()  # persists the retention clock's high-water mark
    kit = make_kit()
    kit.put(kit.chain(1000, 1))  # `old` is past retention: its tail goes
    assert kit.stored(old) == [True] * 9 + [False]


def test_r5_lookup_names_the_deepest_found_block_when_due_a_refresh(kit: Kit, clock: ManualClock) -> None:
    a = kit.chain(0, 4)
    kit.put(a)
    due: list[bytes] = []
    assert kit.tier.lookup(kit.scope, a[:3], touch_due=due)[0] == 3
    assert due == []  # used within the touch granularity: nothing to write
    clock.advance(TOUCH_GRANULARITY_S + 1)
    kit.tier.lookup(kit.scope, a[:3], touch_due=due)
    assert due == kit.keys(a[2:3])
