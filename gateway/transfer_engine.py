"""Runs transfer batches: copies between LMDB's map and mapped client regions.

Reads copy each block from the map into the region after checking its checksum
(`MappedStore.stage_reads`, then `StagedReads.copy`, on different threads: see
`Copier`), one read transaction per chunk; writes snapshot the
region's bytes (so a client scribbling on them mid-write cannot break the
checksum) and store them with `put_many`, with Put's checks and
durability. No block byte crosses the gRPC channel.

A batch is worked on as columns (`kvstore.transfer`): groups are checked whole
(one vectorized span check per group) and results are a status byte per
descriptor, so the event loop's work per descriptor stays a few slices.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from gateway import validate
from gateway.hit_stats import HitStats
from gateway.transfer_session_table import SessionTable
from gateway.transfer_sessions import Session, Transfer
from kvstore.errors import KVStoreError, to_status
from kvstore.native import blockcopy
from kvstore.prefix import HASH_BYTES
from kvstore.transfer import DONE, FAILED, MISSING, SKIPPED, BatchResults, DescriptorGroup, Op, Spans, check_spans
from tiers.store import MappedStore, PutBatch, StagedReads

log = logging.getLogger("kvstore.transfer")

#: `blockcopy` result code -> transfer status code (0, not reached, leaves a descriptor as it stood).
_CODES = bytes.maketrans(bytes([blockcopy.NOT_REACHED, blockcopy.FOUND, blockcopy.MISSING, blockcopy.CORRUPT]),
                         bytes([0, DONE, MISSING, FAILED]))
_CORRUPT = ("DATA_LOSS", "the stored block failed its checksum and was dropped")


def resolve_spans(table: SessionTable, session: Session, groups: Sequence[DescriptorGroup], op: Op,
                  block_bytes: int, results: BatchResults) -> Spans:
    """Check each descriptor's span in a region of `session`, recording failures (rules 2, 4)."""
    return check_spans(groups, op, block_bytes, results, lambda region_id: table.region(session, region_id).view)


@dataclass(frozen=True, kw_only=True)
class ReadBatch:
    """A checked read batch; its keys and views are cut per chunk by the threads that use them."""

    spans: Spans
    key_prefix: bytes
    block_bytes: int
    prefix_only: bool

    def __len__(self) -> int:
        return len(self.spans)

    def keys(self, lo: int, hi: int) -> list[bytes | None]:
        """Storage keys of descriptors [lo, hi); None where one failed its checks."""
        out: list[bytes | None] = []
        prefix, ok = self.key_prefix, self.spans.ok
        for k, g, a, b in self.spans.pieces(lo, hi):
            base, hashes = self.spans.starts[k], g.block_hashes
            flags = ok[base + a: base + b].tolist()
            out.extend(prefix + hashes[j * HASH_BYTES:(j + 1) * HASH_BYTES] if good else None
                       for j, good in zip(range(a, b), flags, strict=True))
        return out


def read_batch(table: SessionTable, session: Session, groups: Sequence[DescriptorGroup], block_bytes: int,
               results: BatchResults, prefix_only: bool) -> ReadBatch:
    """Check a read batch."""
    spans = resolve_spans(table, session, groups, Op.READ, block_bytes, results)
    return ReadBatch(spans=spans, key_prefix=session.scope.prefix, block_bytes=block_bytes, prefix_only=prefix_only)


