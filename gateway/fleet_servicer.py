"""The Fleet service: what one storage node asks of another to re-replicate runs (docs/FLEET.md F16-F21).

Four calls, all behind the fleet's token (F20): `RunDigests` (what the node holds
of each run, in a few bytes), `HeldBlocks` (which blocks it holds), `CopyBlocks`
(store blocks copied from another replica) and `RaiseUses` (a run's old holder, no longer a replica, asks this
replica to carry its copy's last uses before it drops that copy: F79). A copy is checked as a Put is: the
key's namespace id is its namespace's, the size is its geometry's, and the bytes
match the checksum the source stored with them (F17: a damaged source copy is
refused here, on the receiving end, too); it is stored in one durable transaction
with the room rules of a Put, and keeps the later of the two copies' last uses (F19).

A copied block the source holds a live pin on carries the pin's time (`pin_until_s`): its copy here is
pinned until then in the transaction that stores it, within this node's limits for the block's tenant
(docs/RETENTION.md R31, R24); a pin granted shorter or not at all is logged, counted and answered.

A copy's bytes come in the request, or, where both nodes run the bulk transport, are read by
this node's engine from the source's map (`gateway.fleet_bulk`, the request naming the source's
engine) before the same checks and the same transaction.

The servicer translates messages; the work is `tiers.run_index` and `LmdbBlockTier.put_many`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import math
import struct
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import xxhash

from gateway.audit import AuditTrail
from gateway.fleet_bulk import BATCH_BYTES, RECEIVER_SLOTS, BulkReceiver
from gateway.status import unary
from gateway.validate import Layout
from kvstore import geometry
from kvstore.config import Settings
from kvstore.config_sections import FleetSettings
from kvstore.errors import (
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    KVStoreError,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from kvstore.prefix import FINGERPRINT_BYTES, HASH_BYTES, KEY_BYTES, BlockScope
from kvstore.v1 import fleet_pb2 as pb
from tiers import run_index
from tiers.block_txn import PutBatch, PutResult
from tiers.durable import Committed
from tiers.lmdb_tier import LmdbBlockTier

T = TypeVar("T")

log = logging.getLogger("kvstore.fleet")
#: Who a copied pin's grant is audited as (R31): the fleet's re-replication, not a tenant.
PIN_COPY_ACTOR = "kvstore-fleet"
#: The metadata key a node's fleet token travels under.
TOKEN_METADATA = "x-kvstore-fleet-token"
#: Keys (or blocks) one call may name.
MAX_KEYS = 65_536
SERVICE = "/kvstore.v1.Fleet/"
#: The Fleet service's methods: open at the auth interceptor (no tenant token is asked), because the
#: servicer checks the fleet's token itself (F20).
METHODS = tuple(SERVICE + m for m in ("RunDigests", "HeldBlocks", "CopyBlocks", "CopyBlocksStream", "RaiseUses"))
#: Threads answering the read-only planning calls (RunDigests, HeldBlocks) beside the store's executor (F18).
PLANNING_THREADS = 2
#: F18d: the initial metadata key a node opens a CopyBlocksStream with (before reading a piece): the sender's sign that
#: the node serves it (an older node answers UNIMPLEMENTED with none).
STREAM_OPENED = "x-kvstore-copy-stream"
#: F18d: pieces of one CopyBlocksStream checked and handed to the group commit, not yet committed: the next piece
#: is read off the stream only once the oldest of them is durable (gRPC's flow control then holds the sender).
STREAM_PIECES_PENDING = 2


class FleetServicer:
    """The Fleet service of one node.

    Args:
        tier: the node's store.
        layouts: the geometries served, by name (a copy's size is checked against its fingerprint's).
        run_blocks: blocks per run (`[fleet] run_blocks`).
        token: the fleet's token; None: no token is set, and calls are taken only while
            `open_without_token()` holds.
        open_without_token: whether calls need no token now (tenant auth is off on this node).
        window_s: the retention floor: digests count blocks last used within it.
        retention_of: storage key -> its tenant's retention seconds (the policies' `retention_of_key`): digests count
            each tenant's blocks used within it, as the repairer copies them (F19); None: `window_s` for every run.
        bulk: reads copies over the bulk transport; None: this node takes their bytes over gRPC only.
        audit: where a copied pin's grant is recorded (R31, as a Lookup's pin is, R27); None: not recorded.
    """

    def __init__(self, tier: LmdbBlockTier, layouts: dict[str, Layout], *, run_blocks: int, token: bytes | None,
                 open_without_token: Callable[[], bool], window_s: float, bulk: BulkReceiver | None = None,
                 audit: AuditTrail | None = None, retention_of: Callable[[bytes], float] | None = None) -> None:
        self.tier = tier
        self.retention_of = retention_of
        self.sizes = {layout.geometry.fingerprint: layout.block_bytes for layout in layouts.values()}
        self.run_blocks = run_blocks
        self.token = token
        self.open_without_token = open_without_token
        self.window_s = window_s
        self.bulk = bulk
        self.commits = GroupCommit(tier)
        self.audit = audit
        #: F18: RunDigests and HeldBlocks are answered here, not on the store's executor, whose threads a pass's
        #: copies keep busy with their checks and commits: a repairer's next planning round waits on none of
        #: them (each answer is one LMDB read txn, and LMDB's readers do not wait on its writer).
        self.planning = ThreadPoolExecutor(PLANNING_THREADS, thread_name_prefix="fleet-plan")
        #: Copied pins (R31) granted until the time the source holds them, and granted shorter or not at all.
        self.pins_granted = 0
        self.pins_short = 0

    async def _plan(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a planning call's read on the planning threads (F18)."""
        return await asyncio.get_running_loop().run_in_executor(self.planning, fn, *args)

    def close(self) -> None:
        """Finish the planning calls' reads: called before the store closes its environment."""
        self.planning.shutdown(wait=True)

    def _check_token(self, context: grpc.aio.ServicerContext) -> None:
        """F20: the caller is a node of this fleet (it shows the fleet's token)."""
        given = dict(context.invocation_metadata() or ()).get(TOKEN_METADATA)
        if self.token is None:
            if self.open_without_token():
                return
            raise PermissionDenied("this node has no fleet token ([fleet] token_file) and tenant auth is on: "
                                   "it takes no Fleet calls", hint="set the same [fleet] token_file on every node")
        if given is None:
            raise Unauthenticated(f"a Fleet call needs the fleet's token in metadata {TOKEN_METADATA!r}",
                                  hint="Fleet calls are for the fleet's own nodes")
        if not hmac.compare_digest(given.encode(), self.token):
            raise Unauthenticated("the fleet token given is not this fleet's", hint="check [fleet] token_file")

    @unary
    async def RunDigests(self, request: pb.RunDigestsRequest,
                         context: grpc.aio.ServicerContext) -> pb.RunDigestsResponse:
        """What this node holds of each run."""
        self._check_token(context)
        roots = _keys(request.run_roots, "run_roots")
        now = self.tier.retention_clock.now()
        # F19: each tenant's blocks used within its own retention; R31: a pinned prefix whatever its last use: as the
        # repairer sending them counts them.
        found = await self._plan(lambda: run_index.digests(self.tier.env, roots, self.run_blocks,
                                                               since_s=now - self.window_s, now_s=now,
                                                               retention_of=self.retention_of))
        # R32: with the live pins on them, so a replica lacking a pin its run's other copy holds is found.
        return pb.RunDigestsResponse(runs=[pb.RunDigest(blocks=d.blocks, size_bytes=d.size_bytes, digest=d.digest,
                                                        pins=[pb.RunPin(hash=h, until_s=u) for h, u in d.pins])
                                           for d in found])

    @unary
    async def HeldBlocks(self, request: pb.HeldBlocksRequest,
                         context: grpc.aio.ServicerContext) -> pb.HeldBlocksResponse:
        """Which of the blocks this node holds."""
        self._check_token(context)
        keys = _keys(request.keys, "keys")
        return pb.HeldBlocksResponse(held=await self._plan(run_index.held, self.tier.env, keys))

    @unary
    async def RaiseUses(self, request: pb.RaiseUsesRequest,
                        context: grpc.aio.ServicerContext) -> pb.RaiseUsesResponse:
        """F79: raise the held blocks' last uses to the asking copy's (F19), durably; say which now carry it."""
        self._check_token(context)
        keys = _keys([u.key for u in request.uses], "uses")
        uses = [(k, u.last_use_s) for k, u in zip(keys, request.uses, strict=True)]
        return pb.RaiseUsesResponse(at_least=await self.tier.call(self.tier.raise_uses, uses))

    @unary
    async def CopyBlocks(self, request: bytes | pb.CopyBlocksRequest,
                         context: grpc.aio.ServicerContext) -> pb.CopyBlocksResponse:
        """Store copied blocks, each verified, durably; answered once committed. The request arrives as its
        wire bytes (`add_fleet_service` registers no deserializer for it): `parse_copies` reads the blocks
        as views of them, so a block's bytes are not copied between the network and LMDB."""
        self._check_token(context)

        def check() -> tuple[list[PutBatch], Sequence[pb.CopiedBlock | WireCopy], str]:
            # Parsed and checked on the store's executor, off the event loop; a bulk request's blocks are
            # read first (`_read_and_store`).
            blocks, segment = parse_request(request) if isinstance(request, bytes) else (request.blocks,
                                                                                         request.bulk_segment)
            if segment:
                return [], blocks, segment
            return copy_batches(blocks, self.sizes, self.run_blocks), (), ""

        batches, blocks, segment = await self.tier.call(check)
        if segment:
            refused, batches, results = await self._read_and_store(blocks, segment, context.peer())
            if refused:
                return pb.CopyBlocksResponse(bulk_refused=refused)
        else:
            results = await self.commits.put(batches)
        return await self._copied(batches, results, context.peer())

    @unary
    async def CopyBlocksStream(self, requests: AsyncIterator[bytes],
                               context: grpc.aio.ServicerContext) -> pb.CopyBlocksResponse:
        """F18d: store the blocks of a stream of CopyBlocksRequest pieces (their bytes in them, as wire bytes), each
        piece checked as a CopyBlocks is and handed to the group commit in the stream's order as it arrives, so a
        piece is committed while the next is received; answered once every piece is committed (durable). A piece
        may continue a chain an earlier piece of the stream stores: it goes in the same transaction or a later one.

        Raises:
            InvalidArgument: a piece that does not parse or is refused by the checks, or one naming a bulk segment.
            FailedPrecondition: a damaged block, or a piece whose parent is not stored (an earlier one refused).
        """
        self._check_token(context)
        # F18d: opened at once, so a sender knows this node serves the stream before it writes a piece.
        await context.send_initial_metadata(((STREAM_OPENED, "1"),))
        pending: list[tuple[list[PutBatch], asyncio.Future[list[PutResult]]]] = []
        stored: list[PutBatch] = []
        results: list[PutResult] = []

        async def settle_oldest() -> None:
            batches, done = pending.pop(0)
            results.extend(await done)
            stored.extend(batches)

        try:
            async for raw in requests:
                batches = await self.tier.call(self._stream_piece, raw)
                pending.append((batches, self.commits.enqueue(batches)))  # in the stream's order (R6)
                while len(pending) > STREAM_PIECES_PENDING:
                    await settle_oldest()
            while pending:
                await settle_oldest()
        finally:
            if pending:  # a piece failed: those handed on end (they may be in a transaction being written)
                await asyncio.wait([done for _, done in pending])
                for _, done in pending:
                    if not done.cancelled():
                        done.exception()  # retrieved: the first failure is the one raised
        return await self._copied(stored, results, context.peer())

    def _stream_piece(self, raw: bytes) -> list[PutBatch]:
        """One CopyBlocksStream piece's Put batches (`copy_batches` over `parse_request`'s views of `raw`)."""
        blocks, segment = parse_request(raw)
        if segment:
            raise InvalidArgument("a CopyBlocksStream piece names a bulk segment; a streamed copy carries its bytes",
                                  hint="send bulk copies as CopyBlocks")
        return copy_batches(blocks, self.sizes, self.run_blocks)

    async def _copied(self, batches: Sequence[PutBatch], results: Sequence[PutResult],
                      peer: str) -> pb.CopyBlocksResponse:
        """A copy's answer: what its committed `batches` wrote (`results`) and what their pins got."""
        granted, short, note = await self._pins_copied(batches, results, peer)
        return pb.CopyBlocksResponse(written_blocks=sum(r.written_blocks for r in results),
                                     existing_blocks=sum(r.existing_blocks for r in results),
                                     written_bytes=sum(r.written_bytes for r in results),
                                     pins_granted=granted, pins_short=short, pin_note=note)

    async def _pins_copied(self, batches: Sequence[PutBatch], results: Sequence[PutResult],
                           peer: str) -> tuple[int, int, str]:
        """What the copied pins got (R31: each a batch's `keep_until_s`, granted in its transaction): (granted
        until the time asked, granted shorter or not at all, why for the first of those). A short one is logged
        and counted; each grant is audited where an audit log is given (best effort: the blocks and the pin are
        durable already)."""
        granted = short = 0
        note = ""
        for batch, r in zip(batches, results, strict=True):
            grant = r.pin
            if grant is None or not batch.hashes:
                continue
            if grant.until_s >= grant.asked_until_s:
                granted += 1
            else:
                short += 1
                note = note or grant.why
                log.warning("fleet: a copied pin asked until %.0f was granted %s here: %s (from %s)",
                            grant.asked_until_s, f"until {grant.until_s:.0f}" if grant.until_s else "nothing",
                            grant.why, peer)
            if grant.until_s and self.audit is not None:
                try:
                    await self.audit.record(actor=PIN_COPY_ACTOR, action="pin", tenant=batch.scope.namespace,
                                            old=None, new={"block": batch.hashes[-1].hex(), "until_s": grant.until_s,
                                                           "asked_until_s": grant.asked_until_s, "note": grant.why,
                                                           "copied_from": peer})
                except KVStoreError as exc:
                    log.warning("fleet: a copied pin's grant is not audited: %s", exc)
        self.pins_granted += granted
        self.pins_short += short
        return granted, short, note

    async def _read_and_store(self, blocks: Sequence[pb.CopiedBlock | WireCopy], segment: str,
                              peer: str) -> tuple[str, list[PutBatch], list[PutResult]]:
        """A bulk CopyBlocks: its blocks read from the source's engine into a staging slot, then checked and
        stored as bytes in the request are; ("", batches, results), or (why not, [], []) with nothing stored
        (the source then sends the bytes over gRPC).

        Raises:
            InvalidArgument: a geometry not served here, or more blocks than a call may carry.
        """
        bulk = self.bulk
        refused = ("this node reads no copies over the bulk transport ([transfer] bulk is off)" if bulk is None
                   else await bulk.refused(segment, peer))
        if refused or bulk is None:
            return refused, [], []
        if len(blocks) > MAX_KEYS:
            raise InvalidArgument(f"{len(blocks)} blocks in one CopyBlocks; at most {MAX_KEYS}")
        sizes = []
        for i, b in enumerate(blocks):
            size = self.sizes.get(b.key[:FINGERPRINT_BYTES])
            if size is None:
                raise InvalidArgument(f"blocks[{i}]: geometry fingerprint {b.key[:FINGERPRINT_BYTES].hex()} "
                                      "is not served here")
            sizes.append(size)
        if sum(sizes) > bulk.slot_bytes:
            return f"{sum(sizes)} bytes in one bulk CopyBlocks; a staging slot here holds {bulk.slot_bytes}", [], []
        try:
            view, slot = await bulk.read(segment, [b.source_address for b in blocks], sizes)
        except Unavailable as exc:
            log.warning("fleet: %s; the source sends the bytes over gRPC", exc.message)
            return exc.message, [], []

        def check() -> list[PutBatch]:
            at, copies = 0, []
            for b, size in zip(blocks, sizes, strict=True):
                copies.append(_with_data(b, view[at:at + size]))
                at += size
            return copy_batches(copies, self.sizes, self.run_blocks)

        async def store() -> tuple[list[PutBatch], list[PutResult]]:
            batches = await self.tier.call(check)
            return batches, await self.commits.put(batches)

        stored = asyncio.ensure_future(store())
        try:
            batches, results = await asyncio.shield(stored)
            return "", batches, results
        except asyncio.CancelledError:
            await asyncio.wait([stored])  # the store may still read the slot: freed once it returns
            raise
        finally:
            bulk.release(slot)


