"""R16: a damaged LMDB page met at run time makes the blocks on it misses, never a failed call.

The damage is real: a leaf page of the records tree is overwritten in data.mdb
while the tier serves (LMDB's map shows the file's bytes), so LMDB's own reads
raise CorruptedError on the blocks whose records sit there.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.errors import DataLoss, ResourceExhausted
from kvstore.native.records import data_key, meta_key
from kvstore.prefix import BlockScope
from tiers.lmdb_tier import ReadStatus

Kit = Any  # tests/tiers/conftest.py
BIG = 4096  # block size: the data goes to overflow pages, a leaf holds the records of ~14 blocks
P_LEAF = 0x02


def leaf_pages_of(tier: Any, record_key: bytes) -> set[int]:
    """The leaf pages of data.mdb holding `record_key` (old copies too)."""
    path = Path(tier.settings.data_dir) / "data.mdb"
    psize = tier.env.stat()["psize"]
    raw = path.read_bytes()
    pages = set()
    start = raw.find(record_key)
    while start >= 0:
        page = start // psize
        if struct.unpack_from("<H", raw, page * psize + 10)[0] & P_LEAF:
            pages.add(page)
        start = raw.find(record_key, start + 1)
    return pages


def damage_leaf_of(tier: Any, record_key: bytes) -> set[int]:
    """Zero the page-type flags of every leaf page of data.mdb holding `record_key`; their page numbers."""
    pages = leaf_pages_of(tier, record_key)
    fd = os.open(Path(tier.settings.data_dir) / "data.mdb", os.O_WRONLY)
    try:
        for page in pages:
            os.pwrite(fd, struct.pack("<H", 0), page * tier.env.stat()["psize"] + 10)
    finally:
        os.close(fd)
    return pages


def on_pages(tier: Any, keys: list[bytes], pages: set[int]) -> list[bool]:
    """Which blocks may have their data or meta record on one of `pages` (a page's free
    space may still hold stale copies of other records)."""
    raw = (Path(tier.settings.data_dir) / "data.mdb").read_bytes()
    psize = tier.env.stat()["psize"]
    chunks = [raw[p * psize:(p + 1) * psize] for p in pages]
    return [any(meta_key(k) in c or data_key(k) in c for c in chunks) for k in keys]


def damaged_store(make_kit: Callable[..., Kit], capacity_kib: int = 1000, n: int = 120,
                  spare_tail: int = 0) -> tuple[Kit, list[bytes], list[bool], int]:
    """n blocks of one chain; the leaf holding the records of one block damaged: the block
    whose key is the median (a leaf inside the tenant's key range), or, with `spare_tail`,
    the first from there in key order whose page holds none of the chain's last
    `spare_tail` blocks. Returns the kit, the chain, which blocks may sit on the page, and
    the chain index of that block."""
    kit = make_kit(capacity_kib)
    hashes = kit.chain(0, n)
    kit.tier.put(kit.scope, kit.root, hashes, [bytes([i % 256]) * BIG for i in range(n)], True)
    keys = kit.keys(hashes)
    ordered = sorted(keys)
    for key in ordered[n // 2:] + ordered[:n // 2]:
        hit = on_pages(kit.tier, keys, leaf_pages_of(kit.tier, meta_key(key)))
        if not any(hit[n - spare_tail:]):
            break
    target = keys.index(key)
    pages = damage_leaf_of(kit.tier, meta_key(keys[target]))
    assert pages
    hit = on_pages(kit.tier, keys, pages)
    assert hit[target] and not all(hit)
    return kit, hashes, hit, target


def test_r16_blocks_on_a_damaged_page_are_misses(make_kit: Callable[..., Kit]) -> None:
    kit, hashes, hit, target = damaged_store(make_kit)
    keys = kit.keys(hashes)
    statuses = [s for s, _ in kit.tier.read(keys)]
    corrupt = [s is ReadStatus.CORRUPT for s in statuses]
    assert corrupt[target] and all(h for h, c in zip(hit, corrupt, strict=True) if c)
    assert all(s is ReadStatus.FOUND for s, c in zip(statuses, corrupt, strict=True) if not c)
    assert kit.found(hashes) == corrupt.index(True)
    assert kit.tier.stats().counters.corrupt_blocks == sum(corrupt)
    kit.tier.read(keys)  # met again: counted once
    assert kit.tier.stats().counters.corrupt_blocks == sum(corrupt)


def test_r16_staged_reads_and_refreshes_survive_a_damaged_page(make_kit: Callable[..., Kit]) -> None:
    kit, hashes, hit, target = damaged_store(make_kit)
    keys = kit.keys(hashes)
    dest = memoryview(bytearray(BIG * len(keys)))
    got = kit.tier.read_into(keys, [dest[i * BIG:(i + 1) * BIG] for i in range(len(keys))])
    assert got[target] is ReadStatus.CORRUPT
    assert all(s is ReadStatus.FOUND or (h and s is ReadStatus.CORRUPT) for s, h in zip(got, hit, strict=True))
    assert bytes(dest[:BIG]) == bytes([0]) * BIG
    kit.tier.touch_soon(keys).result(timeout=30)  # refreshes what it can


def test_r16_other_blocks_stay_writable_and_a_put_needing_the_page_says_data_loss(
        make_kit: Callable[..., Kit]) -> None:
    kit, hashes, _, target = damaged_store(make_kit)
    other_tenant = BlockScope(kit.scope.fingerprint, "other")  # its keys sort apart from the damaged leaf
    other = kit.chain(50_000, 3)
    kit.tier.put(other_tenant, kit.root, other, [b"o" * BIG] * 3, True)
    assert kit.tier.lookup(other_tenant, other)[0] == 3
    with pytest.raises(DataLoss, match="damaged page"):
        kit.tier.put(kit.scope, hashes[target], kit.chain(90_000, 1, parent=hashes[target]), [b"x" * BIG], False)
    assert kit.tier.stats().blocks_stored >= 123


def test_r16_eviction_skips_damaged_blocks_and_makes_room_elsewhere(make_kit: Callable[..., Kit],
                                                                      clock: Any) -> None:
    # The damaged page spares the chain's tail, which eviction can take.
    kit, hashes, hit, _ = damaged_store(make_kit, capacity_kib=4 * 150, n=150, spare_tail=10)  # full
    assert not any(hit[140:])
    corrupt = [s is ReadStatus.CORRUPT for s, _ in kit.tier.read(kit.keys(hashes))]
    clock.advance(100 * 3600)
    other_tenant = BlockScope(kit.scope.fingerprint, "other")  # its keys sort apart from the damaged leaf
    made = 0
    while True:  # one new block at a time, each evicting one old one, until only protected ones are left
        new = kit.chain(100_000 + 1000 * made, 1)
        try:
            kit.tier.put(other_tenant, kit.root, new, [b"n" * BIG], True)
        except ResourceExhausted:
            break
        made += 1
        assert made < 150
    assert made >= 1 and kit.tier.stats().counters.evictions == made
    after = [s for s, _ in kit.tier.read(kit.keys(hashes))]
    assert all(s is ReadStatus.CORRUPT for s, c in zip(after, corrupt, strict=True) if c)  # kept, still misses
    first = corrupt.index(True)
    assert [s is ReadStatus.FOUND for s in after[:first]] == [True] * first  # the prefix before the damage stays


def flip(tier: Any, offset: int, n: int = 16) -> None:
    """Invert `n` bytes of the live data.mdb at `offset` (LMDB's map shows them at once)."""
    fd = os.open(Path(tier.settings.data_dir) / "data.mdb", os.O_RDWR)
    try:
        os.pwrite(fd, bytes(b ^ 0xFF for b in os.pread(fd, n, offset)), offset)
    finally:
        os.close(fd)


def live_chain(make_kit: Callable[..., Kit], n: int = 320) -> tuple[Kit, list[bytes], list[bytes]]:
    """A served tier holding one n-block chain, written in one transaction (each record on one leaf)."""
    kit = make_kit(2 * n * BIG // 1024)
    hashes = kit.chain(0, n)
    kit.tier.put(kit.scope, kit.root, hashes, [bytes([i % 256]) * BIG for i in range(n)], True)
    return kit, hashes, kit.keys(hashes)


def get_statuses(kit: Kit, keys: list[bytes], how: str) -> list[ReadStatus]:
    if how == "read":
        return [s for s, _ in kit.tier.read(keys)]
    dest = memoryview(bytearray(BIG * len(keys)))
    return list(kit.tier.read_into(keys, [dest[i * BIG:(i + 1) * BIG] for i in range(len(keys))]))


def damage_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tiers.damage"]


def meta_record_at(kit: Kit, key: bytes) -> tuple[int, int]:
    """(the one leaf page holding `key`'s meta record, the file offset of the record's key)."""
    (page,) = leaf_pages_of(kit.tier, meta_key(key))
    psize = kit.tier.env.stat()["psize"]
    return page, (Path(kit.tier.settings.data_dir) / "data.mdb").read_bytes().find(meta_key(key), page * psize)


@pytest.mark.parametrize("how", ["read", "read_into"])
def test_r16_flipped_keys_are_counted_once_per_block_and_their_page_logged_once(
        make_kit: Callable[..., Kit], caplog: pytest.LogCaptureFixture, how: str) -> None:
    caplog.set_level(logging.WARNING, logger="tiers.damage")
    kit, hashes, keys = live_chain(make_kit)
    absent = kit.chain(0, 330)[320:]  # a plain miss is no damage
    assert kit.found(hashes + absent) == 320
    assert set(get_statuses(kit, kit.keys(absent), how)) == {ReadStatus.MISSING}
    assert kit.tier.stats().counters.damaged_blocks == 0 and not damage_lines(caplog)
    page, _ = meta_record_at(kit, keys[160])
    other = next(i for i, on in enumerate(on_pages(kit.tier, keys, {page})) if on and i != 160)
    for i in (160, other):  # two keys' hashes: they no longer sort where they stand; LMDB raises nothing
        flip(kit.tier, meta_record_at(kit, keys[i])[1] + 16)
    missing = {i for i, s in enumerate(get_statuses(kit, keys, how)) if s is not ReadStatus.FOUND}
    assert {160, other} <= missing and all(on_pages(kit.tier, keys, {page})[i] for i in missing)
    assert kit.tier.stats().counters.damaged_blocks == len(missing)
    lines = damage_lines(caplog)
    assert len(lines) == 1 and f"page {page} " in lines[0] and "kvstore check" in lines[0]
    kit.tier.chains.forget()  # walk the chain, as after a restart
    assert kit.found(hashes) in missing  # Lookup stops at the first block Get misses
    for _ in range(3):  # met again: neither counted nor logged again
        kit.tier.chains.forget()
        kit.found(hashes)
        get_statuses(kit, keys, how)
    assert kit.tier.stats().counters.damaged_blocks == len(missing)
    assert kit.tier.stats().counters.corrupt_blocks == len(missing)
    assert damage_lines(caplog) == lines


def test_r16_a_miss_on_a_leaf_that_does_not_parse_is_damage(make_kit: Callable[..., Kit],
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Asked alone, nothing else names the block: its leaf is read, and its keys are out of order."""
    caplog.set_level(logging.WARNING, logger="tiers.damage")
    kit, _, keys = live_chain(make_kit)
    _, at = meta_record_at(kit, keys[160])
    flip(kit.tier, at + 16)
    assert get_statuses(kit, [keys[160]], "read") == [ReadStatus.MISSING]
    assert kit.tier.stats().counters.damaged_blocks == 1
    assert len(damage_lines(caplog)) == 1 and "out of order" in damage_lines(caplog)[0]


def test_r16_a_miss_its_child_contradicts_is_damage(make_kit: Callable[..., Kit],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The key's last 16 bytes flipped: it still sorts in place and its leaf parses, but the
    next block, read in the same call, names it as its parent."""
    caplog.set_level(logging.WARNING, logger="tiers.damage")
    kit, hashes, keys = live_chain(make_kit)
    page, at = meta_record_at(kit, keys[160])
    flip(kit.tier, at + 32)
    assert get_statuses(kit, keys[160:162], "read") == [ReadStatus.MISSING, ReadStatus.FOUND]
    assert kit.tier.stats().counters.damaged_blocks == 1
    lines = damage_lines(caplog)
    assert len(lines) == 1 and f"page {page} of" in lines[0] and "names it as its parent" in lines[0]
    kit.tier.chains.forget()
    assert kit.found(hashes) == 160 and kit.tier.stats().counters.damaged_blocks == 1


def test_r16_a_flipped_parent_in_a_meta_record_ends_lookups_counted_and_logged(
        make_kit: Callable[..., Kit], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tiers.damage")
    kit, hashes, keys = live_chain(make_kit)
    page, at = meta_record_at(kit, keys[200])
    flip(kit.tier, at + len(meta_key(keys[200])))  # the record's parent hash, its first 16 bytes
    kit.tier.chains.forget()
    assert kit.found(hashes) == 200
    assert kit.tier.stats().counters.damaged_blocks == 1
    lines = damage_lines(caplog)
    assert len(lines) == 1 and f"page {page}" in lines[0] and "parent" in lines[0]
    kit.tier.chains.forget()
    assert kit.found(hashes) == 200 and kit.tier.stats().counters.damaged_blocks == 1
    assert damage_lines(caplog) == lines


@pytest.mark.parametrize("how", ["read", "read_into"])
def test_r16_a_flipped_size_in_a_meta_record_is_damage_not_a_failed_get(
        make_kit: Callable[..., Kit], caplog: pytest.LogCaptureFixture, how: str) -> None:
    """Dropping the block as corrupt would take the garbled size off the usage totals (and fail the Get;
    the zero-copy read raised struct.error writing them)."""
    caplog.set_level(logging.WARNING, logger="tiers.damage")
    kit, _, keys = live_chain(make_kit)
    page, at = meta_record_at(kit, keys[100])
    flip(kit.tier, at + len(meta_key(keys[100])) + 36, n=4)  # the record's size field
    statuses = get_statuses(kit, keys, how)
    assert statuses[100] is ReadStatus.CORRUPT and statuses.count(ReadStatus.FOUND) == len(keys) - 1
    assert kit.tier.stats().counters.damaged_blocks == 1 and kit.tier.stats().blocks_stored == len(keys)
    lines = damage_lines(caplog)
    assert len(lines) == 1 and f"page {page} of" in lines[0] and "its meta record says" in lines[0]
