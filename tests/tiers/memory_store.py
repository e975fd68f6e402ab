"""`MemoryStore`: a `tiers.store.BlockStore` in a dict, the seam's smallest second implementation.

It keeps what the contract suite (test_store_contract.py) checks of every store: chains
stored as prefixes (R6: a block only on its stored parent), Lookup counting the stored
chain (R15), leases, verified reads, durable refreshes as futures, counters. It has no
map (not `MappedReads`) and no admin side (not `ManagedStore`), like the fleet's router.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from kvstore.clock import Clock
from kvstore.config import StoreSettings
from kvstore.errors import FailedPrecondition
from kvstore.prefix import BlockScope
from tiers.accounting import Counters, TierStats
from tiers.leases import Lease, LeaseTable
from tiers.store import NamespaceUsage, PutBatch, PutResult, ReadStatus

T = TypeVar("T")


@dataclass(frozen=True)
class _Block:
    depth: int
    parent: bytes | None
    data: bytes
    namespace: str


class MemoryStore:
    """Blocks by storage key in memory (see the module's docstring)."""

    def __init__(self, settings: StoreSettings, clock: Clock) -> None:
        self.settings = settings
        self.clock = clock
        self._leases = LeaseTable(clock)
        self.touched: list[bytes] = []
        self.counters = Counters()
        self._blocks: dict[bytes, _Block] = {}
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(2, thread_name_prefix="memory-store")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def lookup(self, scope: BlockScope, hashes: Sequence[bytes], lease_s: float = 0.0, *,
               touch_due: list[bytes] | None = None) -> tuple[int, Lease | None]:
        found = 0
        for i, h in enumerate(hashes):
            block = self._blocks.get(scope.key(h))
            if block is None or block.depth != i + 1 or (i and block.parent != scope.key(hashes[i - 1])):
                break
            found += 1
        deepest = scope.key(hashes[found - 1]) if found else None
        if touch_due is not None and deepest is not None:
            touch_due.append(deepest)
        self.counters.lookups += 1
        return found, self._leases.grant(deepest, lease_s) if deepest is not None and lease_s > 0 else None

    def release(self, lease_id: str, *, owns: Callable[[bytes], bool] | None = None) -> bool:
        return self._leases.release(lease_id, owns=owns)

    def put_many(self, batches: Sequence[PutBatch]) -> list[PutResult]:
        with self._lock:
            staged = dict(self._blocks)  # all or none: swapped in once every batch applied
            results = [self._apply(staged, batch) for batch in batches]
            self._blocks = staged
        self.counters.puts += len(batches)
        return results

    @staticmethod
    def _apply(staged: dict[bytes, _Block], batch: PutBatch) -> PutResult:
        parent = None if batch.is_root else batch.scope.key(batch.parent_hash)
        if parent is not None and parent not in staged:
            raise FailedPrecondition("the parent block is not stored", hint="put the prefix first")
        depth = 0 if parent is None else staged[parent].depth
        written = existing = written_bytes = 0
        for h, data in zip(batch.hashes, batch.blocks, strict=True):
            key, depth = batch.scope.key(h), depth + 1
            if key in staged:
                existing += 1
            else:
                staged[key] = _Block(depth, parent, bytes(data), batch.scope.namespace)
                written, written_bytes = written + 1, written_bytes + len(data)
            parent = key
        return PutResult(written_blocks=written, existing_blocks=existing, written_bytes=written_bytes)

    def read(self, keys: Sequence[bytes], copy: Callable[[int, memoryview], Any] | None = None
             ) -> list[tuple[ReadStatus, Any]]:
        out: list[tuple[ReadStatus, Any]] = []
        for i, key in enumerate(keys):
            block = self._blocks.get(key)
            if block is None:
                out.append((ReadStatus.MISSING, None))
            else:
                out.append((ReadStatus.FOUND, copy(i, memoryview(block.data)) if copy else block.data))
        return out

    def touch_soon(self, keys: Sequence[bytes]) -> Future[None]:
        self.touched.extend(keys)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def count_get(self, asked_blocks: int, returned_blocks: int) -> None:
        self.counters.gets += 1

    def stats(self) -> TierStats:
        used = sum(len(b.data) for b in self._blocks.values())
        free = max(self.settings.capacity_bytes - used, 0)
        return TierStats(counters=self.counters, blocks_stored=len(self._blocks), bytes_stored=used,
                         capacity_bytes=self.settings.capacity_bytes, bytes_free=free, write_rate_bytes_per_s=0.0,
                         headroom_hours=float("inf"), retention_hours=self.settings.retention_hours,
                         active_leases=self._leases.active(), uptime_s=0.0)

    def namespace_usage(self, namespace: str) -> NamespaceUsage:
        mine = [b for b in self._blocks.values() if b.namespace == namespace]
        return NamespaceUsage(blocks=len(mine), stored_bytes=sum(len(b.data) for b in mine), token_hours=0.0)
