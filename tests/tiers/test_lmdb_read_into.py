"""LmdbBlockTier.read_into: blocks copied from LMDB's map into caller memory, verified."""

from __future__ import annotations

import os

import pytest

from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from kvstore.native.records import data_key
from kvstore.prefix import BlockScope, chain_hashes, root_hash
from tiers.lmdb_tier import TOUCH_GRANULARITY_S, LmdbBlockTier, ReadStatus

FP = b"\x01" * 8


def filled(settings: StoreSettings, n: int, size: int = 256) -> tuple[LmdbBlockTier, list[bytes], list[bytes]]:
    tier = LmdbBlockTier(settings, clock=ManualClock())
    scope = BlockScope(FP, "t")
    root = root_hash(FP, settings.block_tokens)
    hashes = chain_hashes(list(range(n * settings.block_tokens)), block_tokens=settings.block_tokens, parent=root)
    blocks = [os.urandom(size) for _ in range(n)]
    tier.put(scope, root, hashes, blocks, True)
    return tier, [scope.key(h) for h in hashes], blocks


def test_read_into_copies_verified_blocks(store_settings: StoreSettings) -> None:
    tier, keys, blocks = filled(store_settings, 3)
    dest = bytearray(3 * 256)
    view = memoryview(dest)
    out = tier.read_into(keys, [view[i * 256:(i + 1) * 256] for i in range(3)])
    assert out == [ReadStatus.FOUND] * 3 and bytes(dest) == b"".join(blocks)
    tier.close()


def test_read_into_skips_none_and_stops_at_missing(store_settings: StoreSettings) -> None:
    tier, keys, _blocks = filled(store_settings, 2)
    dest = memoryview(bytearray(4 * 256))
    spans = [dest[i * 256:(i + 1) * 256] for i in range(4)]
    keys = [keys[0], b"\x00" * len(keys[0]), keys[1], keys[1]]
    assert tier.read_into(keys, [spans[0], spans[1], None, spans[3]]) == [
        ReadStatus.FOUND, ReadStatus.MISSING, None, ReadStatus.FOUND]
    assert tier.read_into(keys, spans, stop_at_missing=True) == [ReadStatus.FOUND, ReadStatus.MISSING, None, None]
    tier.close()


def test_read_into_never_copies_a_corrupt_block(store_settings: StoreSettings) -> None:
    tier, keys, _ = filled(store_settings, 2)
    with tier.env.begin(write=True) as txn:
        txn.put(data_key(keys[1]), b"\xff" * 256, db=tier._records)
    dest = memoryview(bytearray(2 * 256))
    out = tier.read_into(keys, [dest[:256], dest[256:]])
    assert out == [ReadStatus.FOUND, ReadStatus.CORRUPT]
    assert bytes(dest[256:]) == bytes(256) and tier.stats().counters.corrupt_blocks == 1
    tier.close()


def test_read_into_reports_blocks_due_a_touch(store_settings: StoreSettings) -> None:
    tier, keys, _ = filled(store_settings, 2)
    dest = memoryview(bytearray(2 * 256))
    due: list[bytes] = []
    tier.read_into(keys, [dest[:256], dest[256:]], touch_due=due)
    assert due == [], "just written: the retention clock is fresh"
    assert isinstance(tier.clock, ManualClock)
    tier.clock.advance(TOUCH_GRANULARITY_S + 1)
    tier.read_into(keys, [dest[:256], None], touch_due=due)
    assert due == [keys[0]]
    tier.close()


def test_lookups_on_one_thread_and_the_copy_on_another(store_settings: StoreSettings) -> None:
    from concurrent.futures import ThreadPoolExecutor

    tier, keys, blocks = filled(store_settings, 4)
    dest = memoryview(bytearray(4 * 256))
    with ThreadPoolExecutor(1) as lookups, ThreadPoolExecutor(1) as copies:
        staged = lookups.submit(tier.stage_reads, [keys[0], None, keys[2], keys[3]]).result()
        codes = copies.submit(staged.copy, [dest[i * 256:(i + 1) * 256] for i in range(4)]).result()
    assert list(codes) == [ReadStatus.FOUND.value, 0, ReadStatus.FOUND.value, ReadStatus.FOUND.value]
    assert bytes(dest[:256]) == blocks[0] and bytes(dest[256:512]) == bytes(256), "a None key is skipped"
    assert bytes(dest[512:]) == blocks[2] + blocks[3]
    assert active_readers(tier) == 0, "the copy ended the read txn"
    tier.close()


def test_staged_reads_are_copied_once(store_settings: StoreSettings) -> None:
    tier, keys, _ = filled(store_settings, 1)
    staged = tier.stage_reads(keys)
    staged.copy([memoryview(bytearray(256))])
    with pytest.raises(RuntimeError, match="already"):
        staged.copy([memoryview(bytearray(256))])
    unused = tier.stage_reads(keys)
    assert active_readers(tier) == 1
    unused.close()  # ends the txn without copying
    unused.close()
    assert active_readers(tier) == 0
    tier.close()


def active_readers(tier: LmdbBlockTier) -> int:
    """Read txns open now (LMDB lists an idle reader slot with txnid '-')."""
    lines = tier.env.readers().splitlines()[1:]
    return sum(1 for line in lines if line.split()[-1] != "-")
