"""`kvstore check --repair` rewrites the usage of each tenant and geometry from what is stored
(docs/RETENTION.md R33; tiers/integrity_usage.py): real LMDB, the records damaged behind the store's back."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import lmdb
import pytest

from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from kvstore.geometry import V4_1_FLASH
from kvstore.native.records import BlockMeta, child_key, data_key, lru_key, meta_key
from kvstore.prefix import BlockScope, chain_hashes, namespace_id, root_hash
from tiers import pins
from tiers.integrity import check_store
from tiers.lmdb_tier import LmdbBlockTier
from tiers.namespaces import NAMESPACE_PREFIX, NamespaceTotals
from tiers.usage import LAYOUT_USAGE_PREFIX

ROOT = root_hash(V4_1_FLASH.fingerprint, 16)
ALPHA, BETA = BlockScope(V4_1_FLASH.fingerprint, "alpha"), BlockScope(V4_1_FLASH.fingerprint, "beta")
LENGTH, SIZE, HOUR = 5, 1024, 3600.0


def _chain(seed: int) -> list[bytes]:
    return chain_hashes(list(range(seed * 1000, seed * 1000 + 16 * LENGTH)), block_tokens=16, parent=ROOT)


@pytest.fixture
def store(tmp_path: Path) -> tuple[StoreSettings, dict[str, list[list[bytes]]]]:
    """A closed store: three chains of alpha's (one pinned) and two of beta's, 10 hours of running time."""
    settings = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=1 << 24, block_tokens=16,
                             pin_max_hours=100.0, pin_budget_bytes=1 << 22)
    clock = ManualClock()
    tier = LmdbBlockTier(settings, clock=clock)
    chains: dict[str, list[list[bytes]]] = {"alpha": [], "beta": []}
    for i, scope in enumerate([ALPHA, ALPHA, ALPHA, BETA, BETA]):
        hashes = _chain(i)
        tier.put(scope, ROOT, hashes, [os.urandom(SIZE) for _ in hashes], True)
        chains[scope.namespace].append(hashes)
    assert tier.pin(ALPHA, chains["alpha"][0][-1], clock.now() + 50 * HOUR).until_s
    clock.advance(10 * HOUR)
    tier.put(BETA, ROOT, _chain(9)[:1], [os.urandom(SIZE)], True)  # a write: the clock's high-water mark moves
    chains["beta"].append(_chain(9)[:1])
    tier.close()
    return settings, chains


def _state(settings: StoreSettings) -> dict[bytes, bytes]:
    env = lmdb.open(str(settings.data_dir), max_dbs=8, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor(db=env.open_db(b"state", txn=txn))}
    finally:
        env.close()


def _tenant(state: dict[bytes, bytes], name: str) -> NamespaceTotals:
    totals = NamespaceTotals.unpack(state[NAMESPACE_PREFIX + namespace_id(name)])
    assert totals is not None
    return totals


def test_r33_a_repair_rewrites_each_tenants_usage_from_what_is_stored(
        store: tuple[StoreSettings, dict[str, list[list[bytes]]]]) -> None:
    """Alpha's usage record says too much, beta's last block is deleted behind its back (records, index entry and
    its parent's child entry: nothing else is wrong with the store), the geometry's record is gone and alpha's pin
    totals are wrong. A check names each; a repair leaves every tenant's blocks, bytes and pinned bytes as stored,
    alpha's token-hours kept, and a check after it finds nothing."""
    settings, chains = store
    before = _state(settings)
    env = lmdb.open(str(settings.data_dir), max_dbs=8)
    with env.begin(write=True) as txn:
        records, lru, state = (env.open_db(n, txn=txn) for n in (b"records", b"lru", b"state"))
        wrong = _tenant(before, "alpha")
        wrong.blocks, wrong.stored_bytes, wrong.block_seconds = 999, 999 * SIZE, 12345.0
        txn.put(NAMESPACE_PREFIX + namespace_id("alpha"), wrong.pack(), db=state)
        tail = BETA.key(chains["beta"][0][-1])
        meta = BlockMeta.unpack(txn.get(meta_key(tail), db=records))
        for key in (data_key(tail), meta_key(tail), child_key(BETA.key(chains["beta"][0][-2]), chains["beta"][0][-1])):
            assert txn.delete(key, db=records)
        assert txn.delete(lru_key(meta.last_access_s, meta.depth, tail), db=lru)
        stored_blocks = 3 * LENGTH + 2 * LENGTH + 1 - 1
        txn.put(b"usage", struct.pack("<QQ", stored_blocks, stored_blocks * SIZE), db=state)  # the totals agree
        assert txn.delete(LAYOUT_USAGE_PREFIX + V4_1_FLASH.fingerprint, db=state)
        txn.put(b"n" + namespace_id("alpha"), struct.pack("<IQ", 3, 7), db=env.open_db(pins.PINS_DB, txn=txn))
    env.close()

    report = check_store(settings.data_dir, repair=False)
    assert report.counts == {"namespace-usage-mismatch": 2, "layout-usage-mismatch": 1, "pin-totals-mismatch": 1}
    assert check_store(settings.data_dir, repair=True).repaired
    assert check_store(settings.data_dir, repair=False).ok

    after = _state(settings)  # read raw: a tier's open would recount a store this small by itself (R17)
    alpha, beta = _tenant(after, "alpha"), _tenant(after, "beta")
    assert (alpha.blocks, alpha.stored_bytes) == (3 * LENGTH, 3 * LENGTH * SIZE)
    assert (beta.blocks, beta.stored_bytes) == (2 * LENGTH, 2 * LENGTH * SIZE)  # 2 chains less a block, plus one
    # Its token-hours are history: kept, integrated (at the count it said) up to the clock's high-water mark.
    assert alpha.block_seconds == pytest.approx(12345.0 + 999 * 10 * HOUR, rel=1e-6) and alpha.name == "alpha"
    layout = struct.unpack("<QQ", after[LAYOUT_USAGE_PREFIX + V4_1_FLASH.fingerprint])
    assert layout == (stored_blocks, stored_blocks * SIZE)
    tier = LmdbBlockTier(settings, clock=ManualClock())
    try:
        totals, held = tier.pins_of("alpha")
        assert (totals.pins, totals.charged_bytes) == (1, LENGTH * SIZE)  # the pinned prefix, charged once
        assert [p.key for p in held] == [ALPHA.key(chains["alpha"][0][-1])]
        assert (tier.namespace_usage("beta").blocks, tier.namespace_usage("beta").stored_bytes) == (
            2 * LENGTH, 2 * LENGTH * SIZE)
    finally:
        tier.close()


def test_r33_a_tenant_record_lost_or_left_over_is_rewritten(
        store: tuple[StoreSettings, dict[str, list[list[bytes]]]]) -> None:
    """Beta's record is deleted and a record of a tenant that stores nothing says it holds blocks: the repair
    gives beta a record counting its blocks, with the time they have been stored for, and the other zero blocks."""
    settings, _ = store
    ghost = namespace_id("ghost")
    env = lmdb.open(str(settings.data_dir), max_dbs=8)
    with env.begin(write=True) as txn:
        state = env.open_db(b"state", txn=txn)
        assert txn.delete(NAMESPACE_PREFIX + namespace_id("beta"), db=state)
        txn.put(NAMESPACE_PREFIX + ghost, NamespaceTotals(blocks=4, stored_bytes=4 * SIZE, name="ghost").pack(),
                db=state)
    env.close()
    assert check_store(settings.data_dir, repair=False).counts == {"namespace-usage-mismatch": 2}
    assert check_store(settings.data_dir, repair=True).repaired
    assert check_store(settings.data_dir, repair=False).ok
    after = _state(settings)
    beta = _tenant(after, "beta")
    assert (beta.blocks, beta.stored_bytes) == (2 * LENGTH + 1, (2 * LENGTH + 1) * SIZE)
    assert beta.block_seconds == pytest.approx(2 * LENGTH * 10 * HOUR, rel=1e-6)  # stored 10 h, the last just now
    assert (_tenant(after, "ghost").blocks, _tenant(after, "ghost").stored_bytes) == (0, 0)
