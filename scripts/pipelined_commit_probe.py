"""Raw LMDB, durable commits in turns: LMDB's own flush under its write lock (`sync=True`) against the flush
moved out of the lock with the next transaction's body beside it (docs/BENCHMARKS.md, the tenth round; the
store's way since R34-R36, docs/RETENTION.md).

Each transaction puts 64 blocks of 56,960 B and three small records per block under random 48-byte keys, as a
Put does; `BODY_US` adds that many microseconds of Python per block inside the transaction (the service's
own work). The pipelined loop keeps one commit at most not yet flushed (R35): a transaction commits only once
the flush of the one before has returned.

    BODY_US=25 python scripts/pipelined_commit_probe.py /tmp/pcp 8192 6    # folder, blocks, rounds
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lmdb

BATCH = 64
BLOCK = 56_960
BODY_US = float(os.environ.get("BODY_US", "0"))
_BLOCKS = [os.urandom(BLOCK) for _ in range(BATCH)]


def _body(txn: lmdb.Transaction, db: Any, first: int) -> None:
    for i in range(first, first + BATCH):
        key = hashlib.sha256(i.to_bytes(8, "big")).digest()[:16] * 3
        txn.put(key + b"d", _BLOCKS[i % BATCH], db=db)
        txn.put(key + b"m", b"x" * 60, db=db)
        txn.put(key + b"c" + b"y" * 32, b"", db=db)
        txn.put(b"L" + i.to_bytes(8, "big"), b"", db=db)
        if BODY_US:
            end = time.perf_counter() + BODY_US / 1e6
            while time.perf_counter() < end:
                pass


def serial(path: Path, blocks: int) -> float:
    """Seconds for `blocks` with LMDB flushing each commit under its lock."""
    env = lmdb.open(str(path), map_size=8 << 30, sync=True, metasync=True, readahead=False, max_dbs=4)
    db = env.open_db(b"r")
    start = time.perf_counter()
    for first in range(0, blocks, BATCH):
        with env.begin(write=True) as txn:
            _body(txn, db, first)
    seconds = time.perf_counter() - start
    env.close()
    return seconds


def pipelined(path: Path, blocks: int) -> float:
    """Seconds for `blocks` with each commit flushed on another thread while the next body runs."""
    env = lmdb.open(str(path), map_size=8 << 30, sync=False, metasync=True, readahead=False, max_dbs=4)
    db = env.open_db(b"r")
    env.sync(True)
    flushed = threading.Event()
    flushed.set()

    def flush() -> None:
        env.sync(True)
        flushed.set()

    start = time.perf_counter()
    for first in range(0, blocks, BATCH):
        txn = env.begin(write=True)
        _body(txn, db, first)
        flushed.wait()  # R35: the commit before is flushed before this one writes its pages
        txn.commit()
        flushed.clear()
        threading.Thread(target=flush).start()
    flushed.wait()
    seconds = time.perf_counter() - start
    env.close()
    return seconds


def main(folder: Path, blocks: int, rounds: int) -> None:
    for r in range(rounds):
        order = [("serial", serial), ("pipelined", pipelined)]
        seconds = {}
        for name, run in order if r % 2 == 0 else order[::-1]:
            path = folder / name
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            seconds[name] = run(path, blocks)
        gb = blocks * BLOCK / 1e9
        print(f"serial {gb / seconds['serial']:.3f} GB/s  pipelined {gb / seconds['pipelined']:.3f} GB/s  "
              f"pipelined/serial {seconds['serial'] / seconds['pipelined']:.3f}")
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/pipelined-commit-probe"),
         int(sys.argv[2]) if len(sys.argv) > 2 else 4096, int(sys.argv[3]) if len(sys.argv) > 3 else 3)
