"""`LmdbBlockTier.read_found`: all found and intact, or None with no side effect (the service runs a small
one on its event loop, where nothing may write); the blocks due a refresh (R5) named only then."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from kvstore.geometry import V4_1_FLASH
from kvstore.native.records import data_key
from kvstore.prefix import BlockScope, chain_hashes, root_hash
from tiers.lmdb_tier import TOUCH_GRANULARITY_S, LmdbBlockTier, ReadStatus
from tiers.store import FoundReads

BLOCK = 1024
SCOPE = BlockScope(V4_1_FLASH.fingerprint, "default")
ROOT = root_hash(V4_1_FLASH.fingerprint, 16)


@pytest.fixture
def tier(tmp_path: os.PathLike[str], clock: ManualClock) -> Iterator[LmdbBlockTier]:
    settings = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=1 << 20, block_tokens=16)  # type: ignore[operator]
    t = LmdbBlockTier(settings, clock=clock)
    yield t
    t.close()


def stored_chain(tier: LmdbBlockTier, n: int) -> tuple[list[bytes], list[bytes]]:
    hashes = chain_hashes(list(range(16 * n)), block_tokens=16, parent=ROOT)
    blocks = [bytes([i]) * BLOCK for i in range(n)]
    tier.put(SCOPE, ROOT, hashes, blocks, True)
    return [SCOPE.key(h) for h in hashes], blocks


def test_found_blocks_come_back_as_read_returns_them(tier: LmdbBlockTier) -> None:
    keys, blocks = stored_chain(tier, 3)
    assert isinstance(tier, FoundReads)
    assert tier.read_found(keys) == blocks == [d for _, d in tier.read(keys)]
    assert tier.read_found(keys, lambda i, view: (i, bytes(view[:1]))) == [(i, bytes([i])) for i in range(3)]


def test_a_missing_block_is_none_and_nothing_is_noted(tier: LmdbBlockTier) -> None:
    keys, _ = stored_chain(tier, 2)
    due: list[bytes] = []
    assert tier.read_found([*keys, SCOPE.key(b"\x01" * 32)], touch_due=due) is None
    assert due == [] and tier.stats().counters.corrupt_blocks == 0


def test_a_corrupt_block_is_none_and_stays_for_the_careful_read(tier: LmdbBlockTier) -> None:
    keys, blocks = stored_chain(tier, 2)
    with tier.env.begin(write=True) as txn:
        txn.put(data_key(keys[1]), b"\xff" + blocks[1][1:], db=tier._records)
    assert tier.read_found(keys) is None
    assert tier.stats().counters.corrupt_blocks == 0  # not counted nor dropped: no write here
    assert [s for s, _ in tier.read(keys)] == [ReadStatus.FOUND, ReadStatus.CORRUPT]  # `read` drops it
    assert tier.stats().counters.corrupt_blocks == 1


def test_r5_only_blocks_past_the_touch_granularity_are_due(tier: LmdbBlockTier, clock: ManualClock) -> None:
    keys, _ = stored_chain(tier, 2)
    due: list[bytes] = []
    assert tier.read_found(keys, touch_due=due) is not None and due == []  # just written
    tier.touch(keys[:1])
    clock.advance(TOUCH_GRANULARITY_S + 1)
    tier.touch(keys[:1])  # block 0 recorded again now; block 1 is past the granularity
    assert tier.read_found(keys, touch_due=due) is not None and due == [keys[1]]