class Copier:
    """Runs read chunks in two stages: LMDB lookups on one thread, then checks and copies on `threads`.

    py-lmdb releases the GIL around every get, so lookups spread over several
    threads mostly hand the GIL back and forth (four threads looked up five
    times slower than one on the H200 host). The native copy loop runs without
    the GIL, so copies scale with threads (eight copied 890 MB in a third of
    memcpy's time there). One lookup thread feeding the copy threads gets both.

    A looked-up chunk holds an LMDB reader slot until it is copied, so the
    lookups run at most `2 * threads` chunks ahead of the copies: however many
    batches are in flight, the slots (512) are never exhausted.
    """

    def __init__(self, tier: MappedStore, threads: int) -> None:
        self.tier = tier
        self.threads = threads
        self.staged_limit = 2 * threads
        self._staged = threading.BoundedSemaphore(self.staged_limit)
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="lookup")
        self._copies = ThreadPoolExecutor(threads, thread_name_prefix="copy")

    def copy(self, batch: ReadBatch, lo: int, hi: int, *, inline: bool = False) -> Future[tuple[bytes, list[bytes]]]:
        """Start descriptors [lo, hi) of `batch`; the future holds their status codes and the keys due a touch.

        With `inline`, one copy thread looks the chunk up and copies it: one thread
        hop instead of two, for a small batch whose caller waits on its latency.
        Such a chunk holds its reader slot only while that thread runs, so the
        slots in use stay under `staged_limit + threads`.
        The future cannot be cancelled: once started, a chunk is copied to its end.
        """
        out: Future[tuple[bytes, list[bytes]]] = Future()
        out.set_running_or_notify_cancel()
        if inline:
            self._copies.submit(self._inline, batch, lo, hi, out)
            return out

        def look_up() -> None:
            self._staged.acquire()  # released once the chunk is copied (or fails)
            try:
                staged = self.tier.stage_reads(batch.keys(lo, hi))
            except BaseException as exc:
                self._staged.release()
                out.set_exception(exc)
                return
            try:
                self._copies.submit(run_copy, staged)
            except BaseException as exc:  # shut down between the two stages
                staged.close()
                self._staged.release()
                out.set_exception(exc)

        def run_copy(staged: StagedReads) -> None:
            try:
                due: list[bytes] = []
                codes = staged.copy(batch.spans.cut(lo, hi), batch.prefix_only, touch_due=due)
                out.set_result((codes.translate(_CODES), due))
            except BaseException as exc:
                out.set_exception(exc)
            finally:
                staged.close()  # a no-op after copy; ends the txn if cutting the views failed
                self._staged.release()

        self._lookups.submit(look_up)
        return out

    def _inline(self, batch: ReadBatch, lo: int, hi: int, out: Future[tuple[bytes, list[bytes]]]) -> None:
        # No semaphore here: a copy thread waiting on it could starve the staged
        # chunks queued behind it, which are what release it.
        try:
            due: list[bytes] = []
            staged = self.tier.stage_reads(batch.keys(lo, hi))
            try:
                codes = staged.copy(batch.spans.cut(lo, hi), batch.prefix_only, touch_due=due)
            finally:
                staged.close()  # a no-op after copy; ends the txn if cutting the views failed
            out.set_result((codes.translate(_CODES), due))
        except BaseException as exc:
            out.set_exception(exc)

    def close(self) -> None:
        """Finish queued chunks and stop the threads."""
        self._lookups.shutdown(wait=True)
        self._copies.shutdown(wait=True)


async def run_read(tier: MappedStore, session: Session, transfer: Transfer, batch: ReadBatch,
                   chunk: int, copier: Copier, hit_stats: HitStats | None = None, *, inline: bool = False) -> None:
    """Copy a read batch's blocks into their regions, chunk by chunk, then restart their
    retention clocks durably, and only then mark the batch done.

    Chunks of one batch run in order (a prefix read stops at its first gap);
    chunks of batches submitted together run at once, on `copier`'s threads.
    The refresh goes through `tier.touch_soon`, so batches finishing together
    share one fsync'd commit, as Gets do. A block whose refresh failed is not
    kept for its retention window: its descriptor fails (with the refresh's
    status) rather than answer DONE, and `refresh_failures` counts it. The
    blocks asked and found count as a retrieve of the session's tenant in `hit_stats`.
    `inline`: each chunk is looked up and copied by one thread (`Copier.copy`).
    """
    results = transfer.results
    end = n = len(batch)
    failed = batch.spans.first_failed()
    if batch.prefix_only and failed is not None:
        # The contiguous prefix ends at the first descriptor that cannot be loaded.
        end = failed
    found = 0
    due: list[bytes] = []
    statuses = np.frombuffer(results.statuses, dtype=np.uint8)
    try:
        start = 0
        while start < end:
            if session.closed:
                break
            stop = min(start + chunk, end)
            codes, chunk_due = await _chunk(copier.copy(batch, start, stop, inline=inline))
            hits = _record(results, statuses, start, codes)
            results.bytes_moved += hits * batch.block_bytes
            found += hits
            due.extend(chunk_due)
            loaded = len(codes) - len(codes.lstrip(bytes([DONE])))
            if batch.prefix_only and loaded < len(codes):
                end = start + loaded + 1
                break
            start = stop
    finally:
        del statuses
        _finish(results, end, batch.prefix_only, session.closed)
        tier.count_get(n, found)
        if hit_stats is not None:
            hit_stats.record(session.scope.namespace, "get", n, found)
        try:
            # Durable before DONE: a read the client saw complete keeps its blocks
            # for their retention window even across a crash (docs/RETENTION.md).
            # Blocks touched within the tier's granularity are not due (touch would skip them).
            if due:
                await _refresh(tier, session, batch, results, due)
        finally:
            session.finish(transfer)


