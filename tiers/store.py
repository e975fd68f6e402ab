"""The block store seam: what the gateway's servicers and transfer paths see of a store.

`BlockStore` is the one interface (issue 23, "How"): Lookup with leases, batched
Puts, verified reads, durable refreshes, counters and usage. Capabilities sit
beside it, each a Protocol a store may also meet:

- `FoundReads` and `AnchoredLookup`: a read with no side effect (the service answers a small Get on its
  event loop with it), a next turn's Lookup from its anchor.
- `MappedReads`: reading straight out of LMDB's map (staged reads whose copy runs
  on another thread, the request ring's and the bulk transport's raw read txns).
  Only a store on this host's LMDB has it; the transfer service needs it, so a store
  without it (the fleet's router) serves the KVStore API through plain `read`.
- `PipelinedPuts`: `put_many` in two steps, committed then durable, so a group commit goes on to its
  next transaction while the disk flushes the last (docs/RETENTION.md R34-R35).
- `ManagedStore`: purge, export and import, the namespaces' retention and quotas:
  what the Admin service needs of the store it runs on.

Implementations: `tiers.lmdb_tier.LmdbBlockTier` (all of them) and, next, the
fleet's router (`BlockStore` only, over the fleet's nodes), each checked by one
contract suite (tests/tiers/test_store_contract.py). The
import rule (docs/ARCHITECTURE.md): gateway modules name these Protocols, never
the LMDB tier; only the composition (`gateway/server.py`) builds one.

Every method but `call` blocks; the service runs them through `call`, on the store's own
bounded executor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar, runtime_checkable

from kvstore.clock import Clock
from kvstore.config import StoreSettings
from kvstore.prefix import BlockScope
from tiers.accounting import TierStats
from tiers.block_txn import PutBatch, PutResult
from tiers.durable import Committed
from tiers.export import BlockRecord, ExportRecord
from tiers.leases import Lease
from tiers.lmdb_map import LmdbMap
from tiers.namespaces import NamespaceUsage
from tiers.pins import Pin, PinGrant, PinLimits, PinTotals
from tiers.reads import ReadStatus, StagedReads
from tiers.retention import RetentionClock

__all__ = ["AnchoredLookup", "BlockStore", "FoundReads", "ManagedStore", "MappedReads", "MappedStore",
           "NamespaceUsage", "PinningStore", "PipelinedPuts", "PutBatch", "PutResult", "ReadStatus", "RunLookup",
           "StagedReads"]

T = TypeVar("T")


@runtime_checkable
class BlockStore(Protocol):
    """Global-KV blocks by storage key (`BlockScope.key`), chains kept as prefixes (docs/RETENTION.md).

    Attributes:
        settings: the store's settings (block size, limits, retention) the servicers answer with.
        clock: the time source of its leases and counters.
    """

    settings: StoreSettings
    clock: Clock

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking store work on the store's executor."""
        ...

    def lookup(self, scope: BlockScope, hashes: Sequence[bytes], lease_s: float = 0.0, *,
               touch_due: list[bytes] | None = None) -> tuple[int, Lease | None]:
        """How many leading blocks of `hashes` are stored as one chain (R15), and a lease on them if asked.

        `touch_due`, when given, receives the keys whose retention clock is due a restart (R5). It never
        writes (the refresh is the caller's, through `touch_soon`): the service runs a short one on its event loop.
        """
        ...

    def release(self, lease_id: str, *, owns: Callable[[bytes], bool] | None = None) -> bool:
        """Drop a lease; False when it is unknown, expired, or pins a key `owns` refuses."""
        ...

    def put_many(self, batches: Sequence[PutBatch]) -> list[PutResult]:
        """Store Put batches durably, in order, all or none; acknowledged only once durable.

        Raises:
            FailedPrecondition: a batch's parent is not stored.
            ResourceExhausted: no room without evicting a protected block, or over a quota.
            DataLoss: the records a Put needs are damaged.
        """
        ...

    def read(self, keys: Sequence[bytes], copy: Callable[[int, memoryview], Any] | None = None
             ) -> list[tuple[ReadStatus, Any]]:
        """(status, data) per key, each FOUND block verified against its checksum.

        `copy(index, view)`, when given, turns a FOUND block's bytes into what is returned
        (the view is valid only during the call); without it the data is the bytes.
        A CORRUPT block is never returned.
        """
        ...

    def touch_soon(self, keys: Sequence[bytes]) -> Future[None]:
        """Queue a use of `keys` (their retention clocks restart); the future resolves once durable."""
        ...

    def count_get(self, asked_blocks: int, returned_blocks: int) -> None:
        """Count one Get: blocks asked for and blocks returned."""
        ...

    def stats(self) -> TierStats:
        """Counters, usage and retention headroom now."""
        ...

    def namespace_usage(self, namespace: str) -> NamespaceUsage:
        """The blocks, bytes and token-hours `namespace` stores (R17)."""
        ...


@runtime_checkable
class PipelinedPuts(Protocol):
    """`put_many` in two steps (R34-R35): `commit_many` returns once the batches are committed, `durable`
    once that commit is durable. Nothing may be acknowledged between the two."""

    def commit_many(self, batches: Sequence[PutBatch]) -> Committed[list[PutResult]]:
        """`put_many`'s transaction, committed, not yet known durable."""
        ...

    async def durable(self, committed: Committed[T]) -> T:
        """`committed`'s value once its commit is durable."""
        ...

    def on_durable(self, committed: Committed[T], then: Callable[[BaseException | None], None]) -> None:
        """Run `then(None)` once `committed` is durable, `then(error)` if its flush failed (on another thread)."""
        ...


