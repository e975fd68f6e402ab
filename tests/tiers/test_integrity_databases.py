"""`kvstore check --repair` and the databases that name blocks: pins (R30), the run index (F16), the event log.

A store written by a real tier with pins, a run index and events on; damage done to data.mdb's bytes
(a flipped byte of a block's data: the page reads, the checksum fails, the repair is in place; a zeroed
leaf: the page is lost, the file is rebuilt); the store reopened by the tier and its event log replayed
and decoded with kvstore's own decoder (`kvstore.events.wire.decode`), as a consumer would after the restart.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest

pytest.importorskip("msgspec", reason="msgspec is not installed (pip install 'kvstore[events]')")
pytest.importorskip("zmq", reason="pyzmq is not installed (pip install 'kvstore[events]')")

from kvstore.clock import ManualClock
from kvstore.config import EventsSettings, StoreSettings
from kvstore.events import wire
from kvstore.geometry import V4_1_FLASH
from kvstore.native.records import BlockMeta, child_key, data_key, lru_key, meta_key
from kvstore.prefix import BlockScope, chain_hashes, namespace_id, root_hash
from tiers import pins, run_index
from tiers.events import tenant_topic
from tiers.integrity import check_store
from tiers.lmdb_tier import LmdbBlockTier

SCOPE = BlockScope(V4_1_FLASH.fingerprint, "default")
ROOT = root_hash(V4_1_FLASH.fingerprint, 16)
CHAINS, LENGTH, SIZE, RUN = 8, 6, 1024, 2
PINNED = (0, 3, 5, 7)  # chains whose last block (so their whole prefix) is pinned
EVENTS = EventsSettings(enabled=True, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
HOUR = 3600.0
NS = namespace_id("default")


def _settings(data_dir: Path) -> StoreSettings:
    return StoreSettings(data_dir=data_dir, capacity_bytes=1 << 24, block_tokens=16, pin_max_hours=24.0,
                         pin_budget_bytes=1 << 30)


def _open(data_dir: Path, clock: ManualClock) -> LmdbBlockTier:
    tier = LmdbBlockTier(_settings(data_dir), clock=clock)
    tier.publish_events(EVENTS, "node-1")
    return tier


Store = tuple[Path, list[list[bytes]], dict[bytes, bytes], ManualClock]


@pytest.fixture
def store(tmp_path: Path) -> Store:
    """A closed store of CHAINS chains of LENGTH blocks: events on, a run index of RUN blocks a run,
    the chains in PINNED pinned for 10 h."""
    clock = ManualClock()
    data_dir = tmp_path / "store"
    tier = _open(data_dir, clock)
    run_index.enable(tier.env, RUN)
    chains: list[list[bytes]] = []
    blocks: dict[bytes, bytes] = {}
    for c in range(CHAINS):
        hashes = chain_hashes(list(range(c * 1000, c * 1000 + 16 * LENGTH)), block_tokens=16, parent=ROOT)
        data = [os.urandom(SIZE) for _ in hashes]
        blocks.update(zip(hashes, data, strict=True))
        result = tier.put(SCOPE, ROOT, hashes, data, True,
                          keep_until_s=clock.now() + 10 * HOUR if c in PINNED else None)
        assert c not in PINNED or (result.pin is not None and result.pin.until_s > 0)
        chains.append(hashes)
    tier.close()
    return data_dir, chains, blocks, clock


def flip_data_byte(data_dir: Path, data: bytes) -> None:
    """Flip a byte in the middle of every copy of a block's data in data.mdb (the page still reads)."""
    path = data_dir / "data.mdb"
    raw = path.read_bytes()
    at = raw.find(data)
    assert at >= 0
    with path.open("r+b") as f:
        while at >= 0:
            f.seek(at + SIZE // 2)
            f.write(bytes([raw[at + SIZE // 2] ^ 0xFF]))
            at = raw.find(data, at + 1)


def pinned_view(data_dir: Path, clock: ManualClock) -> tuple[pins.PinTotals, set[bytes], set[bytes]]:
    """Reopened by the tier: (the tenant's pin totals as recorded, not recounted; the keys its live pins
    hold; the run roots the run index lists)."""
    tier = _open(data_dir, clock)
    try:
        live = tier.pins_of("default")[1]
        with tier.env.begin() as txn:
            recorded = pins.totals(txn, tier.env.open_db(pins.PINS_DB, txn=txn), NS)
        runs = {r.key for r in run_index.list_runs(tier.env)}
        return recorded, {p.key for p in live}, runs
    finally:
        tier.close()


def _found(data_dir: Path, chains: list[list[bytes]], clock: ManualClock) -> list[int]:
    tier = _open(data_dir, clock)
    try:
        return [tier.lookup(SCOPE, hashes)[0] for hashes in chains]
    finally:
        tier.close()


def _expected_pins(chains: list[list[bytes]], found: list[int]) -> tuple[set[bytes], int]:
    """The pins the found prefixes keep and the bytes they charge."""
    keys = {SCOPE.key(chains[c][-1]) for c in PINNED if found[c] == LENGTH}
    return keys, len(keys) * LENGTH * SIZE


def _expected_runs(chains: list[list[bytes]], found: list[int]) -> set[bytes]:
    return {SCOPE.key(chain[i]) for chain, n in zip(chains, found, strict=True) for i in range(0, n, RUN)}


def _replay(data_dir: Path, clock: ManualClock) -> tuple[list[tuple[int, bytes, wire.KVEventBatch]], set[bytes]]:
    """Restart the tier with events on and replay its whole log as a consumer does: (the batches, the
    blocks the consumer then believes stored)."""
    tier = _open(data_dir, clock)
    try:
        assert tier.events is not None
        batches = [(b.seq, b.topic, wire.decode(b.payload)) for b in tier.events.read_from(0)]
    finally:
        tier.close()
    view: set[bytes] = set()
    for _, _, batch in batches:
        for event in batch.events:
            if isinstance(event, wire.AllBlocksCleared):
                view.clear()
            elif isinstance(event, wire.BlockStored):
                view.update(event.block_hashes)
            else:
                view.difference_update(event.block_hashes)
    return batches, view


def test_a_sound_store_with_pins_runs_and_events_checks_ok(store: Store) -> None:
    data_dir, _, _, _ = store
    report = check_store(data_dir, repair=False)
    assert report.ok, report.lines()


def test_r30_an_in_place_repair_drops_the_pins_of_the_blocks_it_drops(store: Store) -> None:
    data_dir, chains, blocks, clock = store
    flip_data_byte(data_dir, blocks[chains[3][2]])
    report = check_store(data_dir, repair=False)
    assert report.counts["damaged-block"] == 1 and report.pins_dropped == 1
    assert "1 pin" in " ".join(report.lines())
    report = check_store(data_dir, repair=True)
    assert report.repaired and not report.not_carried, report.lines()
    assert check_store(data_dir, repair=False).ok
    found = _found(data_dir, chains, clock)
    assert found[3] == 2 and found.count(LENGTH) == CHAINS - 1
    keys, charged = _expected_pins(chains, found)
    recorded, live, _ = pinned_view(data_dir, clock)
    assert live == keys and SCOPE.key(chains[3][-1]) not in live
    assert recorded == pins.PinTotals(pins=len(keys), charged_bytes=charged)  # the budget no longer charged


def test_an_in_place_repair_drops_the_run_entries_of_the_blocks_it_drops(store: Store) -> None:
    data_dir, chains, blocks, clock = store
    flip_data_byte(data_dir, blocks[chains[6][1]])
    report = check_store(data_dir, repair=True)
    assert report.repaired and report.run_entries_dropped == 2  # the runs starting at blocks 2 and 4
    assert check_store(data_dir, repair=False).ok
    found = _found(data_dir, chains, clock)
    assert found[6] == 1
    assert pinned_view(data_dir, clock)[2] == _expected_runs(chains, found)


def test_e9_a_repairs_removals_are_logged_and_replayed_after_the_restart(store: Store) -> None:
    data_dir, chains, blocks, clock = store
    before, _ = _replay(data_dir, clock)
    flip_data_byte(data_dir, blocks[chains[4][2]])
    report = check_store(data_dir, repair=True)
    assert report.removal_batches == 1, report.lines()
    batches, view = _replay(data_dir, clock)
    assert [b[0] for b in batches] == list(range(len(before) + 1))  # numbers go on (E3)
    _, topic, last = batches[-1]
    assert topic == tenant_topic("kv-events", "default")
    [event] = last.events
    assert isinstance(event, wire.BlockRemoved) and event.kvstore_node == "node-1"
    assert event.block_hashes == chains[4][2:][::-1]  # children before parents
    assert event.kvstore_tenant == "default" and event.kvstore_geometry == V4_1_FLASH.fingerprint.hex()
    found = _found(data_dir, chains, clock)
    assert view == {h for chain, n in zip(chains, found, strict=True) for h in chain[:n]}


def _kvstore(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


def _remove_leaf_records(data_dir: Path, key: bytes) -> None:
    """Remove a leaf block's records, index entries and run entry, leaving its pin: a block gone without it."""
    env = lmdb.open(str(data_dir), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            records, lru, runs = (env.open_db(n, txn=txn) for n in (b"records", b"lru", b"runs"))
            raw = txn.get(meta_key(key), db=records)
            assert raw is not None
            meta = BlockMeta.unpack(raw)
            for k in (data_key(key), meta_key(key), child_key(key[:16] + meta.parent_hash, key[16:])):
                assert txn.delete(k, db=records)
            assert txn.delete(lru_key(meta.last_access_s, meta.depth, key), db=lru)
            txn.delete(key, db=runs)
    finally:
        env.close()


def test_check_reports_a_pin_whose_block_is_missing_and_repair_drops_it(store: Store) -> None:
    data_dir, chains, _, clock = store
    _remove_leaf_records(data_dir, SCOPE.key(chains[0][-1]))
    run = _kvstore("check", "--data-dir", str(data_dir), "--json")
    assert run.returncode == 1, run.stderr
    counts = json.loads(run.stdout)["counts"]
    assert counts["orphan-pin"] == 1 and "damaged-block" not in counts
    run = _kvstore("check", "--data-dir", str(data_dir))
    assert "orphan-pin: 1" in run.stdout and "pins a block that is not stored" in run.stdout
    run = _kvstore("check", "--data-dir", str(data_dir), "--repair", "--no-progress")
    assert run.returncode == 0, run.stdout + run.stderr
    assert _kvstore("check", "--data-dir", str(data_dir)).returncode == 0
    found = _found(data_dir, chains, clock)
    keys, charged = _expected_pins(chains, found)
    recorded, live, _ = pinned_view(data_dir, clock)
    assert live == keys and len(keys) == len(PINNED) - 1
    assert recorded == pins.PinTotals(pins=len(keys), charged_bytes=charged)


def test_r30_the_pins_a_repair_drops_are_audited(store: Store) -> None:
    """`kvstore check --repair` writes one `pin-dropped` entry per pin it dropped to the store's audit log (the one
    `kvstore policy log` reads), under the tenant's name, with the block, its time and the bytes it charged."""
    from gateway.admin_servicer import ADMIN_DIR
    from gateway.audit import AuditLog
    from gateway.repair_audit import REPAIR_ACTOR

    data_dir, chains, _, clock = store
    key = SCOPE.key(chains[0][-1])
    tier = _open(data_dir, clock)
    try:
        pin = next(p for p in tier.pins_of("default")[1] if p.key == key)
    finally:
        tier.close()
    _remove_leaf_records(data_dir, key)
    run = _kvstore("check", "--data-dir", str(data_dir), "--repair", "--no-progress", "--json")
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads(run.stdout)["dropped_pins"] == [{"tenant": "default", "block": chains[0][-1].hex(),
                                                       "until_s": pin.until_s, "charged_bytes": pin.charged_bytes}]
    entries = [e for e in AuditLog(data_dir / ADMIN_DIR).entries(tenant="default") if e.action == "pin-dropped"]
    assert [(e.actor, e.old) for e in entries] == [
        (REPAIR_ACTOR, {"block": chains[0][-1].hex(), "until_s": pin.until_s, "charged_bytes": pin.charged_bytes})]


def test_check_reports_pin_totals_that_differ_from_the_pins(store: Store) -> None:
    data_dir, chains, _, clock = store
    env = lmdb.open(str(data_dir), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"n" + NS, struct.pack("<IQ", 99, 1 << 40), db=env.open_db(pins.PINS_DB, txn=txn))
    env.close()
    assert check_store(data_dir, repair=False).counts == {"pin-totals-mismatch": 1}
    assert check_store(data_dir, repair=True).repaired
    assert check_store(data_dir, repair=False).ok
    keys, charged = _expected_pins(chains, [LENGTH] * CHAINS)
    assert pinned_view(data_dir, clock)[0] == pins.PinTotals(pins=len(keys), charged_bytes=charged)


def test_check_reports_run_entries_that_point_nowhere(store: Store) -> None:
    data_dir, chains, _, clock = store
    env = lmdb.open(str(data_dir), max_dbs=8)
    with env.begin(write=True) as txn:
        runs = env.open_db(run_index.RUNS_DB, txn=txn)
        txn.put(SCOPE.key(b"\x07" * 32), struct.pack("<I", 0), db=runs)  # no such block
        txn.put(SCOPE.key(chains[1][1]), struct.pack("<I", 1), db=runs)  # a block inside a run
        assert txn.delete(SCOPE.key(chains[2][2]), db=runs)  # a run root's entry lost
    env.close()
    run = _kvstore("check", "--data-dir", str(data_dir), "--json")
    assert run.returncode == 1, run.stderr
    assert json.loads(run.stdout)["counts"] == {"stale-run-entry": 2, "missing-run-entry": 1}
    run = _kvstore("check", "--data-dir", str(data_dir))
    assert "names a block that is not stored" in run.stdout and "not a run's first" in run.stdout
    assert check_store(data_dir, repair=True).repaired
    assert check_store(data_dir, repair=False).ok
    assert pinned_view(data_dir, clock)[2] == _expected_runs(chains, [LENGTH] * CHAINS)


def test_r30_a_rebuild_carries_the_pins_the_run_index_and_the_log(store: Store,
                                                                   zero_leaves: Callable[[Path, bytes], list[int]]
                                                                   ) -> None:
    data_dir, chains, _, clock = store
    tier = _open(data_dir, clock)  # an expiry swept but not yet audited (R29): its journal record is carried too
    assert tier.pin(SCOPE, chains[1][-1], clock.now() + HOUR).until_s > 0
    clock.advance(2 * HOUR)
    [(_, expired)] = tier.expired_pins()
    tier.close()
    before, _ = _replay(data_dir, clock)
    assert zero_leaves(data_dir / "data.mdb", meta_key(SCOPE.key(chains[7][3])))
    report = check_store(data_dir, repair=True)
    assert report.repaired and report.counts["damaged-page"] >= 1 and report.blocks_dropped > 0
    assert "data.mdb.damaged" in " ".join(report.notes) and not report.not_carried, report.lines()
    assert check_store(data_dir, repair=False).ok
    found = _found(data_dir, chains, clock)
    assert sum(found) == report.blocks_kept and found[7] < LENGTH
    keys, charged = _expected_pins(chains, found)
    recorded, live, runs = pinned_view(data_dir, clock)
    assert live == keys and keys  # the kept blocks' pins carried, the dropped ones' gone
    assert recorded == pins.PinTotals(pins=len(keys), charged_bytes=charged)
    assert runs == _expected_runs(chains, found)
    tier = _open(data_dir, clock)
    try:
        assert [p for _, p in tier.expired_pins()] == [expired]  # still to audit after the rebuild
    finally:
        tier.close()
    batches, view = _replay(data_dir, clock)
    assert [(s, t) for s, t, _ in batches[:len(before)]] == [(s, t) for s, t, _ in before]  # the log carried
    assert report.removal_batches == len(batches) - len(before) == 1
    assert view == {h for chain, n in zip(chains, found, strict=True) for h in chain[:n]}


def test_a_rebuild_whose_event_log_is_damaged_says_so_and_the_log_starts_afresh(
        store: Store, zero_leaves: Callable[[Path, bytes], list[int]]) -> None:
    data_dir, chains, _, clock = store
    assert zero_leaves(data_dir / "data.mdb", b"node-1")  # every batch names its node: the log's leaves
    report = check_store(data_dir, repair=True)
    assert report.repaired and report.blocks_kept == CHAINS * LENGTH, report.lines()
    [line] = report.not_carried
    assert line.startswith("events:") and "AllBlocksCleared (E5)" in line
    assert "not carried: events:" in "\n".join(report.lines())
    batches, view = _replay(data_dir, clock)
    assert [(s, type(e)) for s, _, b in batches for e in b.events] == [(0, wire.AllBlocksCleared)]
    assert view == set()
    _, live, runs = pinned_view(data_dir, clock)  # the rest is carried whole
    assert len(live) == len(PINNED) and runs == _expected_runs(chains, [LENGTH] * CHAINS)


def test_a_rebuild_names_a_database_it_does_not_know(store: Store,
                                                     zero_leaves: Callable[[Path, bytes], list[int]]) -> None:
    data_dir, chains, _, _ = store
    env = lmdb.open(str(data_dir), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v", db=env.open_db(b"someday", txn=txn))
    env.close()
    assert zero_leaves(data_dir / "data.mdb", meta_key(SCOPE.key(chains[2][3])))
    report = check_store(data_dir, repair=True)
    assert report.repaired and report.not_carried == ["someday: a database check does not know; not carried"]
    assert "not carried: someday:" in "\n".join(report.lines())
