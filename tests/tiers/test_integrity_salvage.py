"""`kvstore check --repair` on a store whose trees lost pages: it keeps every block whose records
and data survive on the pages that remain, whatever became of the branch pages above their
leaves, and, as R6 wants, whose ancestors survive too (whole chains up to the first lost block).

What survives is computed here independently of `tiers/lmdb_pages.py`: the leaf pages left in
the file are parsed by a few lines below, and a block counts when its meta record is on one,
its data's node too, and the overflow page that node names holds the block's bytes.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from kvstore.geometry import V4_1_FLASH
from kvstore.native.records import META_STRUCT, data_key, meta_key
from kvstore.prefix import BlockScope, chain_hashes, root_hash
from tiers.block_txn import PutBatch
from tiers.integrity import check_store
from tiers.lmdb_pages import read_header
from tiers.lmdb_tier import LmdbBlockTier, ReadStatus

SCOPE = BlockScope(V4_1_FLASH.fingerprint, "default")
ROOT = root_hash(V4_1_FLASH.fingerprint, 16)
CHAINS, LENGTH, SIZE, PAGE = 400, 5, 4096, 4096  # 2,000 blocks; each block's data on its own overflow pages


def build(data_dir: Path, chains: int = CHAINS) -> tuple[list[list[bytes]], dict[bytes, bytes]]:
    """A closed store of `chains` chains of LENGTH blocks, written in one transaction (no freed pages)."""
    tier = LmdbBlockTier(StoreSettings(data_dir=data_dir, capacity_bytes=1 << 30, block_tokens=16),
                         clock=ManualClock())
    hashes, blocks = [], {}
    batches = []
    for c in range(chains):
        chain = chain_hashes(list(range(c * 1000, c * 1000 + 16 * LENGTH)), block_tokens=16, parent=ROOT)
        data = [os.urandom(SIZE) for _ in chain]
        blocks.update(zip(chain, data, strict=True))
        hashes.append(chain)
        batches.append(PutBatch(scope=SCOPE, parent_hash=ROOT, hashes=chain, blocks=data, is_root=True))
    tier.put_many(batches)
    tier.close()
    return hashes, blocks


def leaf_nodes(raw: bytes) -> dict[bytes, bytes]:
    """key -> value (an overflow page number when F_BIGDATA) of every node on the file's leaf pages."""
    out = {}
    for at in range(0, len(raw) - PAGE + 1, PAGE):
        pgno, _, flags, lower, _ = struct.unpack_from("<QHHHH", raw, at)
        if pgno != at // PAGE or flags & 0x7F != 0x02:  # P_LEAF only
            continue
        for i in range((lower - 16) // 2):
            node = at + struct.unpack_from("<H", raw, at + 16 + 2 * i)[0]
            lo, hi, nflags, ksize = struct.unpack_from("<HHHH", raw, node)
            key = raw[node + 8:node + 8 + ksize]
            out[key] = raw[node + 8 + ksize:node + 8 + ksize + (8 if nflags & 0x01 else lo | hi << 16)]
    return out


def surviving(raw: bytes, blocks: dict[bytes, bytes]) -> set[bytes]:
    """Blocks whose meta record, data node and data are all in `raw`."""
    nodes = leaf_nodes(raw)
    out = set()
    for h, data in blocks.items():
        pointer = nodes.get(data_key(SCOPE.key(h)))
        meta = nodes.get(meta_key(SCOPE.key(h)))
        if pointer is None or meta is None or len(meta) != META_STRUCT.size:
            continue
        start = struct.unpack("<Q", pointer)[0] * PAGE + 16
        if raw[start:start + SIZE] == data:
            out.add(h)
    return out


def prefixes(chains: list[list[bytes]], present: set[bytes]) -> list[int]:
    """Per chain, how many leading blocks are in `present`."""
    out = []
    for chain in chains:
        n = 0
        while n < len(chain) and chain[n] in present:
            n += 1
        out.append(n)
    return out


def served(data_dir: Path, chains: list[list[bytes]], blocks: dict[bytes, bytes]) -> tuple[list[int], int]:
    """(Lookup's count per chain, blocks stored) of the repaired store; every block Lookup finds
    is read back and must be the bytes written."""
    tier = LmdbBlockTier(StoreSettings(data_dir=data_dir, capacity_bytes=1 << 30, block_tokens=16),
                         clock=ManualClock())
    try:
        found = [tier.lookup(SCOPE, chain)[0] for chain in chains]
        for chain, n in zip(chains, found, strict=True):
            for h, (status, data) in zip(chain[:n], tier.read([SCOPE.key(h) for h in chain[:n]]), strict=True):
                assert status is ReadStatus.FOUND and data == blocks[h]
        return found, tier.stats().blocks_stored
    finally:
        tier.close()


@pytest.mark.parametrize("kept_fraction", [0.6, 0.5])
def test_a_truncated_store_keeps_every_chain_prefix_whose_pages_survive(tmp_path: Path,
                                                                          kept_fraction: float) -> None:
    store = tmp_path / "store"
    chains, blocks = build(store)
    data = store / "data.mdb"
    os.truncate(data, int(data.stat().st_size * kept_fraction))
    alive = surviving(data.read_bytes(), blocks)
    want = prefixes(chains, alive)
    assert sum(want) > 100  # the cut leaves whole chains to salvage
    report = check_store(store, repair=True)
    assert report.blocks_kept == sum(want), report.lines()
    assert report.repaired and report.leaves_recovered > 0  # leaves cut off from their tree by the truncation
    assert check_store(store, repair=False).ok
    found, stored = served(store, chains, blocks)
    assert found == want and stored == sum(want)  # no block kept without its chain above it (R6)


def test_a_lost_main_tree_root_loses_no_block(tmp_path: Path) -> None:
    """The main tree names the records tree's root: with its page gone every leaf is cut off."""
    store = tmp_path / "store"
    chains, blocks = build(store, chains=60)
    data = store / "data.mdb"
    root = read_header(data).main_tree.root
    with data.open("r+b") as f:
        f.seek(root * PAGE)
        f.write(bytes(PAGE))
    report = check_store(store, repair=True)
    assert report.repaired and report.blocks_kept == len(blocks), report.lines()
    assert check_store(store, repair=False).ok
    assert served(store, chains, blocks) == ([LENGTH] * len(chains), len(blocks))


def test_freed_pages_bring_no_purged_block_back(tmp_path: Path) -> None:
    """LMDB leaves a freed page's bytes in place: the leaves a purge rewrote still hold the purged
    blocks' records. The free tree lists those pages, and the scan passes them by."""
    store = tmp_path / "store"
    chains, blocks = build(store, chains=100)
    settings = StoreSettings(data_dir=store, capacity_bytes=1 << 30, block_tokens=16)
    tier = LmdbBlockTier(settings, clock=ManualClock())
    purged = [h for chain in chains[::2] for h in chain]
    assert tier.purge(SCOPE, [chain[0] for chain in chains[::2]]) == len(purged)
    tier.close()
    data = store / "data.mdb"
    with data.open("r+b") as f:  # lose the main tree's root: every records leaf is found by the scan
        f.seek(read_header(data).main_tree.root * PAGE)
        f.write(bytes(PAGE))
    assert surviving(data.read_bytes(), {h: blocks[h] for h in purged})  # stale copies are there to find
    report = check_store(store, repair=True)
    assert report.repaired and report.blocks_kept == len(blocks) - len(purged), report.lines()
    kept = [chain for chain in chains[1::2]]
    assert served(store, kept, blocks) == ([LENGTH] * len(kept), len(blocks) - len(purged))
