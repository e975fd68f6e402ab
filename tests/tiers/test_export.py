"""R21: a namespace's blocks exported as records, parents first, and imported back (here or elsewhere)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvstore.config import StoreSettings
from kvstore.errors import DataLoss, InvalidArgument
from kvstore.geometry import V4_1_FLASH
from kvstore.native.records import data_key
from kvstore.prefix import BlockScope
from tiers import export
from tiers.lmdb_tier import LmdbBlockTier

Kit = Any  # tests/tiers/conftest.py
OLD = bytes.fromhex("2d76cb51b8017512")  # a geometry of an earlier codec


def scope(namespace: str, fingerprint: bytes = V4_1_FLASH.fingerprint) -> BlockScope:
    return BlockScope(fingerprint, namespace)


@pytest.fixture
def other_store(open_tier: Callable[..., LmdbBlockTier], tmp_path: Path) -> Callable[[], LmdbBlockTier]:
    """Opens (again) a second store, as on another node."""
    def _open() -> LmdbBlockTier:
        return open_tier(StoreSettings(data_dir=tmp_path / "other", capacity_bytes=64 * 1024, block_tokens=16))
    return _open


def fill(kit: Kit) -> tuple[list[bytes], list[bytes]]:
    """alice: a 4-block trunk, a 2-block branch off its second block, 2 blocks of an old geometry; bob: 3."""
    trunk = kit.chain(0, 4)
    branch = kit.chain(7000, 2, parent=trunk[1])
    kit.tier.put(scope("alice"), kit.root, trunk, [kit.data(i) for i in range(4)], True)
    kit.tier.put(scope("alice"), trunk[1], branch, [kit.data(10), kit.data(11)], False)
    kit.tier.put(scope("alice", OLD), kit.root, trunk[:2], [kit.data(20), kit.data(21)], True)
    kit.tier.put(scope("bob"), kit.root, kit.chain(500, 3), [kit.data(i) for i in range(3)], True)
    return trunk, branch


def test_r21_export_yields_every_block_parents_first_with_what_import_needs(make_kit: Callable[..., Kit]) -> None:
    kit = make_kit(20)
    trunk, branch = fill(kit)
    records = list(kit.tier.export_records("alice"))
    assert len(records) == 8 and {r.namespace for r in records} == {"alice"}
    assert {(r.fingerprint, r.block_hash) for r in records} == (
        {(V4_1_FLASH.fingerprint, h) for h in trunk + branch} | {(OLD, h) for h in trunk[:2]})
    seen: set[tuple[bytes, bytes]] = set()
    for r in records:
        assert r.depth == 1 or (r.fingerprint, r.parent_hash) in seen, "a child before its parent"
        assert xxhash.xxh3_64_intdigest(r.data) == r.checksum and len(r.data) == kit.block_bytes
        seen.add((r.fingerprint, r.block_hash))
    assert list(kit.tier.export_records("nobody")) == []


def test_r21_import_writes_the_records_back_durably_and_idempotently(
        make_kit: Callable[..., Kit], other_store: Callable[[], LmdbBlockTier]) -> None:
    kit = make_kit(20)
    trunk, branch = fill(kit)
    records = list(kit.tier.export_records("alice"))
    other = other_store()
    assert other.import_records(records) == 8
    assert other.import_records(records) == 0  # already there: nothing written twice
    assert other.import_records(records, "carol") == 8  # the hash does not bind the namespace
    other.close()
    other = other_store()  # durable: a restart finds them
    for ns in ("alice", "carol"):
        assert other.lookup(scope(ns), trunk)[0] == 4 and other.lookup(scope(ns), trunk[:2] + branch)[0] == 4
        assert other.lookup(scope(ns, OLD), trunk)[0] == 2
        assert other.namespace_usage(ns).blocks == 8
        got = other.read([scope(ns).key(h) for h in trunk])
        assert [d for _, d in got] == [kit.data(i) for i in range(4)]
    assert other.stats().blocks_stored == 16 and other.stats().counters.imported_blocks == 16
    assert other.namespace_usage("bob").blocks == 0


def test_r21_import_refuses_damaged_or_disordered_records(
        make_kit: Callable[..., Kit], other_store: Callable[[], LmdbBlockTier],
        monkeypatch: pytest.MonkeyPatch) -> None:
    kit = make_kit(20)
    fill(kit)
    records = list(kit.tier.export_records("alice"))
    other = other_store()
    flipped = dataclasses.replace(records[3], data=b"\xff" + records[3].data[1:])
    with pytest.raises(DataLoss, match=r"record 3 .* does not match its checksum"):
        other.import_records([*records[:3], flipped])
    assert other.stats().blocks_stored == 0  # its chunk stored nothing
    child_first = [r for r in records if r.depth > 1][:1] + records
    with pytest.raises(InvalidArgument, match="parents first"):
        other.import_records(child_first)
    with pytest.raises(InvalidArgument, match="record 0"):
        other.import_records([dataclasses.replace(records[0], block_hash=b"\x00" * 31)])
    with pytest.raises(InvalidArgument, match="record 0"):
        other.import_records([dataclasses.replace(records[0], fingerprint=b"short")])
    monkeypatch.setattr(export, "IMPORT_CHUNK", 2)  # chunks before a damaged record stay stored
    with pytest.raises(DataLoss, match=r"records 0\.\.1 are stored"):
        other.import_records([*records[:3], flipped])
    assert other.stats().blocks_stored == 2


def test_r21_export_leaves_out_a_corrupt_block_and_everything_below_it(make_kit: Callable[..., Kit]) -> None:
    kit = make_kit(20)
    trunk, _ = fill(kit)
    with kit.tier.env.begin(write=True) as txn:  # block 1 of the trunk rots on disk
        txn.put(data_key(scope("alice").key(trunk[1])), b"\x00" * kit.block_bytes, db=kit.tier._records)
    hashes = {(r.fingerprint, r.block_hash) for r in kit.tier.export_records("alice")}
    assert hashes == {(V4_1_FLASH.fingerprint, trunk[0]), (OLD, trunk[0]), (OLD, trunk[1])}
    assert kit.tier.stats().counters.corrupt_blocks == 1  # and it is dropped with its subtree, as a read does
    assert kit.tier.lookup(scope("alice"), trunk)[0] == 1
