"""A Put's write transaction: the blocks it protects, the room made for it, its blocks stored.

`tiers.lmdb_tier.LmdbBlockTier.put_many` hands its batches here with the rules room is
made under (`RoomRules`). In one durable transaction, batch by batch: nothing a batch
names, nor the parent it extends, may go to make room for it (R12); its namespace's quota
is made room under first (R19), then the store's capacity, least recently used first
(`tiers/eviction.py`); its new blocks are inserted and the ones already stored are touched
(R5). A write the map or the disk has no room for is refused as ResourceExhausted (R8).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import lmdb

from kvstore.errors import FailedPrecondition, ResourceExhausted
from kvstore.native import blockcopy
from kvstore.prefix import BlockScope
from tiers import namespaces, pins
from tiers.block_txn import BlockTxn, PutBatch, PutResult
from tiers.damage import DamagedBlocks, refused_write
from tiers.eviction import Candidates, Evicted, SkippedRuns, make_quota_room, make_room
from tiers.retention import NamespaceRetention, Retention


@dataclass(frozen=True, kw_only=True)
class RoomRules:
    """What room is made for a Put under.

    Attributes:
        rule: the store's retention rule (its floor).
        retention: each namespace's retention (R18).
        quota_of: a namespace's NVMe quota in bytes, 0 for none (R19), for a batch without one.
        capacity_bytes: the store's capacity.
        skipped: where eviction's walks of the LRU index start (R18).
        pin_limits: a namespace's limits on pins (R24).
    """

    rule: Retention
    retention: NamespaceRetention
    quota_of: Callable[[str], int]
    capacity_bytes: int
    skipped: SkippedRuns
    pin_limits: Callable[[str], pins.PinLimits] = lambda namespace: pins.PinLimits()


def commit_puts(write: Callable[[], AbstractContextManager[BlockTxn]], damage: DamagedBlocks,
                batches: Sequence[PutBatch], *, now_s: float, pinned: Callable[[], Iterable[bytes]],
                room: RoomRules, data_dir: Path, on_refused: Callable[[], None]) -> tuple[list[PutResult], Evicted]:
    """Apply `batches` in one durable transaction (`write`); a refusal is counted and raised as ResourceExhausted.

    Args:
        write: the tier's write transaction, committed with its bookkeeping.
        damage: the blocks known on damaged pages (protected; a write meeting a new one is retried).
        batches: the Put batches, in order.
        now_s: retention time now.
        pinned: the keys leases pin now.
        room: the rules room is made under.
        data_dir: the store's folder (named when the disk refuses the write).
        on_refused: counts a refused Put.
    """
    try:
        return damage.retry(lambda: _put_all(write, damage, batches, now_s, pinned, room), "this Put")
    except lmdb.Error as exc:
        refusal = refused_write(exc, data_dir)
        if refusal is None:
            raise
        on_refused()
        raise refusal from None
    except ResourceExhausted:
        on_refused()
        raise


def _put_all(write: Callable[[], AbstractContextManager[BlockTxn]], damage: DamagedBlocks,
             batches: Sequence[PutBatch], now: float, pinned: Callable[[], Iterable[bytes]],
             room: RoomRules) -> tuple[list[PutResult], Evicted]:
    results: list[PutResult] = []
    blocks = freed = 0
    with write() as w:
        pins.sweep(w, now)  # R25: pins past their time go, a bounded number per Put
        # R23: a block a live pin holds is kept like a leased one (and by R6 its prefix).
        protected = pins.Protected(set(pinned()) | damage.snapshot(),
                                   lambda key: pins.holds(w.txn, w.dbs.pins, key, now))
        for batch in batches:
            result, evicted = _put_in(w, batch, now, protected, room)
            results.append(result)
            blocks, freed = blocks + evicted.blocks, freed + evicted.freed_bytes
    return results, Evicted(blocks=blocks, freed_bytes=freed)


def _put_in(w: BlockTxn, batch: PutBatch, now: float, protected: set[bytes],
            room: RoomRules) -> tuple[PutResult, Evicted]:
    parent_depth = _parent_depth(w, batch.scope, batch.parent_hash, batch.is_root, batch.first_depth)
    scope_key, meta = batch.scope.key, w.meta  # bound once: these run for every block of the Put
    keys = [scope_key(h) for h in batch.hashes]
    # R12: nothing this Put names, nor the parent it extends (and so, by R6, no
    # block above it), may go to make room for it.
    protected.update(keys)
    if not batch.is_root:
        protected.add(batch.scope.key(batch.parent_hash))
    fresh = [meta(k) is None for k in keys]
    need = sum(len(b) for b, f in zip(batch.blocks, fresh, strict=True) if f)
    ns_id = namespaces.id_of_key(batch.scope.prefix)
    w.namespace_names.setdefault(ns_id, batch.scope.namespace)
    can = Candidates(rule=room.rule, now_s=now, protected=protected,
                     retention_of=room.retention.for_keys(w.namespace_name), skipped=room.skipped)
    evicted = Evicted()
    quota = batch.quota_bytes if batch.quota_bytes is not None else room.quota_of(batch.scope.namespace)
    if quota:
        evicted = make_quota_room(w, ns_id, need, quota_bytes=quota, namespace=batch.scope.namespace, can=can)
    evicted += make_room(w, need, capacity_bytes=room.capacity_bytes, rule=room.rule, now_s=now,
                         protected=protected, retention_of=can.retention_of, skipped=room.skipped)
    # F19: a fleet copy carries its source's last use; the later of the two copies' counts.
    uses = [now] * len(keys) if batch.last_use_s is None else [min(u, now) for u in batch.last_use_s]
    blocks, hashes, sums = batch.blocks, batch.hashes, batch.checksums
    i = 0
    while i < len(keys):  # index order: runs of new blocks stored in one loop each, stored ones touched
        if not fresh[i]:
            w.touch(keys[i], uses[i])  # R5: putting a stored block again is a use of it
            i += 1
            continue
        j = i
        while j < len(keys) and fresh[j]:
            j += 1
        # Checksums taken off the transaction where the caller did (the stream's reader), else here.
        run_sums = sums[i:j] if sums is not None else blockcopy.digests(blocks[i:j])
        w.insert_run(keys[i:j], batch.parent_hash if i == 0 else hashes[i - 1], parent_depth + i + 1, blocks[i:j],
                     run_sums, now, batch.is_root and i == 0, last_use_s=uses[i:j])
        i = j
    written = sum(fresh)
    grant = None
    if batch.keep_until_s is not None and keys:  # R22: the pin commits with the blocks it protects
        grant = pins.grant(w, keys[-1], batch.keep_until_s, now_s=now, limits=room.pin_limits(batch.scope.namespace))
    return PutResult(written_blocks=written, existing_blocks=len(keys) - written, written_bytes=need,
                     pin=grant, evicted_blocks=evicted.blocks, evicted_bytes=evicted.freed_bytes), evicted


def _parent_depth(w: BlockTxn, scope: BlockScope, parent_hash: bytes, is_root: bool,
                  first_depth: int | None = None) -> int:
    if is_root:
        return 0
    meta = w.meta(scope.key(parent_hash))
    if first_depth is not None:  # F17: a fleet copy of a run whose parent may live on another node
        if meta is not None and meta.depth != first_depth - 1:
            raise FailedPrecondition(f"parent block {parent_hash.hex()[:16]}... is stored at depth {meta.depth}, "
                                     f"but the copy puts its child at depth {first_depth}")
        return first_depth - 1
    if meta is None:
        raise FailedPrecondition(
            f"parent block {parent_hash.hex()[:16]}... is not stored; put the prefix first"
        )
    return meta.depth