async def _refresh(tier: MappedStore, session: Session, batch: ReadBatch, results: BatchResults,
                   due: list[bytes]) -> None:
    """Restart the retention clocks of `due` (keys of DONE blocks), durably; fail their descriptors if it fails."""
    try:
        await asyncio.wrap_future(tier.touch_soon(due))
    except Exception as exc:
        fail_unrefreshed(exc, session, batch.keys(0, len(batch)), results, due)


def fail_unrefreshed(exc: Exception, session: Session, keys: Sequence[bytes | None], results: BatchResults,
                     due: list[bytes]) -> None:
    """Fail the DONE descriptors of `due` blocks: their retention refresh failed with `exc`.

    The bytes were copied, but a block whose clock did not restart may be evicted
    before the window the read promised; the caller must not count on it.
    """
    error = exc if isinstance(exc, KVStoreError) else None
    code = to_status(error).name if error is not None else "INTERNAL"
    reason = (f"copied, but its retention refresh failed ({error.message if error else exc!r}): the block "
              "may be evicted before its retention window ends; do not count on it")
    wanted = set(due)
    failed = [i for i in np.flatnonzero(np.frombuffer(results.statuses, dtype=np.uint8) == DONE).tolist()
              if keys[i] in wanted]
    results.fail_all(dict.fromkeys(failed, reason), code)
    session.counters.add_refresh_failures(len(failed))
    log.warning("transfer read: the retention refresh of %d blocks failed: %r", len(failed), exc)


async def run_write(tier: MappedStore, session: Session, transfer: Transfer, plan: validate.PutPlan,
                    spans: list[memoryview | None], max_put_blocks: int) -> None:
    """Store a write batch's blocks from their regions, in chain order.

    Blocks are stored up to the first descriptor that failed: a later block's
    parent would be missing, so those fail too, naming the one that broke the chain.
    """
    results = transfer.results
    n = len(spans)
    end = spans.index(None) if None in spans else n
    parent = plan.parent
    try:
        for start in range(0, end, max_put_blocks):
            if session.closed:
                break
            stop = min(start + max_put_blocks, end)
            blocks = [bytes(s) for s in spans[start:stop] if s is not None]  # snapshot: see module doc
            hashes = plan.hashes[start:stop]
            try:
                batch = PutBatch(scope=session.scope, parent_hash=parent, hashes=hashes, blocks=blocks,
                                 is_root=plan.is_root and start == 0)
                await tier.call(tier.put_many, [batch])
            except KVStoreError as exc:
                results.fail_pending(range(start, n), to_status(exc).name, exc.message)
                return
            results.statuses[start:stop] = bytes([DONE]) * (stop - start)
            results.block_hashes[start * HASH_BYTES: stop * HASH_BYTES] = b"".join(hashes)
            results.bytes_moved += sum(len(b) for b in blocks)
            parent = hashes[-1]
    finally:
        spans.clear()
        results.fail_pending(range(end, n), "FAILED_PRECONDITION",
                             f"not stored: descriptor {end} before it failed, so its parent block is missing")
        _finish(results, n, False, session.closed)
        session.finish(transfer)


async def _chunk(pending: Future[tuple[bytes, list[bytes]]]) -> tuple[bytes, list[bytes]]:
    """A chunk's result. If the batch is cancelled meanwhile, it still waits for the
    copy to stop: a copy thread must never write into a region the batch's end lets
    the session unmap."""
    try:
        return await asyncio.shield(asyncio.wrap_future(pending))
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await asyncio.wrap_future(pending)
        raise


def _record(results: BatchResults, statuses: np.ndarray, start: int, codes: bytes) -> int:
    """Write one chunk's status codes into the batch's results; how many blocks it loaded."""
    hits = codes.count(DONE)
    if hits == len(codes):  # the common case, kept to one slice: every block loaded
        results.statuses[start:start + hits] = codes
        return hits
    got = np.frombuffer(codes, dtype=np.uint8)
    reached = got != 0  # the rest are failed already or not reached
    statuses[start:start + len(codes)][reached] = got[reached]
    for j in np.flatnonzero(got == FAILED).tolist():
        results.failures[start + j] = _CORRUPT
    return hits


def _finish(results: BatchResults, end: int, prefix_only: bool, closed: bool) -> None:
    """Settle every descriptor still PENDING: skipped after a prefix ended, else failed."""
    pending = results.pending()
    if closed:
        results.fail_pending(pending.tolist(), "CANCELLED", "the session ended")
        return
    if prefix_only:
        statuses = np.frombuffer(results.statuses, dtype=np.uint8)
        statuses[pending[pending >= end]] = SKIPPED
        del statuses
        pending = pending[pending < end]
    # Every reached descriptor has a result: nothing is left here unless the engine has a bug.
    results.fail_pending(pending.tolist(), "INTERNAL", "not reached")
