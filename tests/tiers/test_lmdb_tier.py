"""The NVMe tier's storage rules, one test (or more) per rule of docs/RETENTION.md.

Time is moved with a ManualClock; nothing sleeps.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from kvstore.errors import ConfigError, FailedPrecondition, ResourceExhausted
from kvstore.geometry import V4_1_FLASH
from kvstore.native.records import BlockMeta, data_key
from kvstore.prefix import BlockScope, chain_hashes, root_hash
from tiers.block_txn import read_meta
from tiers.lmdb_tier import TOUCH_GRANULARITY_S, LmdbBlockTier, ReadStatus

HOUR = 3600.0
BLOCK = 1024  # the tier stores opaque bytes; sizes are checked at the gateway


@pytest.fixture
def settings(tmp_path: os.PathLike[str]) -> StoreSettings:
    return StoreSettings(data_dir=tmp_path / "store", capacity_bytes=10 * BLOCK, block_tokens=16)  # type: ignore[operator]


@pytest.fixture
def tier(settings: StoreSettings, clock: ManualClock) -> Iterator[LmdbBlockTier]:
    t = LmdbBlockTier(settings, clock=clock)
    yield t
    if not t.executor._shutdown:  # closed by a restart test already
        t.close()


SCOPE = BlockScope(V4_1_FLASH.fingerprint, "default")
ROOT = root_hash(V4_1_FLASH.fingerprint, 16)


def chain(seed: int, n: int) -> list[bytes]:
    """Hashes of a chain of n blocks whose tokens start at `seed`."""
    return chain_hashes(list(range(seed, seed + 16 * n)), block_tokens=16, parent=ROOT)


def data(i: int) -> bytes:
    return bytes([i % 256]) * BLOCK


def put_chain(tier: LmdbBlockTier, hashes: list[bytes], start: int = 0) -> None:
    parent = ROOT if start == 0 else hashes[start - 1]
    tier.put(SCOPE, parent, hashes[start:], [data(i) for i in range(start, len(hashes))], start == 0)


def meta_of(tier: LmdbBlockTier, txn: Any, block_hash: bytes) -> BlockMeta:
    meta = read_meta(txn, tier._dbs, SCOPE.key(block_hash))
    assert meta is not None
    return meta


def stored(tier: LmdbBlockTier, hashes: list[bytes]) -> list[bool]:
    return [s is ReadStatus.FOUND for s, _ in tier.read([SCOPE.key(h) for h in hashes])]


def test_r1_put_is_durable_when_acknowledged(tier: LmdbBlockTier, settings: StoreSettings) -> None:
    hashes = chain(0, 3)
    put_chain(tier, hashes)
    # Another process opening the files sees the commit: it reached the file.
    script = (
        "import lmdb, sys\n"
        f"env = lmdb.open({str(settings.data_dir)!r}, readonly=True, lock=False, max_dbs=8)\n"
        "with env.begin() as txn:\n"
        "    db = env.open_db(b'records', txn=txn, create=False)\n"
        "    for key in sys.argv[1:]:\n"
        "        print(len(txn.get(bytes.fromhex(key), db=db) or b''))\n"
    )
    out = subprocess.run([sys.executable, "-c", script, *(data_key(SCOPE.key(h)).hex() for h in hashes)],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(BLOCK)] * 3


def test_r2_checksum_verified_on_every_read(tier: LmdbBlockTier) -> None:
    hashes = chain(0, 3)
    put_chain(tier, hashes)
    with tier.env.begin(write=True) as txn:
        txn.put(data_key(SCOPE.key(hashes[1])), b"\xff" + data(1)[1:], db=tier._records)
    results = tier.read([SCOPE.key(h) for h in hashes])
    assert [s for s, _ in results] == [ReadStatus.FOUND, ReadStatus.CORRUPT, ReadStatus.FOUND]
    assert results[1][1] is None
    assert tier.stats().counters.corrupt_blocks == 1


def test_r3_index_survives_restart(settings: StoreSettings, clock: ManualClock) -> None:
    tier = LmdbBlockTier(settings, clock=clock)
    hashes = chain(0, 4)
    put_chain(tier, hashes)
    tier.close()
    again = LmdbBlockTier(settings, clock=clock)
    try:
        assert again.lookup(SCOPE, hashes)[0] == 4
        stats = again.stats()
        assert (stats.blocks_stored, stats.bytes_stored) == (4, 4 * BLOCK)
        assert stats.counters.blocks_written == 4
    finally:
        again.close()


def test_r4_retention_floor_cannot_be_lowered(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(ConfigError, match="72"):
        StoreSettings(data_dir=tmp_path, retention_hours=71.9)  # type: ignore[arg-type]
    assert StoreSettings(data_dir=tmp_path, retention_hours=96).retention_s == 96 * HOUR  # type: ignore[arg-type]


def test_r4_no_eviction_within_retention(tier: LmdbBlockTier, clock: ManualClock) -> None:
    old = chain(0, 10)
    put_chain(tier, old)  # fills the store
    clock.advance(72 * HOUR - 1)
    with pytest.raises(ResourceExhausted, match="retention"):
        put_chain(tier, chain(1000, 1))
    assert all(stored(tier, old))


def test_r4_eviction_allowed_after_retention(tier: LmdbBlockTier, clock: ManualClock) -> None:
    old = chain(0, 10)
    put_chain(tier, old)
    clock.advance(72 * HOUR + TOUCH_GRANULARITY_S - 1)
    with pytest.raises(ResourceExhausted):  # within the touch granularity: still protected
        put_chain(tier, chain(1000, 2))
    clock.advance(2)
    put_chain(tier, chain(1000, 2))
    assert stored(tier, old) == [True] * 8 + [False] * 2  # the tail went, the prefix stayed
    assert tier.stats().counters.evictions == 2


def test_r5_read_restarts_retention(tier: LmdbBlockTier, clock: ManualClock) -> None:
    a, b = chain(0, 5), chain(1000, 5)
    put_chain(tier, a)
    put_chain(tier, b)
    clock.advance(40 * HOUR)
    tier.touch([SCOPE.key(h) for h in a])  # a Get of chain a
    clock.advance(40 * HOUR)  # b is 80 h old, a 40 h since its read
    put_chain(tier, chain(5000, 5))
    assert all(stored(tier, a))
    assert not any(stored(tier, b))


def test_r5_read_of_tail_protects_prefix(tier: LmdbBlockTier, clock: ManualClock) -> None:
    a, b = chain(0, 5), chain(1000, 5)
    put_chain(tier, a)
    put_chain(tier, b)
    clock.advance(40 * HOUR)
    tier.touch([SCOPE.key(a[-1])])  # only the tail of a is read
    clock.advance(40 * HOUR)
    with pytest.raises(ResourceExhausted):
        put_chain(tier, chain(5000, 6))  # needs one block of a: its prefix is protected by the tail
    put_chain(tier, chain(5000, 5))
    assert all(stored(tier, a))


def test_r6_put_needs_stored_parent(tier: LmdbBlockTier) -> None:
    hashes = chain(0, 4)
    with pytest.raises(FailedPrecondition, match="put the prefix first"):
        put_chain(tier, hashes, start=2)
    assert tier.stats().blocks_stored == 0


def test_r6_eviction_never_leaves_a_hole(tier: LmdbBlockTier, clock: ManualClock) -> None:
    trunk = chain(0, 6)
    put_chain(tier, trunk)
    branch = chain_hashes(list(range(900, 900 + 32)), block_tokens=16, parent=trunk[2])
    tier.put(SCOPE, trunk[2], branch, [data(7), data(8)], False)
    clock.advance(100 * HOUR)
    put_chain(tier, chain(5000, 8))  # must evict 6 of the 8 old blocks
    kept_trunk = stored(tier, trunk)
    assert kept_trunk == sorted(kept_trunk, reverse=True)  # stored blocks form a prefix
    assert tier.lookup(SCOPE, trunk)[0] == sum(kept_trunk)


def test_r7_least_recently_used_goes_first(tier: LmdbBlockTier, clock: ManualClock) -> None:
    chains = [chain(1000 * i, 2) for i in range(5)]
    for c in chains:
        put_chain(tier, c)
        clock.advance(HOUR)
    tier.touch([SCOPE.key(h) for h in chains[0]])  # chain 0 becomes the most recent
    clock.advance(80 * HOUR)
    put_chain(tier, chain(9000, 4))  # evicts two whole chains: the least recently used, 1 and 2
    assert [all(stored(tier, c)) for c in chains] == [True, False, False, True, True]


def test_r8_full_of_protected_blocks_rejects_and_stores_nothing(tier: LmdbBlockTier) -> None:
    put_chain(tier, chain(0, 9))
    before = tier.stats()
    with pytest.raises(ResourceExhausted):
        put_chain(tier, chain(1000, 3))
    after = tier.stats()
    assert (after.blocks_stored, after.bytes_stored) == (before.blocks_stored, before.bytes_stored)
    assert after.counters.rejected_puts == 1
    assert tier.lookup(SCOPE, chain(1000, 3))[0] == 0


def test_r9_lease_pins_prefix_until_released(tier: LmdbBlockTier, clock: ManualClock) -> None:
    a = chain(0, 10)
    put_chain(tier, a)
    clock.advance(100 * HOUR)
    found, lease = tier.lookup(SCOPE, a[:5], lease_s=30)
    assert found == 5 and lease is not None
    put_chain(tier, chain(1000, 5))  # evicts a[5:], not the leased a[:5]
    with pytest.raises(ResourceExhausted):
        put_chain(tier, chain(2000, 1))
    assert tier.leases.release(lease.lease_id)
    put_chain(tier, chain(2000, 1))
    assert stored(tier, a[:5]) == [True] * 4 + [False]


def test_r9_lease_expires_on_its_own(tier: LmdbBlockTier, clock: ManualClock) -> None:
    a = chain(0, 10)
    put_chain(tier, a)
    clock.advance(100 * HOUR)
    tier.lookup(SCOPE, a, lease_s=30)
    with pytest.raises(ResourceExhausted):
        put_chain(tier, chain(1000, 1))
    clock.advance(31)
    assert tier.leases.active() == 0
    put_chain(tier, chain(1000, 1))


def test_r10_corrupt_block_removed_with_descendants(tier: LmdbBlockTier) -> None:
    hashes = chain(0, 5)
    put_chain(tier, hashes)
    with tier.env.begin(write=True) as txn:
        txn.put(data_key(SCOPE.key(hashes[2])), data(99), db=tier._records)
    assert tier.read([SCOPE.key(hashes[2])])[0][0] is ReadStatus.CORRUPT
    assert tier.lookup(SCOPE, hashes)[0] == 2
    assert tier.stats().blocks_stored == 2
    put_chain(tier, hashes, start=2)  # the prefix can be completed again
    assert tier.lookup(SCOPE, hashes)[0] == 5


def test_r5_reads_within_a_minute_are_not_rewritten(tier: LmdbBlockTier, clock: ManualClock) -> None:
    hashes = chain(0, 2)
    put_chain(tier, hashes)
    keys = [SCOPE.key(h) for h in hashes]
    before = tier.env.info()["last_txnid"]
    clock.advance(TOUCH_GRANULARITY_S - 1)
    tier.touch(keys)
    assert tier.env.info()["last_txnid"] == before  # nothing written
    clock.advance(2)
    tier.touch(keys)
    assert tier.env.info()["last_txnid"] == before + 1


def test_r5_touch_soon_groups_reads_into_one_commit(tier: LmdbBlockTier, clock: ManualClock) -> None:
    a, b = chain(0, 2), chain(1000, 2)
    put_chain(tier, a)
    put_chain(tier, b)
    clock.advance(HOUR)
    futures = [tier.touch_soon([SCOPE.key(h) for h in c]) for c in (a, b)]
    for f in futures:
        f.result(timeout=10)
    with tier.env.begin() as txn:
        times = {meta_of(tier, txn, h).last_access_s for h in a + b}
    assert times == {clock.now()}


def test_r11_stats_report_headroom(tier: LmdbBlockTier, clock: ManualClock) -> None:
    assert tier.stats().headroom_hours == float("inf")
    put_chain(tier, chain(0, 4))
    clock.advance(HOUR)
    s = tier.stats()
    assert s.bytes_free == 6 * BLOCK
    assert s.write_rate_bytes_per_s == pytest.approx(4 * BLOCK / HOUR)
    assert s.headroom_hours == pytest.approx(1.5)


def test_tenants_never_share_blocks(tier: LmdbBlockTier) -> None:
    hashes = chain(0, 2)
    put_chain(tier, hashes)
    other = BlockScope(V4_1_FLASH.fingerprint, "other-tenant")
    assert tier.lookup(other, hashes)[0] == 0
    assert [s for s, _ in tier.read([other.key(h) for h in hashes])] == [ReadStatus.MISSING] * 2


def test_put_is_idempotent(tier: LmdbBlockTier) -> None:
    hashes = chain(0, 3)
    put_chain(tier, hashes)
    result = tier.put(SCOPE, ROOT, hashes, [data(i) for i in range(3)], True)
    assert (result.written_blocks, result.existing_blocks) == (0, 3)
    assert tier.stats().bytes_stored == 3 * BLOCK


def test_lookup_counts_contiguous_prefix(tier: LmdbBlockTier, settings: StoreSettings) -> None:
    hashes = chain(0, 7)
    put_chain(tier, hashes[:4])
    assert tier.lookup(SCOPE, hashes)[0] == 4
    assert tier.lookup(SCOPE, hashes[:2])[0] == 2
    assert tier.lookup(SCOPE, chain(50, 3))[0] == 0
    c = tier.stats().counters
    assert (c.lookup_tokens_asked, c.lookup_tokens_found) == (12 * 16, 6 * 16)



def test_r1_group_commit_is_all_or_nothing(tier: LmdbBlockTier) -> None:
    from tiers.lmdb_tier import PutBatch

    good, other = chain(0, 2), chain(1000, 2)
    batches = [PutBatch(scope=SCOPE, parent_hash=ROOT, hashes=good, blocks=[data(0), data(1)], is_root=True),
               PutBatch(scope=SCOPE, parent_hash=other[0], hashes=other[1:], blocks=[data(2)], is_root=False)]
    with pytest.raises(FailedPrecondition):
        tier.put_many(batches)  # the second batch's parent is missing: neither is stored
    assert tier.lookup(SCOPE, good)[0] == 0 and tier.stats().blocks_stored == 0
    extend = PutBatch(scope=SCOPE, parent_hash=good[1], hashes=chain(0, 3)[2:], blocks=[data(2)], is_root=False)
    results = tier.put_many([batches[0], extend])
    assert [r.written_blocks for r in results] == [2, 1]
    assert tier.lookup(SCOPE, chain(0, 3))[0] == 3 and tier.stats().counters.puts == 2


def test_a_blocks_records_sit_together(tier: LmdbBlockTier) -> None:
    # Data, meta and child entries of a block sort side by side (one leaf page per
    # stored block rather than one in each of three trees): kvstore/native/records.py.
    hashes = chain(0, 3)
    put_chain(tier, hashes)
    with tier.env.begin() as txn:
        keys = [bytes(k) for k in txn.cursor(db=tier._records).iternext(values=False)]
    middle = SCOPE.key(hashes[1])
    owned = [i for i, k in enumerate(keys) if k.startswith(middle)]
    assert [keys[i][len(middle):] for i in owned] == [b"c" + hashes[2], b"d", b"m"]
    assert owned == list(range(owned[0], owned[0] + 3)), "contiguous"


def test_a_store_in_the_older_layout_is_refused(settings: StoreSettings) -> None:
    import lmdb

    from kvstore.errors import ConfigError

    settings.data_dir.mkdir(parents=True)
    env = lmdb.open(str(settings.data_dir), max_dbs=8)
    env.open_db(b"meta")
    env.close()
    with pytest.raises(ConfigError, match="older on-disk layout"):
        LmdbBlockTier(settings)