class GroupCommit:
    """The copies' durable writes, group-committed: the batches of every CopyBlocks that arrives while a
    transaction is being written go in the next one together (`put_many`: one fsync for them all), so copies
    in flight at once (a repairer keeps 4, several repairers may send) cost one fsync per group, not per call.

    All or none per group: when a group's transaction is refused (room, quota), each call's batches are
    written again alone, so a call is refused only for its own blocks. Batches of one call stay in order, and
    a call's group follows the groups of calls answered before it was made (a lane's next batch, R6).
    """

    def __init__(self, tier: LmdbBlockTier) -> None:
        self.tier = tier
        self._queue: list[tuple[list[PutBatch], asyncio.Future[list[PutResult]]]] = []
        self._writing = False
        self._answering: set[asyncio.Future[None]] = set()  # groups committed, waiting for their flush
        #: Transactions written, and the calls they served (their ratio: calls per fsync).
        self.commits = 0
        self.calls = 0

    async def put(self, batches: list[PutBatch]) -> list[PutResult]:
        """Store `batches` durably in the next group's transaction; their results once it is committed.

        Raises:
            KVStoreError: what `put_many` raises for these batches written alone.
        """
        return await self.enqueue(batches)

    def enqueue(self, batches: list[PutBatch]) -> asyncio.Future[list[PutResult]]:
        """`put`, queued now: batches enqueued later go in the same transaction after these, or a later one (a
        stream's pieces keep their order, F18d). The future holds their results once committed.

        Raises:
            KVStoreError: (from the future) what `put_many` raises for these batches written alone.
        """
        done: asyncio.Future[list[PutResult]] = asyncio.get_running_loop().create_future()
        self._queue.append((batches, done))
        if not self._writing:
            self._writing = True
            asyncio.get_running_loop().create_task(self._write())
        # Shielded: a cancelled call's batches may be in a transaction being written; it ends regardless.
        return asyncio.shield(done)

    async def _write(self) -> None:
        answered: asyncio.Future[None] | None = None  # the group before's answers: groups answered in order
        try:
            while self._queue:
                group, self._queue = self._queue, []
                self.commits += 1
                self.calls += len(group)
                try:
                    committed = await self.tier.call(self.tier.commit_many,
                                                     [b for batches, _ in group for b in batches])
                except Exception as exc:  # refused as a whole: each call alone, so a refusal is only its own
                    if len(group) > 1:
                        log.warning("fleet: %d copies written together were refused (%s): each is written alone",
                                    len(group), exc)
                    for batches, done in group:
                        try:
                            alone = await self.tier.call(self.tier.put_many, batches)
                        except Exception as exc:
                            _settle(done, exc=exc)
                        else:
                            _settle(done, alone)
                    continue
                # R35: the next group's transaction is written while the disk flushes this one; this one's
                # calls are answered once it is durable (R34).
                answered = asyncio.ensure_future(self._answer(group, committed, answered))
                self._answering.add(answered)
                answered.add_done_callback(self._answering.discard)
        finally:
            self._writing = False

    async def _answer(self, group: list[tuple[list[PutBatch], asyncio.Future[list[PutResult]]]],
                      committed: Committed[list[PutResult]], before: asyncio.Future[None] | None) -> None:
        """Answer `group`'s calls once its commit is durable, after the group before it."""
        try:
            results = await self.tier.durable(committed)
        except Exception as exc:  # the flush failed: nothing of the group is acknowledged
            for _, done in group:
                _settle(done, exc=exc)
            return
        if before is not None:
            await before
        at = 0
        for batches, done in group:
            _settle(done, results[at:at + len(batches)])
            at += len(batches)


