"""Runs transfer batches: copies between LMDB's map and mapped client regions.

Reads copy each block from the map into the region after checking its checksum
(`LmdbBlockTier.read_into`), one read transaction per chunk; writes snapshot the
region's bytes (so a client scribbling on them mid-write cannot break the
checksum) and store them with `LmdbBlockTier.put`, with Put's checks and
durability. No block byte crosses the gRPC channel.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from gateway import validate
from gateway.transfer_sessions import Session, SessionTable, Transfer
from kvstore.errors import InvalidArgument, KVStoreError, to_status
from kvstore.transfer import Descriptor, DescriptorResult, Status
from tiers.lmdb_tier import LmdbBlockTier, ReadStatus


def failed(error: KVStoreError) -> DescriptorResult:
    """The result of a descriptor that failed with `error`."""
    return DescriptorResult(status=Status.FAILED, code=to_status(error).name, reason=error.message)


def resolve_spans(table: SessionTable, session: Session, descriptors: Sequence[Descriptor], block_bytes: int,
                  results: list[DescriptorResult]) -> list[memoryview | None]:
    """Each descriptor's bytes in its region, or None with its failure recorded (rule 4)."""
    spans: list[memoryview | None] = []
    for i, d in enumerate(descriptors):
        try:
            if d.length_bytes != block_bytes:
                raise InvalidArgument(
                    f"descriptor {i} length_bytes is {d.length_bytes}; blocks of this geometry are {block_bytes} bytes")
            spans.append(table.span(session, d.region_id, d.offset_bytes, d.length_bytes))
        except KVStoreError as exc:
            results[i] = failed(exc)
            spans.append(None)
    return spans


@dataclass(frozen=True, kw_only=True)
class ReadBatch:
    """A validated read batch: storage keys (None where the hash is bad) and spans."""

    keys: list[bytes | None]
    spans: list[memoryview | None]
    prefix_only: bool


async def run_read(tier: LmdbBlockTier, session: Session, transfer: Transfer, batch: ReadBatch,
                   chunk: int) -> None:
    """Copy a read batch's blocks into their regions, chunk by chunk, then restart their retention clocks."""
    results = transfer.results
    keys, spans = batch.keys, list(batch.spans)
    end = len(keys)
    if batch.prefix_only:
        # The contiguous prefix ends at the first descriptor that cannot be loaded.
        end = next((i for i, s in enumerate(spans) if s is None), end)
    found: list[bytes] = []
    try:
        start = 0
        while start < end:
            if session.closed:
                break
            stop = min(start + chunk, end)
            statuses = await tier.call(tier.read_into, keys[start:stop], spans[start:stop], batch.prefix_only)
            for i, status in enumerate(statuses, start):
                key = keys[i]
                if status is ReadStatus.FOUND and key is not None:
                    results[i] = DescriptorResult(status=Status.DONE, bytes_moved=len(spans[i] or b""))
                    found.append(key)
                elif status is ReadStatus.MISSING:
                    results[i] = DescriptorResult(status=Status.MISSING)
                elif status is ReadStatus.CORRUPT:
                    results[i] = DescriptorResult(status=Status.FAILED, code="DATA_LOSS",
                                                  reason="the stored block failed its checksum and was dropped")
            if batch.prefix_only and any(s is not ReadStatus.FOUND for s in statuses):
                end = start + next(j for j, s in enumerate(statuses) if s is not ReadStatus.FOUND) + 1
                break
            start = stop
    finally:
        del spans  # drop the views of the client's pages before the batch counts as done
        _finish(results, end, batch.prefix_only, session.closed)
        tier.count_get(len(keys), len(found))
        # Done before the touch: the bytes are in the region, and the retention
        # clock's durable restart (one fsync) need not delay the worker.
        transfer.done.set()
        if found:
            await asyncio.wrap_future(tier.touch_soon(found))


async def run_write(tier: LmdbBlockTier, session: Session, transfer: Transfer, plan: validate.PutPlan,
                    spans: list[memoryview | None], max_put_blocks: int) -> None:
    """Store a write batch's blocks from their regions, in chain order.

    Blocks are stored up to the first descriptor that failed: a later block's
    parent would be missing, so those fail too, naming the one that broke the chain.
    """
    results = transfer.results
    end = next((i for i, s in enumerate(spans) if s is None), len(spans))
    parent = plan.parent
    try:
        for start in range(0, end, max_put_blocks):
            if session.closed:
                break
            stop = min(start + max_put_blocks, end)
            blocks = [bytes(s) for s in spans[start:stop] if s is not None]  # snapshot: see module doc
            hashes = plan.hashes[start:stop]
            try:
                await tier.call(tier.put, session.scope, parent, hashes, blocks, plan.is_root and start == 0)
            except KVStoreError as exc:
                for i in range(start, len(spans)):
                    if results[i].status is Status.PENDING:
                        results[i] = failed(exc)
                return
            for i in range(start, stop):
                results[i] = DescriptorResult(status=Status.DONE, bytes_moved=len(blocks[i - start]),
                                              block_hash=plan.hashes[i])
            parent = hashes[-1]
    finally:
        spans.clear()
        if end < len(results):
            for i in range(end, len(results)):
                if results[i].status is Status.PENDING:
                    results[i] = DescriptorResult(status=Status.FAILED, code="FAILED_PRECONDITION",
                                                  reason=f"not stored: descriptor {end} before it failed, "
                                                  "so its parent block is missing")
        _finish(results, len(results), False, session.closed)
        transfer.done.set()


def _finish(results: list[DescriptorResult], end: int, prefix_only: bool, closed: bool) -> None:
    """Settle every descriptor still PENDING: skipped after a prefix ended, else failed."""
    for i, r in enumerate(results):
        if r.status is not Status.PENDING:
            continue
        if closed:
            results[i] = DescriptorResult(status=Status.FAILED, code="CANCELLED", reason="the session ended")
        elif prefix_only and i >= end:
            results[i] = DescriptorResult(status=Status.SKIPPED, reason="after the first block not loaded")
        else:  # pragma: no cover - every reached descriptor has a result
            results[i] = DescriptorResult(status=Status.FAILED, code="INTERNAL", reason="not reached")
