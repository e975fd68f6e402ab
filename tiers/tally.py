"""What the NVMe tier counts as it serves, under one lock: its counters, the recent write
rate and the usage totals of its newest commit.

`tiers.lmdb_tier.LmdbBlockTier` tells the tally each call's outcome; every write saves the
counters with it (R13), and `stats` reads one consistent snapshot of the three.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import asdict, fields

from tiers.accounting import Counters, WriteRate
from tiers.block_txn import PutResult
from tiers.eviction import Evicted
from tiers.usage import Usage

#: The counters' names in their declared order: what `dataclasses.asdict` would walk on every commit
#: (with a deep copy of each value: ~5x the time of reading the fields by name; docs/BENCHMARKS.md).
_COUNTER_NAMES = tuple(f.name for f in fields(Counters))


class Tally:
    """The tier's running counts.

    Args:
        counters: the counters as persisted (`Counters.load`).
        usage: the usage totals as committed when the store opened.
        write_rate: the recent write rate's window.
    """

    def __init__(self, counters: Counters, usage: Usage, write_rate: WriteRate) -> None:
        self._lock = threading.Lock()
        self._counters = counters
        self._usage = usage
        self._usage_txn = 0  # id of the commit `_usage` comes from
        self._write_rate = write_rate

    def lookup(self, *, asked_tokens: int, found_tokens: int) -> None:
        """Count one Lookup: tokens asked about, and the leading tokens found."""
        with self._lock:
            self._counters.lookups += 1
            self._counters.lookup_tokens_asked += asked_tokens
            self._counters.lookup_tokens_found += found_tokens

    def get(self, *, asked_tokens: int, returned_tokens: int) -> None:
        """Count one Get: tokens asked for and tokens actually returned."""
        with self._lock:
            self._counters.gets += 1
            self._counters.get_tokens_asked += asked_tokens
            self._counters.get_tokens_returned += returned_tokens

    def put(self, results: Sequence[PutResult], evicted: Evicted, now_s: float) -> None:
        """Count a group commit's Puts (each its own), what they evicted, and their bytes in the write rate."""
        with self._lock:
            self._counters.evictions += evicted.blocks
            self._counters.evicted_bytes += evicted.freed_bytes
            for r in results:
                self._counters.puts += 1
                self._counters.blocks_written += r.written_blocks
                self._counters.bytes_written += r.written_bytes
                self._write_rate.note(now_s, r.written_bytes)

    def imported(self, results: Sequence[PutResult], evicted: Evicted) -> None:
        """Count an import's commit: the blocks it wrote and what it evicted."""
        with self._lock:
            self._counters.evictions += evicted.blocks
            self._counters.evicted_bytes += evicted.freed_bytes
            self._counters.imported_blocks += sum(r.written_blocks for r in results)

    def purged(self, blocks: int) -> None:
        """Count blocks a purge removed."""
        with self._lock:
            self._counters.purged_blocks += blocks

    def damaged(self) -> None:
        """Count one corrupt block (a checksum that failed, or a block on a damaged page)."""
        with self._lock:
            self._counters.corrupt_blocks += 1

    def damaged_on_page(self) -> None:
        """Count one block a damaged page turned into a miss (also one corrupt block)."""
        with self._lock:
            self._counters.corrupt_blocks += 1
            self._counters.damaged_blocks += 1

    def rejected(self) -> None:
        """Count one refused Put."""
        with self._lock:
            self._counters.rejected_puts += 1

    def saved(self) -> bytes:
        """The counters as a write persists them."""
        with self._lock:
            c = self._counters
            # The same JSON as `asdict`'s (same names, same order): every field is a plain int.
            return json.dumps({name: getattr(c, name) for name in _COUNTER_NAMES}).encode()

    def committed(self, txn_id: int, usage: Usage) -> None:
        """Take the usage totals of commit `txn_id`, unless a newer commit's are held already."""
        with self._lock:
            if txn_id > self._usage_txn:
                self._usage_txn, self._usage = txn_id, usage

    def snapshot(self, now_s: float) -> tuple[Counters, float, int, int]:
        """(a copy of the counters, bytes written per second lately, blocks stored, bytes stored)."""
        with self._lock:
            return (Counters(**asdict(self._counters)), self._write_rate.per_second(now_s),
                    self._usage.blocks, self._usage.stored_bytes)