def _settle(done: asyncio.Future[list[PutResult]], results: list[PutResult] | None = None, *,
            exc: BaseException | None = None) -> None:
    if done.cancelled():
        return
    if exc is not None:
        done.set_exception(exc)
    else:
        assert results is not None
        done.set_result(results)


@dataclass(frozen=True, slots=True)
class WireCopy:
    """One `CopiedBlock` as `parse_copies` reads it: its data a view of the request's bytes."""

    key: bytes
    namespace: str
    parent_hash: bytes
    depth: int
    data: memoryview
    checksum: int
    last_use_s: float
    #: Bulk: where the block lies in the source's registered region (0: its bytes are `data`).
    source_address: int = 0
    #: The source's live pin on the block (R31): pin the copy until then; 0: none.
    pin_until_s: float = 0.0


def _with_data(b: pb.CopiedBlock | WireCopy, data: memoryview) -> WireCopy:
    """The block with the bytes read for it over the bulk transport."""
    if isinstance(b, WireCopy):
        return dataclasses.replace(b, data=data)
    return WireCopy(key=b.key, namespace=b.namespace, parent_hash=b.parent_hash, depth=b.depth, data=data,
                    checksum=b.checksum, last_use_s=b.last_use_s, pin_until_s=b.pin_until_s)