@runtime_checkable
class AnchoredLookup(Protocol):
    """The capability of a next turn's Lookup from its anchor, with work in the new hashes only
    (docs/PREFIX_HASHING.md A5): a store on this host's LMDB has it; the fleet's router does not."""

    def lookup_after(self, scope: BlockScope, anchor_hash: bytes, anchor_blocks: int, hashes: Sequence[bytes],
                     lease_s: float = 0.0, *, touch_due: list[bytes] | None = None) -> tuple[int, Lease | None] | None:
        """`lookup` of the chain of `anchor_blocks` blocks ending at `anchor_hash`, then `hashes`; found counts
        from the first block. None when the anchor is not stored at that depth in `scope` (nothing leased)."""
        ...


@runtime_checkable
class RunLookup(Protocol):
    """The capability of a fleet node's Lookup of several runs in one read txn (docs/FLEET.md F50, F75): a store
    on this host's LMDB has it; a store without it is asked run by run through `lookup`."""

    def lookup_runs(self, scope: BlockScope, hashes: Sequence[bytes], lengths: Sequence[int], lease_s: float = 0.0,
                    *, touch_due: list[bytes] | None = None) -> list[tuple[int, Lease | None]]:
        """`lookup` of each run of `hashes` cut by `lengths` (each its own chain from the root), as (found, lease)."""
        ...

    def lookup_run_anchors(self, scope: BlockScope, anchors: Sequence[bytes], lengths: Sequence[int],
                           lease_s: float = 0.0, *,
                           touch_due: list[bytes] | None = None) -> list[tuple[int, Lease | None]]:
        """Each run named by its last hash: (its length, lease) when stored at that depth, else (0, None) (F77)."""
        ...


@runtime_checkable
class FoundReads(Protocol):
    """The capability of a read with no side effect, all found or nothing: a store on this host's LMDB
    has it. It never writes (a `read` that meets a corrupt block drops it, a write txn), so the KVStore
    service runs a small one on its event loop instead of hopping to the executor and back."""

    def read_found(self, keys: Sequence[bytes], copy: Callable[[int, memoryview], Any] | None = None, *,
                   touch_due: list[bytes] | None = None) -> list[Any] | None:
        """Each block's data (as `read` returns it) when all are stored and intact; None at the first that is
        not (nothing noted nor dropped: read them through `read`). The keys due a refresh (R5) go to `touch_due`."""
        ...


@runtime_checkable
class MappedReads(Protocol):
    """The capability of reading blocks straight out of LMDB's map (the transfer paths).

    Attributes:
        map: read txns and figures of the map (`tiers.lmdb_map.LmdbMap`).
        retention_clock: the clock the blocks' last uses are recorded on (their due times).
    """

    map: LmdbMap
    retention_clock: RetentionClock

    def stage_reads(self, keys: Sequence[bytes | None]) -> StagedReads:
        """Look blocks up (None: skip that one), leaving their read txn open for `StagedReads.copy`."""
        ...


@runtime_checkable
class MappedStore(BlockStore, MappedReads, Protocol):
    """A `BlockStore` with `MappedReads`: what the transfer service runs on."""


@runtime_checkable
class ManagedStore(BlockStore, Protocol):
    """A `BlockStore` an operator manages through the Admin service: purge, export, import, policies."""

    def purge(self, scope: BlockScope, hashes: Sequence[bytes] | None) -> int:
        """Remove the named blocks with every block below them (None: all of the namespace); how many went."""
        ...

    def export_records(self, namespace: str) -> Iterator[ExportRecord]:
        """Every block of `namespace`, verified, parents first (R21); `next()` blocks."""
        ...

    def import_records(self, records: Iterable[BlockRecord], namespace: str | None = None,
                       quota_bytes: int | None = None) -> int:
        """Write exported records back, durably; how many blocks were new."""
        ...

    def set_retention_provider(self, provider: Callable[[str], float] | None) -> None:
        """Give each namespace its own retention (R18); None: the store's for all."""
        ...

    def set_quota_provider(self, provider: Callable[[str], int] | None) -> None:
        """Give each namespace an NVMe quota (R19); None: no quotas."""
        ...


@runtime_checkable
class PinningStore(BlockStore, Protocol):
    """A `BlockStore` that keeps prefixes until a given time (pins, docs/RETENTION.md R22-R27).

    Its `put_many` honours `PutBatch.keep_until_s` and answers `PutResult.pin`.
    """

    def pin(self, scope: BlockScope, block_hash: bytes, until_s: float) -> PinGrant:
        """Keep the stored block and its prefix until `until_s`; what was granted, or why not."""
        ...

    def pins_of(self, namespace: str) -> tuple[PinTotals, list[Pin]]:
        """The namespace's live pins: totals and each pin."""
        ...

    def drop_pins(self, namespace: str) -> int:
        """Drop every pin of the namespace; how many were live."""
        ...

    def set_pin_limits_provider(self, provider: Callable[[str], PinLimits] | None) -> None:
        """Give each namespace its own limits on pins (R24); None: the store's settings for all."""
        ...
