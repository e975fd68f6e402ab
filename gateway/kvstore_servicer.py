"""The KVStore gRPC service: wire messages in, validated calls to a block store (`tiers.store`), wire messages out."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from functools import cache, partial
from typing import Any, TypeVar, cast

import grpc

from gateway import put_stream, routed_put_stream, validate
from gateway.audit import AuditTrail
from gateway.auth import Caller, current_caller
from gateway.block_feed import drained_async
from gateway.events import note_put_tokens
from gateway.hit_stats import MAX_SERIES_POINTS, WINDOWS, HitStats, Window
from gateway.host_info import NodeHost
from gateway.lookup_anchors import LookupAnchors
from gateway.put_group import PutGroups
from gateway.put_request import PutRequestView
from gateway.replies import found_reply
from gateway.resume_counters import ACTION_FIELDS, ResumeCounters, check_report
from gateway.routed_store import Route, RoutedStore, StoredTail
from gateway.status import streaming, unary
from gateway.trace_recorder import NO_TRACE, CallTrace, trace_counters
from gateway.validate import Layout
from kvstore import __version__
from kvstore.api_tokens import ADMIN
from kvstore.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    PutNotReplicated,
    Unavailable,
    from_status,
    to_status,
)
from kvstore.geometry import ModelGeometry
from kvstore.native import blockcopy
from kvstore.prefix import FINGERPRINT_BYTES, NAMESPACE_ID_BYTES, BlockScope, namespace_id
from kvstore.swa_snapshot import resume_length
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tiers.pins import PinGrant
from tiers.store import (
    AnchoredLookup,
    BlockStore,
    FoundReads,
    PinningStore,
    PutBatch,
    PutResult,
    ReadStatus,
    RunLookup,
)
from tiers.swa_cache import SwaCache

#: Blocks read per executor call in a Get: enough to amortise the hop to the
#: LMDB thread, small enough that the first block goes out quickly.
GET_CHUNK_BLOCKS = 16
#: A Lookup of at most this many hashes reads the index on the event loop: about a microsecond of
#: LMDB per block, where the hop to the tier's executor and back costs the loop ~0.1 ms and, under
#: load, the wait behind Put commits holding every LMDB thread (docs/BENCHMARKS.md, `bench load`).
INLINE_LOOKUP_BLOCKS = 128
#: A Get of at most this many bytes of blocks reads them on the event loop (verified and copied into
#: their replies: ~0.1 ms per 512 KiB), through a read that never writes (`FoundReads`); a larger
#: Get reads on the executor, so a big read never holds the other calls.
INLINE_GET_BYTES = 512 << 10

#: Put batches a stream may have received ahead of the one being committed.
PUT_STREAM_DEPTH = 4
#: A gateway's PutStream requests received and cut ahead of the one being stored on the replicas (F69c).
ROUTED_PUT_DEPTH = 3
#: Seconds between looks for expired pins to audit (R29): one read transaction when none is due.
PIN_AUDIT_INTERVAL_S = 1.0
#: Who an expiry's audit entry names: the server itself, not a caller.
PIN_AUDIT_ACTOR = "kvstore"
log = logging.getLogger("kvstore.pins")
T = TypeVar("T")

def _check_keep_until(until_s: float) -> None:
    """A pin's time is a finite Unix time (0: none)."""
    if not math.isfinite(until_s) or until_s < 0:
        raise InvalidArgument(f"keep_until_s must be a Unix time in seconds (0: no pin), got {until_s!r}")


def _put_response(batch: PutBatch, result: PutResult) -> pb.PutResponse:
    pin = result.pin
    return pb.PutResponse(block_hashes=batch.hashes, written_blocks=result.written_blocks,
                          existing_blocks=result.existing_blocks, kept_until_s=pin.until_s if pin else 0.0,
                          keep_note=pin.why if pin else "")


_STATUS: dict[ReadStatus, pb.BlockStatus] = {
    ReadStatus.FOUND: pb.BLOCK_STATUS_FOUND,
    ReadStatus.MISSING: pb.BLOCK_STATUS_MISSING,
    ReadStatus.CORRUPT: pb.BLOCK_STATUS_CORRUPT,
}