def _varint(raw: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(raw) or shift > 63:
            raise ValueError("a varint runs past the end")
        byte = raw[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _fields(raw: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of each field of a message: an int, or a view for a length-delimited one."""
    at = 0
    while at < len(raw):
        tag, at = _varint(raw, at)
        number, kind = tag >> 3, tag & 7
        if kind == 0:
            value, at = _varint(raw, at)
            yield number, kind, value
        elif kind in (1, 5):
            width = 8 if kind == 1 else 4
            if at + width > len(raw):
                raise ValueError("a fixed field runs past the end")
            yield number, kind, int.from_bytes(raw[at:at + width], "little")
            at += width
        elif kind == 2:
            size, at = _varint(raw, at)
            if at + size > len(raw):
                raise ValueError("a length-delimited field runs past the end")
            yield number, kind, raw[at:at + size]
            at += size
        else:
            raise ValueError(f"wire type {kind} is not used by this message")


#: CopiedBlock's fields -> their wire types (proto/kvstore/v1/fleet.proto).
_WIRE_TYPES = {1: 2, 2: 2, 3: 2, 4: 0, 5: 2, 6: 1, 7: 1, 8: 1, 9: 1}
_DOUBLE = struct.Struct("<d")
_EMPTY = memoryview(b"")


def parse_copies(raw: bytes) -> list[WireCopy]:
    """A `CopyBlocksRequest`'s blocks from its wire bytes: what protobuf's parse gives (unknown fields skipped,
    absent ones their defaults), each block's data a view of `raw` instead of a copy.

    Raises:
        InvalidArgument: the bytes are not a CopyBlocksRequest.
    """
    return parse_request(raw)[0]


def parse_request(raw: bytes) -> tuple[list[WireCopy], str]:
    """`parse_copies`, and the request's `bulk_segment` ("" when its bytes are in it).

    Raises:
        InvalidArgument: the bytes are not a CopyBlocksRequest.
    """
    out = []
    segment = ""
    try:
        for number, kind, value in _fields(memoryview(raw)):
            if number == 2:
                if not isinstance(value, memoryview):
                    raise ValueError(f"field 2 (bulk_segment) has wire type {kind}")
                segment = bytes(value).decode()
                continue
            if number != 1:
                continue
            if not isinstance(value, memoryview):
                raise ValueError("field 1 (blocks) is not a message")
            got: dict[int, int | memoryview] = {}
            for n, k, v in _fields(value):
                if n in _WIRE_TYPES:
                    if k != _WIRE_TYPES[n]:
                        raise ValueError(f"CopiedBlock field {n} has wire type {k}")
                    got[n] = v
            key, ns, parent, data = (got.get(n, _EMPTY) for n in (1, 2, 3, 5))
            depth, checksum, last_use, address, pin = (got.get(n, 0) for n in (4, 6, 7, 8, 9))
            assert isinstance(key, memoryview) and isinstance(ns, memoryview) and isinstance(parent, memoryview)
            assert isinstance(data, memoryview) and isinstance(depth, int) and isinstance(checksum, int)
            assert isinstance(last_use, int) and isinstance(address, int) and isinstance(pin, int)
            out.append(WireCopy(key=bytes(key), namespace=bytes(ns).decode(), parent_hash=bytes(parent),
                                depth=depth, data=data, checksum=checksum,
                                last_use_s=_DOUBLE.unpack(last_use.to_bytes(8, "little"))[0], source_address=address,
                                pin_until_s=_DOUBLE.unpack(pin.to_bytes(8, "little"))[0]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"a CopyBlocks request that does not parse: {exc}") from None
    return out, segment


def _keys(values: Sequence[bytes], field: str) -> list[bytes]:
    if len(values) > MAX_KEYS:
        raise InvalidArgument(f"{field} has {len(values)} entries; at most {MAX_KEYS} per call")
    for i, key in enumerate(values):
        if len(key) != KEY_BYTES:
            raise InvalidArgument(f"{field}[{i}] is {len(key)} bytes; a storage key is {KEY_BYTES} bytes")
    return list(values)


@dataclass
class _Stretch:
    """Consecutive copied blocks of one chain, gathered into one Put batch."""

    scope: BlockScope
    parent_hash: bytes
    first_depth: int
    hashes: list[bytes] = field(default_factory=list)
    blocks: list[bytes | memoryview] = field(default_factory=list)
    last_use_s: list[float] = field(default_factory=list)
    #: Each block's xxh3-64, verified against its bytes by `_check_block`: the store takes them as they are,
    #: so the writer does not hash the bytes a second time inside its transaction (LMDB's one writer is the
    #: copy's bottleneck; docs/FLEET.md, "Figures").
    checksums: list[int] = field(default_factory=list)
    #: The source's pin on the stretch's last block (R31: a stretch ends at a pinned block); None: none.
    keep_until_s: float | None = None

    def batch(self, run_blocks: int) -> PutBatch:
        # F17: a run's first block may have its parent on another node: it is stored at the depth
        # it has in its chain. Any other block extends a block stored here (R6 inside a run).
        root = self.first_depth == 1
        floating = not root and run_index.is_run_root(self.first_depth, run_blocks)
        return PutBatch(scope=self.scope, parent_hash=self.parent_hash, hashes=tuple(self.hashes),
                        blocks=tuple(self.blocks), is_root=root, first_depth=self.first_depth if floating else None,
                        last_use_s=tuple(self.last_use_s), keep_until_s=self.keep_until_s,
                        checksums=tuple(self.checksums))


def copy_batches(blocks: Sequence[pb.CopiedBlock | WireCopy], sizes: dict[bytes, int],
                 run_blocks: int) -> list[PutBatch]:
    """The Put batches a CopyBlocks request stores: one per stretch of one chain, in order.

    Raises:
        InvalidArgument: a malformed key, a namespace not the key's, a size not its geometry's,
            a depth of 0, or more blocks than a call may carry.
        FailedPrecondition: bytes that do not match their checksum (a damaged copy is never stored).
    """
    # R31: a pinned block ends its stretch, the batch's pin (`keep_until_s`, on its last block) granted in the
    # transaction that stores it; the next block extends it there.
    if len(blocks) > MAX_KEYS:
        raise InvalidArgument(f"{len(blocks)} blocks in one CopyBlocks; at most {MAX_KEYS}")
    stretches: list[_Stretch] = []
    scopes: dict[tuple[bytes, str], BlockScope] = {}  # one BlockScope per (geometry, namespace) of the call
    for i, b in enumerate(blocks):
        scope, data = _check_block(i, b, sizes, scopes)
        last = stretches[-1] if stretches else None
        if (last is None or last.keep_until_s is not None or last.scope.prefix != scope.prefix
                or last.hashes[-1] != b.parent_hash or last.first_depth + len(last.hashes) != b.depth
                or run_index.is_run_root(b.depth, run_blocks)):
            last = _Stretch(scope=scope, parent_hash=b.parent_hash, first_depth=b.depth)
            stretches.append(last)
        last.hashes.append(b.key[KEY_BYTES - HASH_BYTES:])
        last.blocks.append(data)
        last.last_use_s.append(b.last_use_s)
        last.checksums.append(b.checksum)  # equal to the bytes' own: `_check_block` refused it otherwise
        pin = b.pin_until_s
        if pin:
            if not math.isfinite(pin) or pin < 0:
                raise InvalidArgument(f"blocks[{i}]: pin_until_s {pin!r} is not a Unix time (0: no pin)")
            last.keep_until_s = pin
    return [s.batch(run_blocks) for s in stretches]


def _check_block(i: int, b: pb.CopiedBlock | WireCopy, sizes: dict[bytes, int],
                 scopes: dict[tuple[bytes, str], BlockScope]) -> tuple[BlockScope, bytes | memoryview]:
    """The block's scope and bytes, checked (each read of a message's bytes field copies them: read once)."""
    if len(b.key) != KEY_BYTES or len(b.parent_hash) != HASH_BYTES:
        raise InvalidArgument(f"blocks[{i}]: a key of {len(b.key)} bytes and a parent of {len(b.parent_hash)}; "
                              f"a storage key is {KEY_BYTES} bytes, a hash {HASH_BYTES}")
    if b.depth < 1:
        raise InvalidArgument(f"blocks[{i}]: depth 0; a chain's first block has depth 1")
    key = b.key
    fingerprint = key[:FINGERPRINT_BYTES]
    size = sizes.get(fingerprint)
    if size is None:
        raise InvalidArgument(f"blocks[{i}]: geometry fingerprint {fingerprint.hex()} is not served here")
    data = b.data
    if len(data) != size:
        raise InvalidArgument(f"blocks[{i}] is {len(data)} bytes; its geometry's blocks are {size}")
    namespace = b.namespace
    scope = scopes.get((fingerprint, namespace))
    if scope is None:
        scope = scopes[(fingerprint, namespace)] = BlockScope(fingerprint, namespace)
    if scope.prefix != key[:KEY_BYTES - HASH_BYTES]:  # the prefix is the fingerprint and the namespace's id
        raise InvalidArgument(f"blocks[{i}]: namespace {namespace!r} is not the one its key names")
    if xxhash.xxh3_64_intdigest(data) != b.checksum:
        raise FailedPrecondition(f"blocks[{i}] ({key.hex()[:24]}...) does not match its checksum: "
                                 "a damaged copy is never stored", hint="copy it from another replica")
    return scope, data


def load_token(fleet: FleetSettings, *, auth_enabled: bool) -> bytes | None:
    """The fleet's token from `[fleet] token_file` (None: unset).

    Raises:
        ConfigError: the file cannot be read or is empty, or no token is set while tenant auth is on
            (nodes could not copy to each other: re-replication would never happen).
    """
    if not fleet.token_file:
        if auth_enabled:
            raise ConfigError("tenant auth is on but [fleet] token_file is unset: the nodes could not copy "
                              "blocks to each other", hint="write a long random token to a file, and set "
                              "[fleet] token_file to it on every node of the fleet")
        return None
    try:
        token = Path(fleet.token_file).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read fleet.token_file {fleet.token_file}: {exc.strerror or exc}") from None
    if len(token) < 16:
        raise ConfigError(f"fleet.token_file {fleet.token_file} holds {len(token)} bytes; a fleet token is at "
                          "least 16", hint="for example: head -c 32 /dev/urandom | base64 > FILE")
    return token


def add_fleet_service(server: grpc.aio.Server, settings: Settings, tier: LmdbBlockTier, *,
                      auth_on: Callable[[], bool], audit: AuditTrail | None = None,
                      closers: list[Callable[[], Any]] | None = None,
                      retention_of: Callable[[bytes], float] | None = None) -> bytes | None:
    """Keep the run index and serve the Fleet service (when `[fleet]` is on); returns the fleet's token.

    Args:
        server: the gRPC server (not started yet).
        settings: the node's settings.
        tier: the node's store.
        auth_on: whether tenant auth is on now (it turns on when a tenants file appears).
        audit: where copied pins' grants are recorded (R31); None: not recorded.
        closers: the server's clean-ups, run before the store closes: the servicer's planning threads join them.
        retention_of: storage key -> its tenant's retention seconds (F19, the policies' `retention_of_key`); None:
            the store's retention for every tenant.

    Raises:
        ConfigError: see `load_token`.
    """
    token = load_token(settings.fleet, auth_enabled=auth_on())
    built = tier.enable_run_index(settings.fleet.run_blocks)
    if built:
        log.info("fleet: indexed %d runs of %d blocks already stored", built, settings.fleet.run_blocks)
    layouts = {g.name: Layout.of(g, settings.store.block_tokens) for g in geometry.REGISTRY.values()}
    # F18: where `[transfer] bulk` is on, copies' bytes are read from their source's map by this node's engine.
    bulk = (BulkReceiver(settings.transfer.bulk_host, BATCH_BYTES, RECEIVER_SLOTS)
            if settings.transfer.bulk == "mooncake" else None)
    servicer = FleetServicer(tier, layouts, run_blocks=settings.fleet.run_blocks, token=token,
                             open_without_token=lambda: not auth_on(), window_s=settings.store.retention_s,
                             bulk=bulk, audit=audit, retention_of=retention_of)
    _add_servicer(servicer, server)
    if closers is not None:
        closers.append(servicer.close)
    return token


def _add_servicer(servicer: FleetServicer, server: grpc.aio.Server) -> None:
    """As `fleet_pb2_grpc.add_FleetServicer_to_server`, but CopyBlocks takes its request as wire bytes
    (`parse_copies` reads them on the store's executor, the blocks' data as views)."""
    handlers = {
        "RunDigests": grpc.unary_unary_rpc_method_handler(
            servicer.RunDigests, request_deserializer=pb.RunDigestsRequest.FromString,
            response_serializer=pb.RunDigestsResponse.SerializeToString),
        "HeldBlocks": grpc.unary_unary_rpc_method_handler(
            servicer.HeldBlocks, request_deserializer=pb.HeldBlocksRequest.FromString,
            response_serializer=pb.HeldBlocksResponse.SerializeToString),
        "CopyBlocks": grpc.unary_unary_rpc_method_handler(
            servicer.CopyBlocks, request_deserializer=None,
            response_serializer=pb.CopyBlocksResponse.SerializeToString),
        "CopyBlocksStream": grpc.stream_unary_rpc_method_handler(
            servicer.CopyBlocksStream, request_deserializer=None,
            response_serializer=pb.CopyBlocksResponse.SerializeToString),
        "RaiseUses": grpc.unary_unary_rpc_method_handler(
            servicer.RaiseUses, request_deserializer=pb.RaiseUsesRequest.FromString,
            response_serializer=pb.RaiseUsesResponse.SerializeToString),
    }
    # Generic handlers only (gateway/grpc_server.py: grpc.aio's accept loop pays per registered method).
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvstore.v1.Fleet", handlers),))
