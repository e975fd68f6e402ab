"""How much of a durable Put's commit is LMDB's meta-page flush: the most that overlapping it with the next
transaction could save (docs/BENCHMARKS.md, `bench store`, helper M6, issue 25 item 1).

Kept for that entry's figures. Since R34-R36 (docs/RETENTION.md) the store opens LMDB with `sync=False` and
flushes each commit itself inside `put_many`, so the flush timed here after it finds nothing left to write;
`scripts/pipelined_commit_probe.py` measures what replaced it.

With `metasync=True` (the store's setting, tiers/datadir.py) a commit writes its pages, fdatasyncs them, then writes
the meta page through an O_DSYNC descriptor, all under LMDB's writer lock. Here the tier is opened with
`metasync=False` and the meta page is flushed after each commit by `env.sync(True)`, timed apart: the same work, split
in two, each group's two parts timed in the same group (paired, so a slow disk moment hits both).

    python scripts/meta_flush_probe.py /tmp/mfp 40     # folder on the disk to measure, groups

Prints the medians of `put_many` (body and commit, data fdatasync'd) and of the meta flush, and the flush's share of
the two: the ceiling of the overlap's gain for groups of this size (3 batches of 64 blocks of 64 tokens, a
`bench store` TCP round's commit).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lmdb

import tiers.datadir
from kvstore.config import StoreSettings
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope, chain_hashes, root_hash
from tiers.lmdb_tier import LmdbBlockTier, PutBatch

BLOCK_TOKENS = 64
BATCH_BLOCKS = 64
GROUP_BATCHES = 3


def open_tier(folder: Path) -> LmdbBlockTier:
    """A fresh tier in `folder`, its environment opened with metasync=False (the meta page left to `env.sync`)."""
    shutil.rmtree(folder, ignore_errors=True)
    real_open = lmdb.open

    def without_metasync(*args: Any, **kwargs: Any) -> lmdb.Environment:
        return real_open(*args, **{**kwargs, "metasync": False})

    tiers.datadir.lmdb.open = without_metasync  # type: ignore[assignment]
    try:
        return LmdbBlockTier(StoreSettings(data_dir=folder, capacity_bytes=8 << 30, block_tokens=BLOCK_TOKENS))
    finally:
        tiers.datadir.lmdb.open = real_open  # type: ignore[assignment]


def main(folder: Path, groups: int) -> None:
    block_bytes = V4_1_FLASH.block_bytes(BLOCK_TOKENS)
    scope, root = BlockScope(V4_1_FLASH.fingerprint, "default"), root_hash(V4_1_FLASH.fingerprint, BLOCK_TOKENS)
    pool = os.urandom(block_bytes * BATCH_BLOCKS)
    blocks = [pool[i * block_bytes:(i + 1) * block_bytes] for i in range(BATCH_BLOCKS)]
    tier = open_tier(folder)
    commit_ms: list[float] = []
    flush_ms: list[float] = []
    try:
        for g in range(groups):
            group = []
            for b in range(GROUP_BATCHES):
                first = (g * GROUP_BATCHES + b) * BATCH_BLOCKS * BLOCK_TOKENS
                hashes = chain_hashes(list(range(first, first + BATCH_BLOCKS * BLOCK_TOKENS)),
                                      block_tokens=BLOCK_TOKENS, parent=root)
                group.append(PutBatch(scope=scope, parent_hash=root, hashes=hashes, blocks=blocks, is_root=True))
            start = time.perf_counter()
            tier.put_many(group)
            committed = time.perf_counter()
            tier.env.sync(True)
            commit_ms.append((committed - start) * 1e3)
            flush_ms.append((time.perf_counter() - committed) * 1e3)
    finally:
        tier.close()
        shutil.rmtree(folder, ignore_errors=True)
    shares = [f / (c + f) for c, f in zip(commit_ms, flush_ms, strict=True)]
    mib = GROUP_BATCHES * BATCH_BLOCKS * block_bytes / 2**20
    print(f"{groups} groups of {mib:.1f} MiB, load {os.getloadavg()[0]:.1f}: put_many median "
          f"{statistics.median(commit_ms):.2f} ms, meta flush median {statistics.median(flush_ms):.3f} ms; "
          f"the flush's share median {statistics.median(shares):.1%} (range {min(shares):.1%}-{max(shares):.1%})")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/meta-flush-probe"),
         int(sys.argv[2]) if len(sys.argv) > 2 else 40)