class KVStoreServicer(pb_grpc.KVStoreServicer):
    """Serves global-KV blocks of the registered geometries from one block store.

    `trace` is told of each Lookup, Get, Put and ReportResume a node serves (`[trace]`, gateway/trace_recorder.py).

    Args:
        tier: the store: a node's LMDB tier, or the fleet's router in a gateway (it owns the
            executor for blocking work).
        layouts: served geometries by name, the default first.
        max_message_bytes: the server's message limit, reported to clients.
        swa: the SWA pool, asked by Lookup for snapshot candidates (None: no SWA pool).
        hits: the hit counters per tenant over time, shared with the SwaPool service
            (None: counted in memory only, lost at stop).
    """

    trace: CallTrace = NO_TRACE

    def __init__(self, tier: BlockStore, layouts: dict[str, Layout], max_message_bytes: int,
                 swa: SwaCache | None = None, hits: HitStats | None = None, audit: AuditTrail | None = None,
                 policies: Any = None) -> None:
        self.tier = tier
        #: The tenants' policies (gateway.policies), for GetInfo's replay_fidelity; None: none kept here.
        self.policies = policies
        #: The store's pins (R22-R27); None: a store that does not pin (a gateway's, for now).
        self.pins = tier if isinstance(tier, PinningStore) else None
        #: A next turn's Lookup from its anchor's stored record (A5); None: from remembered anchors (A1).
        self.anchored = tier if isinstance(tier, AnchoredLookup) else None
        #: Reads with no side effect, a small Get's on the event loop; None: every Get reads on the executor.
        self.found_reads = tier if isinstance(tier, FoundReads) else None
        #: Where each pin granted is recorded (R27); None: not recorded (a servicer built without the log).
        self.audit = audit
        #: A gateway's store routes whole requests (docs/FLEET.md F36-F40); None on a node.
        self.router = tier if isinstance(tier, RoutedStore) else None
        self.swa = swa
        self.layouts = layouts
        self.max_message_bytes = max_message_bytes
        self.settings = tier.settings
        #: What planners reported of their plans (ReportResume): usable tokens, not raw hits.
        self.resume = ResumeCounters()
        self.hits = hits or HitStats(None, tier.clock, block_tokens=self.settings.block_tokens)
        #: Chains found stored, by their last hash: a next turn sends only its new hashes.
        self.anchors = LookupAnchors()
        #: This node as a Lookup's hosts answer names it (`want_hosts`; gateway/host_info.py).
        self.own_host = NodeHost.of(tier)
        #: Unary Puts in flight share commits (group commit: one fsync for those waiting behind a commit).
        self.put_groups = PutGroups(tier)

    @unary
    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.GetInfoResponse:
        return pb.GetInfoResponse(
            block_tokens=self.settings.block_tokens,
            geometries=[
                pb.GeometryInfo(name=name, fingerprint=lay.geometry.fingerprint, block_bytes=lay.block_bytes,
                                bytes_per_token=lay.geometry.bytes_per_token)
                for name, lay in self.layouts.items()
            ],
            max_batch_blocks=self.settings.max_batch_blocks,
            max_message_bytes=self.max_message_bytes,
            retention_hours=self.settings.retention_hours,
            max_lease_ms=self.settings.max_lease_ms,
            version=__version__,
            lookup_packed_hashes=True,
            lookup_anchors=True,
            tenant=current_caller().tenant,
            run_blocks=self.router.run_blocks if self.router is not None else 0,
            replay_fidelity=self._replay_fidelity(request.namespace),
        )

    def _replay_fidelity(self, name: str) -> str:
        """The replay_fidelity of the tenant `name` resolves to (validate.namespace: another tenant's needs
        "admin"), '' when no policies are kept here: a planner of that tenant reads it at attach."""
        tenant = validate.namespace(name)
        return "" if self.policies is None else str(self.policies.policy(tenant).replay_fidelity)

    @unary
    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        layout, scope = validate.scope(self.layouts, request.geometry, request.namespace)
        if request.run_lengths:  # a fleet client's runs on this node, each its own chain (F50)
            return await self._lookup_runs(request, scope)
        # A prompt shorter than a block has no hashes; its SWA candidates are answered (none
        # serves: a resume needs the global rows below it, and no block is found).
        limit = self.settings.max_lookup_blocks
        if request.anchor_hash or request.anchor_blocks:  # a next turn: the remembered chain, then these
            validate.anchor(request.anchor_hash, request.anchor_blocks, request.block_hashes)
            if self._from_anchor_record():  # A5: the anchor's record vouches for its prefix; the new hashes read
                return await self._lookup_after(request, layout, scope, limit)
            head = self.anchors.expand(scope.prefix, request.anchor_hash, request.anchor_blocks)
            if head is None:
                return pb.LookupResponse(anchor_unknown=True)  # A4: nothing looked up; the client sends all
            only_swa, hashes = False, validate.anchored_hashes(head, request.block_hashes_packed, limit=limit)
        else:
            only_swa = not request.block_hashes and not request.block_hashes_packed and bool(request.swa_keys)
            hashes = [] if only_swa else validate.lookup_hashes(request.block_hashes, request.block_hashes_packed,
                                                                limit=limit)
        lease_ms = min(request.lease_ms, self.settings.max_lease_ms)
        if self.router is not None:
            reply = await self._routed_lookup(request, scope, hashes, lease_ms, context)
            self._remember(scope, hashes, reply.found_blocks, request)
            return reply
        # One index read per found block (the chain is checked, R15): on the loop when few.
        due: list[bytes] = []
        found, lease = await self._index_read(len(hashes), lambda: self.tier.lookup(
            scope, hashes, lease_ms / 1000.0, touch_due=due)) if hashes else (0, None)
        self._remember(scope, hashes, found, request)
        return await self._found(request, layout, scope, hashes, found, hashes[found - 1] if found else b"", lease,
                                 due, only_swa=only_swa)

    async def _index_read(self, blocks: int, read: Callable[[], T]) -> T:
        """A Lookup's `read` of `blocks` index records (a store's lookup never writes): here on the event loop
        when they are few (INLINE_LOOKUP_BLOCKS), else on the tier's executor."""
        return read() if blocks <= INLINE_LOOKUP_BLOCKS else await self.tier.call(read)

    def _from_anchor_record(self) -> bool:
        """Whether a next turn is answered from its anchor's stored record (A5): on a node's own store,
        unless the trace records every Lookup's whole chain (it then takes the remembered one, A1)."""
        return self.anchored is not None and self.router is None and not self.trace.enabled

    async def _lookup_after(self, request: pb.LookupRequest, layout: Layout, scope: BlockScope,
                            limit: int) -> pb.LookupResponse:
        """A next turn from its anchor (A5): the anchor stored at its depth stands for its prefix (R6, and a
        hash fixes its ancestors), so only the hashes after it are read; unknown (A4) when it is not."""
        assert self.anchored is not None
        anchored, blocks, anchor = self.anchored, request.anchor_blocks, request.anchor_hash
        after = validate.anchored_after(request.block_hashes_packed, blocks, limit=limit)
        lease_ms = min(request.lease_ms, self.settings.max_lease_ms)
        due: list[bytes] = []
        answer = await self._index_read(len(after) + 1, lambda: anchored.lookup_after(
            scope, anchor, blocks, after, lease_ms / 1000.0, touch_due=due))
        if answer is None:
            return pb.LookupResponse(anchor_unknown=True)  # nothing looked up or leased: the client sends all
        found, lease = answer
        deepest = after[found - blocks - 1] if found > blocks else anchor
        # The trace is off here (`_from_anchor_record`): it would want the whole chain, which this path never has.
        return await self._found(request, layout, scope, after, found, deepest, lease, due, asked=blocks + len(after))

    async def _found(self, request: pb.LookupRequest, layout: Layout, scope: BlockScope, hashes: Sequence[bytes],
                     found: int, deepest: bytes, lease: Any, due: list[bytes], *, only_swa: bool = False,
                     asked: int | None = None) -> pb.LookupResponse:
        """A node's Lookup answer once the tier found `found` blocks (`deepest` the last; `asked` blocks in all,
        default len(hashes)): the found prefix refreshed (R5), pinned or placed if asked, the SWA pool's
        resume, the trace (of `hashes`)."""
        lease_ms = min(request.lease_ms, self.settings.max_lease_ms)
        self.hits.record(scope.namespace, "lookup", len(hashes) if asked is None else asked, found)
        if due:
            # A hit is a use (R5): the deepest found block's refresh keeps its whole
            # prefix (R6 and the carry-up of R7), durable before the answer, batched
            # with other refreshes as Get's are. `due` is empty when it was recorded
            # within the touch granularity.
            try:
                await asyncio.wrap_future(self.tier.touch_soon(due))
            except BaseException:
                if lease is not None:
                    self.tier.release(lease.lease_id)
                raise
        reply = pb.LookupResponse(found_blocks=found, found_tokens=found * self.settings.block_tokens,
                                  lease_id=lease.lease_id if lease else "", lease_ms=lease_ms if lease else 0)
        if request.keep_until_s:  # R22-R24: the found prefix, pinned on its deepest block
            _check_keep_until(request.keep_until_s)
            await self._lookup_pin(reply, scope, deepest, request.keep_until_s)
        if request.want_hosts and found:  # where the found prefix lives: here, all of it (PLANNER.md)
            reply.hosts.append(self.own_host.held(found).to_pb())
        # A fleet client found the blocks on the runs' nodes and asks this node's shared pool for the
        # snapshot alone (docs/FLEET.md F45): its found tokens bound the resume, as this node's own would.
        found_tokens = request.swa_found_tokens if only_swa else found * self.settings.block_tokens
        resume = await self._swa_resume(request, layout.geometry, scope, found_tokens)
        if resume is not None:
            reply.swa_found = True
            reply.swa_index, reply.swa_position, reply.swa_resume_tokens = resume
        self.trace.lookup(scope, hashes, found, lease_ms=request.lease_ms, swa_asked=len(request.swa_keys), swa=resume)
        return reply

    async def _lookup_runs(self, request: pb.LookupRequest, scope: BlockScope) -> pb.LookupResponse:
        """Several runs of a fleet chain in one call (docs/FLEET.md F50): each is looked up, leased and
        refreshed as a Lookup of its own would be (R6 and R15 within the run, on this node); the client
        keeps R6 across the runs."""
        other = [name for name, asked in (("anchor_hash", request.anchor_hash or request.anchor_blocks),
                                          ("swa_keys", request.swa_keys or request.swa_positions),
                                          ("keep_until_s", request.keep_until_s),
                                          ("want_hosts", request.want_hosts)) if asked]
        if other:
            raise InvalidArgument(f"run_lengths cannot be combined with {', '.join(other)}",
                                  hint="ask the runs without them, or the whole chain in a Lookup of its own")
        if self.router is not None:
            raise FailedPrecondition("run_lengths is a storage node's: a gateway places the runs itself",
                                     hint="send the whole chain's fleet hashes without run_lengths")
        hashes = validate.lookup_hashes(request.block_hashes, request.block_hashes_packed,
                                        limit=self.settings.max_lookup_blocks)
        lengths = list(request.run_lengths)
        hashed = list(request.run_hashed)
        if hashed and (not request.run_anchors or len(hashed) != len(lengths)):
            raise InvalidArgument(f"run_hashed flags runs named by their last hash (run_anchors), one a run: got "
                                  f"{len(hashed)} flags for {len(lengths)} runs"
                                  f"{'' if request.run_anchors else ' without run_anchors'}",
                                  hint="flag every run or none, with run_anchors set")
        # F81: a flagged run sends all its hashes, the others their last one.
        sent = (sum(n if h else 1 for n, h in zip(lengths, hashed, strict=True)) if hashed
                else len(lengths) if request.run_anchors else sum(lengths))
        if min(lengths) < 1 or sent != len(hashes):
            how = "with one last hash each (run_anchors)" if request.run_anchors else "summing to the"
            raise InvalidArgument(f"run_lengths must be runs of at least 1 block {how} {len(hashes)} "
                                  f"hashes sent, got {len(lengths)} runs summing to {sum(lengths)} "
                                  f"(least {min(lengths)}{', some flagged run_hashed' if hashed else ''})")
        lease_ms = min(request.lease_ms, self.settings.max_lease_ms)
        lease_s = lease_ms / 1000.0
        due: list[bytes] = []

        def by_hashes(chains: Sequence[bytes], runs: Sequence[int]) -> list[tuple[int, str]]:
            if _runs_at_once(type(self.tier)):  # F75: one read txn for every run, the leases granted together
                tier = cast(RunLookup, self.tier)
                return [(found, lease.lease_id if lease else "")
                        for found, lease in tier.lookup_runs(scope, chains, runs, lease_s, touch_due=due)]
            answers, start = [], 0
            for n in runs:
                found, lease = self.tier.lookup(scope, chains[start:start + n], lease_s, touch_due=due)
                answers.append((found, lease.lease_id if lease else ""))
                start += n
            return answers

        def look() -> list[tuple[int, str]]:
            if hashed and any(hashed):  # F81: the flagged runs by their hashes, the rest by their last hash
                return self._runs_mixed(scope, hashes, lengths, hashed, lease_s, due, by_hashes)
            if request.run_anchors:  # F77: each run whole or not, by its last block stored at its depth
                return self._runs_by_anchor(scope, hashes, lengths, lease_s, due)
            return by_hashes(hashes, lengths)

        answers = await self._index_read(len(lengths) if request.run_anchors else len(hashes), look)
        found = sum(f for f, _ in answers)
        self.hits.record(scope.namespace, "lookup", sum(lengths), found)
        leases = [lease for _, lease in answers if lease]
        if due:  # a hit is a use (R5): each run's deepest found block, durable before the answer
            try:
                await asyncio.wrap_future(self.tier.touch_soon(due))
            except BaseException:
                for lease in leases:
                    self.tier.release(lease)
                raise
        return pb.LookupResponse(found_blocks=found, found_tokens=found * self.settings.block_tokens,
                                 lease_ms=lease_ms if leases else 0,
                                 run_found_blocks=[f for f, _ in answers], run_lease_ids=[lz for _, lz in answers])

    def _runs_mixed(self, scope: BlockScope, hashes: Sequence[bytes], lengths: Sequence[int],
                    hashed: Sequence[bool], lease_s: float, due: list[bytes],
                    by_hashes: Callable[[Sequence[bytes], Sequence[int]], list[tuple[int, str]]]
                    ) -> list[tuple[int, str]]:
        """Runs named by their last hash, the flagged ones by all their hashes (run_hashed, docs/FLEET.md F81):
        each part answered as a request of its own would be, back in run order."""
        anchors: list[bytes] = []
        chains: list[bytes] = []
        start = 0
        for n, flagged in zip(lengths, hashed, strict=True):
            if flagged:
                chains += hashes[start:start + n]
            else:
                anchors.append(hashes[start])
            start += n if flagged else 1
        anchored = [n for n, f in zip(lengths, hashed, strict=True) if not f]
        by_anchor = iter(self._runs_by_anchor(scope, anchors, anchored, lease_s, due) if anchors else ())
        counted = iter(by_hashes(chains, [n for n, f in zip(lengths, hashed, strict=True) if f]))
        return [next(counted) if flagged else next(by_anchor) for flagged in hashed]

    def _runs_by_anchor(self, scope: BlockScope, anchors: Sequence[bytes], lengths: Sequence[int], lease_s: float,
                        due: list[bytes]) -> list[tuple[int, str]]:
        """Runs named by their last hashes (run_anchors, docs/FLEET.md F77): a run is whole here when its last block
        is stored at the run's length (R6 keeps the blocks above a stored one, and its hash fixes which: A5's
        reasoning), answered as its length and leased on that block; else 0 (the client asks it with its hashes)."""
        if _runs_at_once(type(self.tier)):  # one read txn for every run, the leases granted together
            return [(found, lease.lease_id if lease else "") for found, lease in cast(RunLookup, self.tier)
                    .lookup_run_anchors(scope, anchors, lengths, lease_s, touch_due=due)]
        if self.anchored is None:
            raise FailedPrecondition("this store cannot find a run by its last block (run_anchors)",
                                     hint="send each run's hashes with run_lengths")
        answers = []
        for anchor, n in zip(anchors, lengths, strict=True):
            known = self.anchored.lookup_after(scope, anchor, n, (), lease_s, touch_due=due)
            answers.append((n, known[1].lease_id if known[1] else "") if known is not None else (0, ""))
        return answers

    async def _lookup_pin(self, reply: pb.LookupResponse, scope: BlockScope, deepest: bytes, until_s: float) -> None:
        """Pin a Lookup's found prefix until `until_s`; the grant goes into `reply` (R22-R24)."""
        if self.pins is None:
            reply.keep_note = "this store does not pin prefixes (keep_until_s)"
        elif not deepest:
            reply.keep_note = "nothing was found to keep"
        else:
            grant = await self.tier.call(self.pins.pin, scope, deepest, until_s)
            reply.kept_until_s, reply.keep_note = grant.until_s, grant.why
            await self._audit_pin(scope, deepest, grant)

    def _remember(self, scope: BlockScope, hashes: Sequence[bytes], found: int, request: pb.LookupRequest) -> None:
        """Remember the found prefix of a Lookup as an anchor for its next turn (A1); not again when
        it is the anchor's own chain (found no further)."""
        if found and found != request.anchor_blocks and not self._from_anchor_record():  # A5 needs none
            self.anchors.remember(scope.prefix, hashes[:found], replaces=request.anchor_hash)

    async def _routed_lookup(self, request: pb.LookupRequest, scope: BlockScope, hashes: Sequence[bytes],
                             lease_ms: int, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        """A gateway's Lookup: fleet hashes from block 0, across the runs' replicas (F31, F32)."""
        assert self.router is not None
        route = _route(request, context)
        found, lease_id = (await self.router_call(self.router.route_lookup, route, hashes,
                                                  lease_ms)) if hashes else (0, None)
        self.hits.record(scope.namespace, "lookup", len(hashes), found)
        reply = pb.LookupResponse(found_blocks=found, found_tokens=found * self.settings.block_tokens,
                                  lease_id=lease_id or "", lease_ms=lease_ms if lease_id else 0)
        if request.swa_keys or request.swa_positions:  # the fleet's shared pool, within the blocks found (F52)
            if len(request.swa_keys) != len(request.swa_positions):
                raise InvalidArgument(f"swa_keys has {len(request.swa_keys)} entries but swa_positions has "
                                      f"{len(request.swa_positions)}: send one position per key")
            within = reply.found_tokens if hashes else request.swa_found_tokens
            try:
                swa = await self.router_call(self.router.route_swa, route, request, within)
            except (Unavailable, DeadlineExceeded) as exc:  # a pool out of reach is a miss, as on one server
                logging.getLogger("kvstore.gateway").warning("gateway: SWA pool not asked: %s", exc.message)
                swa = pb.LookupResponse()
            if swa.swa_found:
                reply.swa_found, reply.swa_index = True, swa.swa_index
                reply.swa_position, reply.swa_resume_tokens = swa.swa_position, swa.swa_resume_tokens
        if request.keep_until_s:  # R28: every copy of every found run, each node auditing its grant
            _check_keep_until(request.keep_until_s)
            if found:
                kept = await self.router_call(self.router.route_pin, route, hashes, found, request.keep_until_s)
                reply.kept_until_s, reply.keep_note = kept.kept_until_s, kept.note
            else:
                reply.keep_note = "nothing was found to keep"
        if request.want_hosts and found:
            # at the tenant's own replication, as route_lookup placed them (F51)
            reply.hosts.extend(h.to_pb() for h in self.router.route_hosts(hashes, found, route.namespace))
        return reply

    async def router_call(self, fn: Any, *args: Any) -> Any:
        """Routed work on the store's threads."""
        return await self.tier.call(fn, *args)

    async def _swa_resume(self, request: pb.LookupRequest, geometry: ModelGeometry, scope: BlockScope,
                          found_tokens: int) -> tuple[int, int, int] | None:
        """(index, T, R) of the live candidate snapshot that serves the longest resume R, or None.

        R follows the resume rules (kvstore.swa_snapshot.resume_length) and never
        exceeds the found tokens: a resume at R needs the compressed and indexer
        rows of every position below R, and only found blocks hold them (the
        worker cannot recompute a position below R from window state taken at
        T >= R). Ties go to the shorter T (an exact hit before a T-1 resume).
        """
        if not request.swa_keys and not request.swa_positions:
            return None
        if len(request.swa_keys) != len(request.swa_positions):
            raise InvalidArgument(f"swa_keys has {len(request.swa_keys)} entries but swa_positions has "
                                  f"{len(request.swa_positions)}: send one position per key")
        keys = validate.hashes(request.swa_keys, limit=self.settings.max_lookup_blocks, field="swa_keys")
        limit = min(found_tokens, request.swa_resume_limit or found_tokens)
        usable = []
        for i, (t, key) in enumerate(zip(request.swa_positions, keys, strict=True)):
            r = resume_length(geometry, t, limit)
            if r is not None:
                usable.append((-r, t, i, key))
        if self.swa is None or not usable:
            return None
        usable.sort()
        live = await self.swa.exists_many([scope.key(key) for *_, key in usable])
        return next(((i, t, -neg_r) for (neg_r, t, i, _), ok in zip(usable, live, strict=True) if ok), None)

    @unary
    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        if not request.lease_id:
            raise InvalidArgument("lease_id is empty")
        if self.router is not None:  # a composite lease: each node checks its part against the caller's token
            return pb.ReleaseResponse(released=await self.router_call(
                self.router.route_release, Route(token=_token(context), namespace="", geometry=""),
                request.lease_id))
        caller = current_caller()
        # A lease pins a key of the tenant whose Lookup took it: another tenant's id is
        # answered as an unknown one (docs/SECURITY.md); an admin may name any tenant.
        mine = namespace_id(caller.tenant)
        owns = None if ADMIN in caller.rights else (
            lambda key: key[FINGERPRINT_BYTES:FINGERPRINT_BYTES + NAMESPACE_ID_BYTES] == mine)
        return pb.ReleaseResponse(released=self.tier.release(request.lease_id, owns=owns))

    @unary
    async def Put(self, request: pb.PutRequest | PutRequestView, context: grpc.aio.ServicerContext) -> pb.PutResponse:
        if self.router is not None:
            return (await self._routed_put(_message(request), context))[0]
        return await self._put(request)

    async def _routed_put(self, request: pb.PutRequest, context: grpc.aio.ServicerContext,
                          after: StoredTail | None = None) -> tuple[pb.PutResponse, StoredTail | None]:
        """A gateway's Put: cut at run boundaries and hashed as the fleet does, each part on every replica; its
        reply, and what it stored last (for the next request of its stream: F69b). `after`: what the request
        before it in the same stream stored."""
        return await self._routed_store(request, await self._routed_cut(request), context, after)

    async def _routed_cut(self, request: pb.PutRequest) -> list[Any]:
        """A gateway's Put request checked, hashed as the fleet does and cut at run boundaries (on a thread: it is
        O(request bytes)); it needs nothing of the requests before it in its stream (F69c)."""
        assert self.router is not None
        _check_keep_until(request.keep_until_s)
        layout, _ = validate.scope(self.layouts, request.geometry, request.namespace)
        return await asyncio.to_thread(
            validate.fleet_put_plan, layout, run_blocks=self.router.run_blocks, parent_hash=request.parent_hash,
            token_ids=request.token_ids, extra_keys=list(request.extra_keys), blocks=list(request.blocks),
            limit=self.settings.max_batch_blocks, first_block=request.first_block, run_key=request.run_key,
            run_bridge=request.run_bridge)

    async def _routed_store(self, request: pb.PutRequest, parts: list[Any], context: grpc.aio.ServicerContext,
                            after: StoredTail | None) -> tuple[pb.PutResponse, StoredTail | None]:
        """A cut request's parts on every replica (F30), after F69's check; its reply and what it stored last."""
        assert self.router is not None
        # R6 across runs (F69): a Put from a run's first block needs the run before complete on a replica.
        route = _route(request, context)
        await self.router_call(self.router.route_parent_run, route, request.first_block, request.parent_hash,
                               request.parent_run_key, after)
        try:
            written, existing, kept = await self.router_call(self.router.route_put, route, parts,
                                                             request.keep_until_s)
        except PutNotReplicated as exc:
            # Said with the status of its cause: UNAVAILABLE when every failed copy may succeed later (a node
            # away; putting again is safe), else the first lasting failure's (a quota, a refused parent).
            lasting = [e for _, _, e in exc.failures if not e.retryable]
            raise from_status(to_status(lasting[0]) if lasting else grpc.StatusCode.UNAVAILABLE, exc.message) from None
        reply = pb.PutResponse(block_hashes=[h for p in parts for h in p.hashes], written_blocks=written,
                               existing_blocks=existing, kept_until_s=kept.kept_until_s if kept else 0.0,
                               keep_note=kept.note if kept else "")
        tail = StoredTail(route=route, end_block=request.first_block + len(request.blocks),
                          last_hash=parts[-1].hashes[-1], run_key=parts[-1].run_key) if parts else None
        return reply, tail

    @streaming
    async def PutStream(self, requests: AsyncIterator[pb.PutRequest | PutRequestView],
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.PutResponse]:
        # Each batch is checked and hashed as it arrives (on a thread: it is O(batch bytes)), up to
        # PUT_STREAM_DEPTH ahead of the commit; batches planned when a commit ends share the next one
        # (group commit: one fsync for several), each acknowledged only after it, in order; the
        # stream ends with the first error, after the batches before it (gateway/put_stream.py).
        if self.router is not None:  # each batch acknowledged once on every replica, in order (F30)
            async with aclosing(self._routed_stream(requests, context)) as replies:
                async for reply in replies:
                    yield reply
            return
        # Closed with the call (a cancelled call stops its stages now, not when collected).
        async with aclosing(self.put_replies(requests)) as replies:
            async for reply in replies:
                yield reply

    async def put_replies(self, requests: AsyncIterator[pb.PutRequest | PutRequestView]
                          ) -> AsyncGenerator[pb.PutResponse, None]:
        """A node's PutStream stages (gateway/put_stream.py): each request's reply once its commit returned, in
        order; the first error raised after the replies before it. Also the TCP transport's puts
        (gateway/transfer_tcp_put.py), run as their grant's caller."""
        commit, durable = put_stream.store_commits(self.tier)
        async with aclosing(put_stream.committed(requests, self.plan_put, commit, PUT_STREAM_DEPTH, durable)) as done:
            async for batch, result in done:
                _trace_put(self.trace, batch, result)
                await self._audit_pin(batch.scope, batch.hashes[-1] if batch.hashes else b"", result.pin)
                yield _put_response(batch, result)

    async def _routed_stream(self, requests: AsyncIterator[pb.PutRequest | PutRequestView],
                             context: grpc.aio.ServicerContext) -> AsyncGenerator[pb.PutResponse, None]:
        """A gateway's PutStream: up to ROUTED_PUT_DEPTH requests received and cut while one is stored, stored
        and acknowledged one at a time in order (F69c, gateway/routed_put_stream.py)."""
        tail: StoredTail | None = None  # what the request before stored: the next from its end skips F69 (F69b)

        async def cut(request: pb.PutRequest | PutRequestView) -> tuple[pb.PutRequest, list[Any]]:
            message = _message(request)
            return message, await self._routed_cut(message)

        async def store(_: object, cut_request: tuple[pb.PutRequest, list[Any]]) -> pb.PutResponse:
            nonlocal tail
            reply, tail = await self._routed_store(*cut_request, context, tail)
            return reply

        async with aclosing(routed_put_stream.stored(requests, cut, store, ROUTED_PUT_DEPTH)) as replies:
            async for reply in replies:
                yield reply

    def plan_put(self, request: pb.PutRequest | PutRequestView) -> PutBatch:
        """A validated Put batch, its tokens hashed into the chain it extends, its blocks' checksums taken
        (here, on the reader's thread, so the write transaction does not: tiers/puts.py)."""
        layout, scope = validate.scope(self.layouts, request.geometry, request.namespace)
        # A decoded request's blocks are views of the received message (gateway/put_request.py): not copied.
        blocks: list[bytes | memoryview] = list(request.blocks)
        plan = validate.put_plan(layout, parent_hash=request.parent_hash, token_ids=request.token_ids,
                                 extra_keys=list(request.extra_keys), blocks=blocks,
                                 limit=self.settings.max_batch_blocks)
        _check_keep_until(request.keep_until_s)
        if request.keep_until_s and self.pins is None:
            raise FailedPrecondition("this store does not pin prefixes (keep_until_s)")
        note_put_tokens(self.tier, [scope.key(h) for h in plan.hashes], request.token_ids, layout.block_tokens)
        return PutBatch(scope=scope, parent_hash=plan.parent, hashes=plan.hashes, blocks=blocks,
                        is_root=plan.is_root, keep_until_s=request.keep_until_s or None,
                        checksums=blockcopy.digests(blocks))

    async def _put(self, request: pb.PutRequest | PutRequestView) -> pb.PutResponse:
        # Checking and hashing are O(request size), so they run off the loop: on the tier's executor, in the
        # same call that commits the batch with the others waiting (one hop, not two: gateway/put_group.py).
        batch, result = await self.put_groups.plan_and_put(partial(self.plan_put, request))
        _trace_put(self.trace, batch, result)
        await self._audit_pin(batch.scope, batch.hashes[-1] if batch.hashes else b"", result.pin)
        return _put_response(batch, result)

    async def audit_expired_pins(self) -> int:
        """Audit each pin past its time (R29: `pin-expired`, with the block, its time and the bytes it charged),
        then drop its journal record; how many. A store that does not pin, or no audit log: nothing."""
        expired, forget = getattr(self.tier, "expired_pins", None), getattr(self.tier, "forget_expired_pins", None)
        if self.pins is None or self.audit is None or expired is None or forget is None:
            return 0
        gone = await self.tier.call(expired)
        for tenant, pin in gone:
            await self.audit.record(actor=PIN_AUDIT_ACTOR, action="pin-expired", tenant=tenant,
                                    old={"block": pin.key[-32:].hex(), "until_s": pin.until_s,
                                         "charged_bytes": pin.charged_bytes}, new=None)
        await self.tier.call(forget, [p for _, p in gone])
        return len(gone)

    async def run_pin_audit(self, interval_s: float = PIN_AUDIT_INTERVAL_S) -> None:
        """Audit expired pins every `interval_s` until cancelled (a read when none is due); a failure is
        logged and tried again at the next round (the journal keeps what was not audited)."""
        while True:
            try:
                await self.audit_expired_pins()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the journal keeps them: the next round tries again
                log.warning("pins: auditing expired pins failed: %s", exc)
            await asyncio.sleep(interval_s)

    async def _audit_pin(self, scope: BlockScope, block_hash: bytes, grant: PinGrant | None) -> None:
        """Record a pin granted (R27): who, on which block, until when, asked when."""
        if grant is None or not grant.until_s or self.audit is None:
            return
        await self.audit.record(actor=current_caller().tenant, action="pin", tenant=scope.namespace, old=None,
                                new={"block": block_hash.hex(), "until_s": grant.until_s,
                                     "asked_until_s": grant.asked_until_s, "note": grant.why})

    @streaming
    async def Get(self, request: pb.GetRequest, context: grpc.aio.ServicerContext
                  ) -> AsyncIterator[pb.GetResponse | bytes]:
        layout, scope = validate.scope(self.layouts, request.geometry, request.namespace)
        hashes = validate.hashes(request.block_hashes, limit=self.settings.max_batch_blocks)
        if self.router is not None:
            async for reply in self._routed_get(request, scope, hashes, context):
                yield reply
            return
        keys = [scope.key(h) for h in hashes]
        found: list[bytes] = []
        due: list[bytes] = []  # found blocks whose retention clock is due a restart (R5)
        on_loop = self.found_reads is not None and len(keys) * layout.block_bytes <= INLINE_GET_BYTES
        try:
            for start in range(0, len(keys), GET_CHUNK_BLOCKS):
                chunk = keys[start:start + GET_CHUNK_BLOCKS]
                # FOUND blocks come back serialized, copied once out of the map (gateway/replies.py).
                results = self._found_chunk(chunk, start, due) if on_loop else None
                if results is None:  # a large Get, or a block missing or damaged: the executor's careful read
                    results = await self.tier.call(self._read_chunk, chunk, start, due, not on_loop)
                for offset, (status, reply) in enumerate(results):
                    if status is ReadStatus.FOUND:
                        found.append(chunk[offset])
                        yield reply
                    else:
                        yield pb.GetResponse(index=start + offset, status=_STATUS[status])
        finally:
            self.tier.count_get(len(keys), len(found))
            self.hits.record(scope.namespace, "get", len(keys), len(found))
            self.trace.get(scope, hashes, len(found))
        if due:
            # Durable before the stream ends OK: a read the client saw complete
            # restarts the blocks' retention clocks even across a crash. Blocks
            # recorded within the touch granularity need no write (R5): no hop.
            await asyncio.wrap_future(self.tier.touch_soon(due))

    def _found_chunk(self, chunk: list[bytes], start: int, due: list[bytes]) -> list[tuple[ReadStatus, Any]] | None:
        """A Get chunk's replies when every block is stored and intact, those due a refresh added to `due`;
        None when not, or the store has no `FoundReads`. No side effect: the event loop may run it."""
        if self.found_reads is None:
            return None
        replies = self.found_reads.read_found(chunk, partial(_found_reply, start), touch_due=due)
        return None if replies is None else [(ReadStatus.FOUND, reply) for reply in replies]

    def _read_chunk(self, chunk: list[bytes], start: int, due: list[bytes],
                    try_found: bool) -> list[tuple[ReadStatus, Any]]:
        """A Get chunk's statuses and replies, on the executor: `_found_chunk` first when `try_found`, else
        (or when it says no) the store's `read`, which reports, counts and drops a corrupt block; its
        found blocks all go to `due` (the refresh skips those recorded within the granularity)."""
        results = self._found_chunk(chunk, start, due) if try_found else None
        if results is None:
            results = self.tier.read(chunk, partial(_found_reply, start))
            due.extend(key for key, (status, _) in zip(chunk, results, strict=True) if status is ReadStatus.FOUND)
        return results

    async def _routed_get(self, request: pb.GetRequest, scope: BlockScope, hashes: list[bytes],
                          context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GetResponse | bytes]:
        """A gateway's Get: each run from its nearest replica, with failover (F33); the run is found
        from `first_block` and `run_key` (F37)."""
        assert self.router is not None
        router, route = self.router, _route(request, context)
        # Answered as the nodes' blocks arrive (F69a), not once the Get is read whole: each run is read on the
        # store's threads into a feed of one run's bound, drained here batch by batch, run after run.
        found = 0
        feeds = router.route_get_feeds(route, hashes, request.first_block, request.run_key)
        try:
            for feed in feeds:
                async with aclosing(drained_async(feed)) as batches:  # a cancelled call closes the feed now
                    async for batch in batches:
                        for index, status, data in batch:
                            if status == pb.BLOCK_STATUS_FOUND:
                                found += 1
                                yield found_reply(index, memoryview(data))
                            else:
                                yield pb.GetResponse(index=index, status=cast(Any, status))
        finally:
            feeds.close()  # the feeds made and not drained (the run read ahead) closed with the call
        self.hits.record(scope.namespace, "get", len(hashes), found)

    @unary
    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        if self.router is not None:  # a gateway's: the nodes' answers to this caller, merged (F53)
            return await self.router_call(self.router.route_stats, Route(token=_token(context), namespace="",
                                                                         geometry=""), request)
        caller = current_caller()
        # Each tenant's usage is an LMDB read: on the tier's pool, never on the event loop.
        hit_fields = await self.tier.call(self._hit_fields, request, _stats_tenant(request.tenant, caller))
        if ADMIN not in caller.rights:
            # The store's counters, usage and write rate span every tenant: its own hit counters only.
            return pb.StatsResponse(retention_hours=self.settings.retention_hours, store_wide=False, **hit_fields)
        s = self.tier.stats()
        c = s.counters
        extra: dict[str, Any] = {
            **self.resume.stats_fields(), **hit_fields, "store_wide": True,
            **_capacity_fields(s.capacity_bytes, s.write_rate_bytes_per_s, s.retention_hours,
                               min(self.settings.write_rate_window_s, max(s.uptime_s, 1.0)))}
        return pb.StatsResponse(
            lookups=c.lookups, lookup_tokens_asked=c.lookup_tokens_asked,
            lookup_tokens_found=c.lookup_tokens_found, gets=c.gets, get_tokens_asked=c.get_tokens_asked,
            get_tokens_returned=c.get_tokens_returned, puts=c.puts, blocks_written=c.blocks_written,
            bytes_written=c.bytes_written, rejected_puts=c.rejected_puts, evictions=c.evictions,
            evicted_bytes=c.evicted_bytes, corrupt_blocks=c.corrupt_blocks, blocks_stored=s.blocks_stored,
            bytes_stored=s.bytes_stored, capacity_bytes=s.capacity_bytes, bytes_free=s.bytes_free,
            write_rate_bytes_per_s=s.write_rate_bytes_per_s, headroom_hours=s.headroom_hours,
            retention_hours=s.retention_hours, active_leases=s.active_leases,
            uptime_s=s.uptime_s, stored_by_geometry=self._by_geometry(s.by_layout),
            trace=trace_counters(self.trace), **extra,
        )

    def _hit_fields(self, request: pb.StatsRequest, tenant: str | None) -> dict[str, Any]:
        """The windows, tenants and chart of a Stats answer: `tenant`'s, or every tenant's (None)."""
        names = list(request.windows) or list(WINDOWS)
        unknown = [n for n in names if n not in WINDOWS]
        if unknown:
            raise InvalidArgument(f"windows {unknown} are not known; ask for some of {', '.join(WINDOWS)}")
        if request.chart_points > MAX_SERIES_POINTS:
            raise InvalidArgument(f"chart_points is {request.chart_points}: at most {MAX_SERIES_POINTS} "
                                  "(the 24 h are kept in half-hours)")
        tenants = [tenant] if tenant is not None else self.hits.tenants()
        chart = self.hits.series(tenant, request.chart_points) if request.chart_points else []
        return {
            "windows": _windows(self.hits.windows(tenant, names)),
            "tenants": [self._tenant_hits(t, names) for t in tenants],
            "chart": [pb.HitPoint(start_s=p.start_s, seconds=p.seconds, counts=pb.HitCounts(**p.counts))
                      for p in chart],
            "run_started_at_s": self.hits.started_s, "counted_since_s": self.hits.counted_since_s,
        }

    def _tenant_hits(self, tenant: str, names: list[str]) -> pb.TenantHits:
        reply = pb.TenantHits(tenant=tenant, windows=_windows(self.hits.windows(tenant, names)))
        usage = self.tier.namespace_usage(tenant)
        reply.usage_known = True
        reply.token_hours, reply.blocks_stored, reply.bytes_stored = usage.token_hours, usage.blocks, usage.stored_bytes
        if self.pins is not None:  # R27: an operator sees each tenant's pins
            totals, _ = self.pins.pins_of(tenant)
            reply.pins, reply.pinned_bytes = totals.pins, totals.charged_bytes
        return reply

    @unary
    async def ReportResume(self, request: pb.ReportResumeRequest,
                           context: grpc.aio.ServicerContext) -> pb.ReportResumeResponse:
        _, scope = validate.scope(self.layouts, request.geometry, request.namespace)
        # The longest prompt a Lookup covers: its most blocks, plus a partial block.
        longest = (self.settings.max_lookup_blocks + 1) * self.settings.block_tokens - 1
        report = check_report(request, max_prompt_tokens=longest)
        self.resume.add(report)
        self.hits.record_resume(scope.namespace, prompt_tokens=report.prompt_tokens,
                                found_tokens=report.found_tokens, usable_tokens=report.usable_tokens,
                                action_field=ACTION_FIELDS[report.action])
        self.trace.resume(scope, prompt_tokens=report.prompt_tokens, found_tokens=report.found_tokens,
                          usable_tokens=report.usable_tokens, action=pb.ResumeAction.Name(report.action))
        return pb.ReportResumeResponse()

    @unary
    async def ReportCorrupt(self, request: pb.ReportCorruptRequest,
                            context: grpc.aio.ServicerContext) -> pb.ReportCorruptResponse:
        # A same-host reader's word is not trusted: the tier reads each named block
        # again (`BlockStore.read` verifies it and drops and counts it only when
        # it really fails), so naming an intact block leaves it stored. The scope
        # rules are Get's: the caller's own tenant unless it is an admin.
        _, scope = validate.scope(self.layouts, request.geometry, request.namespace)
        hashes = validate.hashes(request.block_hashes, limit=self.settings.max_batch_blocks)
        keys = [scope.key(h) for h in hashes]
        statuses: list[pb.BlockStatus] = []
        for start in range(0, len(keys), GET_CHUNK_BLOCKS):
            results = await self.tier.call(self.tier.read, keys[start:start + GET_CHUNK_BLOCKS])
            statuses.extend(_STATUS[status] for status, _ in results)
        return pb.ReportCorruptResponse(statuses=statuses,
                                        dropped_blocks=statuses.count(pb.BLOCK_STATUS_CORRUPT))

    def _by_geometry(self, by_layout: dict[bytes, tuple[int, int]]) -> list[pb.GeometryUsage]:
        """Per-layout usage, named where this server serves the fingerprint; served ones first."""
        names = {lay.geometry.fingerprint: name for name, lay in self.layouts.items()}
        order = sorted(by_layout, key=lambda fp: (fp not in names, names.get(fp, ""), fp))
        return [pb.GeometryUsage(fingerprint=fp, name=names.get(fp, ""), blocks_stored=by_layout[fp][0],
                                 bytes_stored=by_layout[fp][1]) for fp in order]


@cache
def _runs_at_once(kind: type) -> bool:
    """Whether a store of this type has `RunLookup` (asked once per type: a Protocol's isinstance is slow)."""
    return issubclass(kind, RunLookup)


def _message(request: pb.PutRequest | PutRequestView) -> pb.PutRequest:
    """The request as a protobuf message (a gateway's Put hands it on whole)."""
    return request.to_message() if isinstance(request, PutRequestView) else request


def _trace_put(trace: CallTrace, batch: PutBatch, result: PutResult) -> None:
    trace.put(batch.scope, batch.hashes, written=result.written_blocks, existing=result.existing_blocks,
              evicted_blocks=result.evicted_blocks, evicted_bytes=result.evicted_bytes)


def _token(context: grpc.aio.ServicerContext) -> str | None:
    """The caller's own token (its `authorization: Bearer` metadata), which a gateway calls nodes with (F38)."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value.removeprefix("Bearer ")
    return None


def _route(request: pb.PutRequest | pb.GetRequest | pb.LookupRequest, context: grpc.aio.ServicerContext) -> Route:
    """Whose request a gateway routes: the caller's token with the request's own namespace (the caller's tenant
    when empty, so the router knows whose policy places it: F51) and geometry."""
    return Route(token=_token(context), namespace=request.namespace or current_caller().tenant,
                 geometry=request.geometry)


def _stats_tenant(name: str, caller: Caller) -> str | None:
    """Whose hit counters a Stats call gets: the named tenant, or every tenant (None), for an
    admin; the caller's own tenant for anyone else.

    Raises:
        PermissionDenied: a caller without the admin right named another tenant.
    """
    if ADMIN in caller.rights:
        return validate.namespace(name) if name else None
    if name and name != caller.tenant:
        raise PermissionDenied(f"the stats of tenant {name!r} need the 'admin' right; this token is tenant "
                               f"{caller.tenant!r}'s", hint="leave the tenant out (--tenant) to see your own")
    return caller.tenant


def _windows(windows: list[Window]) -> list[pb.HitWindow]:
    return [pb.HitWindow(window=w.name, seconds=w.seconds, counts=pb.HitCounts(**w.counts)) for w in windows]


def _capacity_fields(capacity_bytes: int, rate_bytes_per_s: float, retention_hours: float,
                     rate_window_s: float) -> dict[str, Any]:
    """How long the whole capacity lasts at the recent write rate, and whether that is less than the retention.

    Blocks younger than the retention may not be evicted (R4, R8), so a store that
    takes in more than its capacity per retention period must refuse puts once full.
    """
    hours = capacity_bytes / rate_bytes_per_s / 3600.0 if rate_bytes_per_s > 0 else float("inf")
    return {"capacity_hours": hours, "headroom_warning": hours < retention_hours, "write_rate_window_s": rate_window_s}


def _found_reply(start: int, offset: int, data: memoryview) -> bytes:
    """Get's reply for the FOUND block at `offset` of a chunk from `start`, serialized."""
    return found_reply(start + offset, data)
