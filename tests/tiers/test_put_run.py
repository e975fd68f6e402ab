"""A Put's blocks stored in one loop (`BlockTxn.insert_run`) and checksummed off the write transaction
(`kvstore.native.blockcopy.digests`): the same records, byte for byte, as one `BlockTxn.insert` per block with
the checksum taken inside it, over random chains with stored blocks among the new (docs/BENCHMARKS.md)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
import xxhash

from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from kvstore.geometry import V4_1_FLASH
from kvstore.native import blockcopy
from kvstore.prefix import BlockScope, chain_hashes, root_hash
from tiers import namespaces
from tiers.block_txn import PutBatch
from tiers.lmdb_tier import LmdbBlockTier

SCOPE = BlockScope(V4_1_FLASH.fingerprint, "default")
ROOT = root_hash(V4_1_FLASH.fingerprint, 16)
SIZES = [0, 1, 15, 16, 128, 129, 240, 241, 1023, 1024, 4095, 65_537, 56_960]


@pytest.mark.parametrize("form", ["native", "python"])
def test_digests_are_each_buffers_xxh3_64_whatever_its_size_and_alignment(form: str) -> None:
    if form == "native" and blockcopy.digests_native is None:
        pytest.skip("kvstore.native._blockcopy is not built")
    digests = blockcopy.digests_native if form == "native" else blockcopy.digests_python
    assert digests is not None
    rng = random.Random(25)
    raw = os.urandom(sum(SIZES) + 64)
    view = memoryview(raw)
    datas: list[bytes | bytearray | memoryview] = []
    at = 0
    for size in SIZES * 3:
        skew = rng.randrange(8)  # views that start off any alignment
        datas += [view[at + skew:at + skew + size], bytes(view[at:at + size]), bytearray(view[at:at + size])]
        at = (at + size) % (len(raw) - max(SIZES) - 8)
    assert digests(datas) == [xxhash.xxh3_64_intdigest(d) for d in datas]
    assert digests([]) == []
    with pytest.raises(TypeError):
        digests(["not a buffer"])


@pytest.fixture
def tiers_pair(tmp_path: Path) -> Iterator[tuple[LmdbBlockTier, LmdbBlockTier, ManualClock]]:
    clock = ManualClock(1_000_000.0)
    made = [LmdbBlockTier(StoreSettings(data_dir=tmp_path / name, capacity_bytes=1 << 30, block_tokens=16),
                          clock=clock) for name in ("run", "each")]
    yield made[0], made[1], clock
    for t in made:
        t.close()


def _put_one_by_one(tier: LmdbBlockTier, batch: PutBatch) -> None:
    """The Put loop before `insert_run`: one `insert` (checksum inside it) or `touch` per block."""
    now = tier.retention_clock.now()
    with tier._write() as w:
        w.namespace_names.setdefault(namespaces.id_of_key(batch.scope.prefix), batch.scope.namespace)
        depth = 0 if batch.is_root else w.meta(batch.scope.key(batch.parent_hash)).depth  # type: ignore[union-attr]
        parent = batch.parent_hash
        for i, (h, data) in enumerate(zip(batch.hashes, batch.blocks, strict=True)):
            key = batch.scope.key(h)
            if w.meta(key) is None:
                w.insert(key, parent, depth + i + 1, data, now, batch.is_root and i == 0, last_use_s=now)
            else:
                w.touch(key, now)
            parent = h


def _records(tier: LmdbBlockTier) -> list[tuple[bytes, bytes]]:
    """Every record of the block databases (counters and clock aside: they count calls)."""
    out = []
    with tier.env.begin() as txn:
        for db in (tier._dbs.records, tier._dbs.lru):
            out += [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]
        out += [(bytes(k), bytes(v)) for k, v in txn.cursor(db=tier._dbs.state)
                if not k.startswith((b"counters", b"high"))]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_a_put_stores_the_records_one_insert_per_block_would(tiers_pair: tuple, seed: int) -> None:
    run, each, clock = tiers_pair
    rng = random.Random(seed)
    n = rng.randrange(1, 40)
    hashes = chain_hashes(list(range(seed * 10_000, seed * 10_000 + 16 * n)), block_tokens=16, parent=ROOT)
    blocks = [os.urandom(rng.choice([1, 100, 1024, 4096])) for _ in range(n)]
    # Some blocks already stored on both sides (alone, as a run, the first, the last): a Put's mix.
    stored = sorted(rng.sample(range(n), rng.randrange(n + 1)))
    for i in stored:
        for tier in (run, each):
            lo = i
            while lo > 0 and tier.lookup(SCOPE, hashes[:lo])[0] < lo:
                lo -= 1  # a block's prefix first (a Put needs its parent)
            for j in range(lo, i + 1):
                tier.put(SCOPE, ROOT if j == 0 else hashes[j - 1], [hashes[j]], [blocks[j]], j == 0)
    clock.advance(7200.0)  # the Put touches what was stored (R5): a later time to write
    given = rng.random() < 0.5  # checksums taken by the caller (the stream's reader), or by the tier
    views = [memoryview(b) for b in blocks]
    batch = PutBatch(scope=SCOPE, parent_hash=ROOT, hashes=hashes, blocks=views, is_root=True,
                     checksums=blockcopy.digests(views) if given else None)
    run.put_many([batch])
    _put_one_by_one(each, batch)
    assert _records(run) == _records(each)
    assert run.read([SCOPE.key(h) for h in hashes]) == each.read([SCOPE.key(h) for h in hashes])
    assert run.stats().bytes_stored == each.stats().bytes_stored == sum(len(b) for b in blocks)


def test_a_damaged_page_under_a_run_names_the_block_it_was_storing(tiers_pair: tuple,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    run, _, _ = tiers_pair
    hashes = chain_hashes(list(range(16 * 3)), block_tokens=16, parent=ROOT)
    from tiers.block_txn import BlockTxn, DamagedBlock

    calls = []

    class Failing:
        def __init__(self, txn: lmdb.Transaction) -> None:
            self.txn = txn

        def put(self, key: bytes, value: Any, db: Any) -> bool:
            calls.append(key)
            if len(calls) == 6:  # the second block's third record
                raise lmdb.CorruptedError("MDB_CORRUPTED")
            return self.txn.put(key, value, db=db)

    with pytest.raises(DamagedBlock) as caught, run._write() as w:
        w.txn = Failing(w.txn)  # type: ignore[assignment]
        BlockTxn.insert_run(w, [SCOPE.key(h) for h in hashes], ROOT, 1, [b"x"] * 3, [0, 0, 0], 1.0, True,
                            last_use_s=[1.0] * 3)
    assert caught.value.key == SCOPE.key(hashes[1])
