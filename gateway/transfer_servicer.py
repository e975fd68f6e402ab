"""The Transfer gRPC service: sessions, regions and descriptor batches, translated
to and from the wire; the work is in `transfer_session_table`, `transfer_sessions` and `transfer_engine`."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
import numpy as np

from gateway import validate
from gateway.auth import current_caller, require
from gateway.hit_stats import HitStats
from gateway.status import streaming, unary
from gateway.transfer_bulk import BulkServer
from gateway.transfer_bulk_lanes import DRAIN_MARGIN_S, DRAIN_MOST_S
from gateway.transfer_engine import Copier, read_batch, resolve_spans, run_read, run_write
from gateway.transfer_fetch import fetch, fetch_keys
from gateway.transfer_ring import RingServer
from gateway.transfer_ring import read as ring_read
from gateway.transfer_ring_context import RingContext
from gateway.transfer_session_table import SessionTable
from gateway.transfer_sessions import Session, Transfer
from gateway.transfer_tcp import TcpBulkServer
from gateway.validate import Layout
from kvstore.api_tokens import WRITE
from kvstore.config import TransferSettings
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.native import blockcopy
from kvstore.transfer import DescriptorGroup, Op
from kvstore.transfer_ring import LEASE_S, RING_DESCRIPTORS
from kvstore.transfer_ring import supported as ring_supported
from kvstore.v1 import transfer_pb2 as pb
from kvstore.v1 import transfer_pb2_grpc as pb_grpc
from tiers.store import MappedStore

T = TypeVar("T")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Transfer"].full_name
#: A repeated message field's tag and length prefix, at most.
_FIELD_BYTES = 6
#: Room kept in a message for what is not a batch's state (a reply's own fields, gRPC's framing).
_ENVELOPE_BYTES = 64 << 10
#: gRPC's own receive limit, for a servicer built without the server's.
_DEFAULT_MESSAGE_BYTES = 4 << 20


def _groups(request: pb.SubmitRequest) -> list[DescriptorGroup]:
    return [DescriptorGroup(region_id=g.region_id, length_bytes=g.length_bytes, block_hashes=g.block_hashes,
                            offsets_bytes=np.array(g.offsets_bytes, dtype=np.uint64)) for g in request.groups]


def _count(request: pb.SubmitRequest) -> int:
    """Descriptors in a batch, without reading them."""
    return sum(len(g.offsets_bytes) for g in request.groups)


def _state_fields(transfer: Transfer) -> dict[str, Any]:
    # The columns go out as they are: no message per descriptor, only per failure.
    r = transfer.results
    return {"transfer_id": transfer.transfer_id, "done": transfer.done.is_set(), "bytes_moved": r.bytes_moved,
            "statuses": bytes(r.statuses), "block_hashes": bytes(r.block_hashes),
            "failures": [pb.DescriptorFailure(index=i, code=code, reason=reason)
                         for i, (code, reason) in sorted(r.failures.items())]}


def _state(transfer: Transfer) -> pb.TransferState:
    return pb.TransferState(**_state_fields(transfer))


class TransferServicer(pb_grpc.TransferServicer):
    """Batched one-sided transfers between the NVMe tier and client regions on this host.

    Args:
        tier: the store; it reads straight out of LMDB's map (`tiers.store.MappedStore`) and owns
            the executor for blocking work.
        layouts: served geometries by name, the default first.
        settings: the transfer section of the configuration.
        max_message_bytes: the server's message limit; replies stay below it
            whatever `settings.max_reply_bytes` says.
        hits: the hit counters per tenant, shared with the KVStore service (None: reads not counted).
        rate: the quota interceptor's request rate (`gateway.quotas.RequestRate`): each ring
            request is charged to its tenant as a call is (None: ring requests are not charged).
    """

    def __init__(self, tier: MappedStore, layouts: dict[str, Layout], settings: TransferSettings,
                 *, max_message_bytes: int | None = None, hits: HitStats | None = None, rate: Any = None) -> None:
        self.tier = tier
        self.rate = rate
        self._ring: RingContext | None = None
        self.hits = hits
        self.layouts = layouts
        self.settings = settings
        room = settings.max_reply_bytes if max_message_bytes is None else max_message_bytes - _ENVELOPE_BYTES
        self.max_reply_bytes = min(settings.max_reply_bytes, room)
        #: Most block bytes one Fetch reply carries.
        self.max_fetch_bytes = (max_message_bytes or _DEFAULT_MESSAGE_BYTES) - _ENVELOPE_BYTES
        self.table = SessionTable(settings)
        # Copies get their own threads so a long fetch never queues Puts behind it.
        # The Python copy loop holds the GIL: threads running it at once only
        # convoy on it (fetches ran a third slower), so it gets one.
        threads = settings.copy_threads if blockcopy.NATIVE else 1
        self.copier = Copier(tier, threads)
        self.bulk = BulkServer(settings, max(layout.block_bytes for layout in layouts.values()))
        self.tcp = TcpBulkServer(settings, tier, self._count_fetch)

    async def close(self) -> None:
        """End every session (their batches finish their current chunk), then stop the copy threads."""
        await self.table.close_all()
        self.copier.close()
        self.bulk.close()
        self.tcp.close()

    @streaming
    async def OpenSession(self, request: pb.OpenSessionRequest,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[pb.SessionEvent]:
        layout, scope = validate.scope(self.layouts, request.geometry, request.namespace)
        session = self.table.open(context.peer(), layout.geometry.name, scope, tenant=current_caller().tenant)
        try:
            yield pb.SessionEvent(session_id=session.session_id, max_descriptors=self.settings.max_descriptors,
                                  max_region_bytes=self.settings.max_region_bytes,
                                  max_regions=self.settings.max_regions,
                                  keep_finished=self.settings.keep_finished,
                                  max_session_descriptors=self.settings.max_session_descriptors,
                                  max_session_mapped_bytes=self.settings.max_session_mapped_bytes,
                                  bulk_transports=self.tcp.offered + self.bulk.offered)
            # The session lives as long as this stream: the client cancelling it,
            # its connection dropping or its process dying all end the wait.
            await asyncio.Event().wait()
        finally:
            self.bulk.forget(session.session_id)
            self.tcp.forget(session.session_id)
            await self.table.close(session)

    @unary
    async def RegisterRegion(self, request: pb.RegisterRegionRequest,
                             context: grpc.aio.ServicerContext) -> pb.RegisterRegionResponse:
        session = self.table.get(request.session_id, context.peer(), current_caller().tenant)
        if request.ring:
            return self._register_ring(session, request)
        region, refused = _map_here(request.shm_name, lambda: self.table.register(
            session, request.shm_name, request.pid, request.fd, request.size_bytes, request.nonce))
        if region is None:
            return pb.RegisterRegionResponse(shared=False, reason=refused)
        return pb.RegisterRegionResponse(region_id=region.region_id, shared=True)

    def _register_ring(self, session: Session, request: pb.RegisterRegionRequest) -> pb.RegisterRegionResponse:
        """Map the session's request ring and start its thread, or renew its lease (gateway.transfer_ring)."""
        ctx = self._ring_context()
        if not ring_supported() or not ctx.limit:
            return pb.RegisterRegionResponse(shared=False, reason="no request ring on this server (x86-64 Linux only)")
        ring, refused = _map_here(request.shm_name, lambda: self.table.register_ring(
            session, request.shm_name, request.pid, request.fd, request.size_bytes, request.nonce,
            lambda mapped: RingServer(mapped, session, self._ring_read, ctx=ctx)))
        if ring is None:
            return pb.RegisterRegionResponse(shared=False, reason=refused)
        return pb.RegisterRegionResponse(shared=True, ring_descriptors=ctx.limit, ring_lease_ms=int(LEASE_S * 1000))

    def _ring_context(self) -> RingContext:
        if self._ring is None:
            s = self.settings
            self._ring = RingContext(
                tier=self.tier, table=self.table, layouts=self.layouts, hits=self.hits, rate=self.rate,
                limit=min(RING_DESCRIPTORS, s.chunk_descriptors, s.max_descriptors),
                slots=threading.BoundedSemaphore(max(4, 2 * self.copier.threads)))
        return self._ring

    def _ring_read(self, session: Session, raw: bytes) -> pb.TransferState:
        assert self._ring is not None
        return ring_read(self._ring, session, raw)

    @unary
    async def DeregisterRegion(self, request: pb.DeregisterRegionRequest,
                               context: grpc.aio.ServicerContext) -> pb.DeregisterRegionResponse:
        session = self.table.get(request.session_id, context.peer(), current_caller().tenant)
        self.table.deregister(session, request.region_id)
        return pb.DeregisterRegionResponse()

    @unary
    async def Submit(self, request: pb.SubmitRequest, context: grpc.aio.ServicerContext) -> pb.SubmitResponse:
        session = self.table.get(request.session_id, context.peer(), current_caller().tenant)
        n = _count(request)
        session.make_room(1, n)
        # (Groups bounded too: a few descriptors spread over many empty groups are no small batch.)
        if (request.wait and request.op == pb.TRANSFER_OP_READ and n <= self.settings.chunk_descriptors
                and len(request.groups) <= self.settings.chunk_descriptors):
            # A small read its caller waits on (the latency path): checking it is a few
            # slices, so it is checked here, and one copy thread looks it up and copies it.
            transfer = self._checked(session, request, inline=True)()
        else:
            # Checking hashes a write's chain (O(batch)): off the event loop, so other calls go on.
            transfer = (await asyncio.to_thread(self._checked, session, request))()
        if not request.wait:
            return pb.SubmitResponse(transfer_id=transfer.transfer_id)
        await transfer.done.wait()
        return pb.SubmitResponse(transfer_id=transfer.transfer_id, state=_state(transfer))

    @unary
    async def SubmitMany(self, request: pb.SubmitManyRequest,
                         context: grpc.aio.ServicerContext) -> pb.SubmitManyResponse:
        session = self.table.get(request.session_id, context.peer(), current_caller().tenant)
        if not 1 <= len(request.batches) <= self.settings.keep_finished:
            raise InvalidArgument(f"send 1 to {self.settings.keep_finished} batches; got {len(request.batches)}")
        # The bounds first: they cost a count per group, checking every batch costs far more.
        session.make_room(len(request.batches), sum(_count(b) for b in request.batches))
        starts = await asyncio.to_thread(self._checked_all, session, request)
        return pb.SubmitManyResponse(transfer_ids=[start().transfer_id for start in starts])

    @unary
    async def GetTransfer(self, request: pb.GetTransferRequest,
                          context: grpc.aio.ServicerContext) -> pb.TransferState:
        session = self.table.get(request.session_id, context.peer(), current_caller().tenant)
        transfer = session.transfer(request.transfer_id)
        if request.wait_ms and not transfer.done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(transfer.done.wait()), request.wait_ms / 1000.0)
        return _state(transfer)

    @unary
    async def GetTransfers(self, request: pb.GetTransfersRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetTransfersResponse:
        session = self.table.get(request.session_id, context.peer(), current_caller().tenant)
        ids = list(request.transfer_ids)
        if not 1 <= len(ids) <= self.settings.keep_finished:
            raise InvalidArgument(f"name 1 to {self.settings.keep_finished} transfer ids; got {len(ids)}")
        transfers = [session.transfer(t) for t in ids]
        pending = [t.done for t in transfers if not t.done.is_set()]
        if request.wait_ms and pending:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(done.wait() for done in pending)), request.wait_ms / 1000.0)
        # A batch's state is bounded (TransferSettings.TRANSFER_STATE_BYTES_PER_DESCRIPTOR
        # each), many are not: the reply takes states in order while they fit, and
        # says how many it left out. The first always fits (the settings check it).
        reply = pb.GetTransfersResponse()
        size = 0
        for transfer in transfers:
            state = reply.states.add(**_state_fields(transfer))  # built in place: no copy into the reply
            size += state.ByteSize() + _FIELD_BYTES
            if size > self.max_reply_bytes and len(reply.states) > 1:
                del reply.states[-1]
                break
        reply.omitted = len(transfers) - len(reply.states)
        return reply

    @unary
    async def Fetch(self, request: pb.FetchRequest, context: grpc.aio.ServicerContext) -> bytes:
        layout, scope = validate.scope(self.layouts, request.geometry, request.namespace)
        keys = fetch_keys(scope, request.block_hashes, block_bytes=layout.block_bytes,
                          max_blocks=self.settings.max_descriptors, max_bytes=self.max_fetch_bytes)
        fetched = None
        try:
            fetched = await fetch(self.tier, keys, layout.block_bytes, request.prefix_only)
        finally:
            found = fetched.found if fetched is not None else 0
            self.tier.count_get(len(keys), found)
            if self.hits is not None:
                self.hits.record(scope.namespace, "get", len(keys), found)
        self.table.counters.count(fetched.results)
        return fetched.wire  # already serialized: see `add_to_server`

    @unary
    async def OpenBulk(self, request: pb.OpenBulkRequest, context: grpc.aio.ServicerContext) -> pb.OpenBulkReply:
        session = self.table.get(request.session_id, context.peer(), current_caller().tenant)
        if request.transport == "tcp":  # the one-copy TCP transport (gateway/transfer_tcp.py)
            block_bytes = self.layouts[session.geometry].block_bytes
            refused, token = self.tcp.open(session, block_bytes)
            if refused:
                return pb.OpenBulkReply(accepted=False, reason=refused)
            return pb.OpenBulkReply(accepted=True, max_blocks=self.tcp.max_blocks(block_bytes), tcp_port=self.tcp.port,
                                    tcp_token=token)
        refused = await self.bulk.open(session.session_id, request.transport, request.segment, context.peer())
        if refused:
            return pb.OpenBulkReply(accepted=False, reason=refused)
        return pb.OpenBulkReply(accepted=True, max_blocks=self.bulk.max_blocks, slots=self.bulk.slots)

    @unary
    async def OpenPut(self, request: pb.OpenPutRequest, context: grpc.aio.ServicerContext) -> pb.OpenPutReply:
        # The interceptors checked the "write" right (METHOD_RIGHTS) and took the request rate's token, as for
        # PutStream; the scope is checked here too (each frame's again when it is planned, as the caller).
        validate.scope(self.layouts, request.geometry, request.namespace)
        refused, grant_id, token = self.tcp.open_put(current_caller(), context.peer())
        if refused:
            return pb.OpenPutReply(accepted=False, reason=refused)
        return pb.OpenPutReply(accepted=True, tcp_port=self.tcp.port, grant_id=grant_id, tcp_token=token,
                               max_frame_bytes=self.settings.tcp_max_request_bytes)

    def _count_fetch(self, session: Session, asked: int, found: int, results: Any) -> None:
        """Count a TCP transport request as Fetch counts one: a Get of its blocks (on the event loop)."""
        self.tier.count_get(asked, found)
        if self.hits is not None:
            self.hits.record(session.scope.namespace, "get", asked, found)
        self.table.counters.count(results)

    @unary
    async def BulkFetch(self, request: pb.BulkFetchRequest, context: grpc.aio.ServicerContext) -> pb.FetchReply:
        session = self.table.get(request.session_id, context.peer(), current_caller().tenant)
        segment = self.bulk.segment(session.session_id)
        layout = self.layouts[session.geometry]
        keys = fetch_keys(session.scope, request.block_hashes, block_bytes=layout.block_bytes,
                          max_blocks=self.bulk.max_blocks, max_bytes=self.bulk.slot_bytes)
        offsets = self.bulk.checked_offsets(len(keys), request.offsets_bytes, request.address, request.size_bytes,
                                            layout.block_bytes)
        fetched = None
        try:
            fetched = await self.bulk.fetch(self.tier, keys, segment, offsets, request.address, layout.block_bytes,
                                            request.prefix_only)
        finally:  # counted as Fetch counts: a Get of these blocks
            found = fetched.found if fetched is not None else 0
            self.tier.count_get(len(keys), found)
            if self.hits is not None:
                self.hits.record(session.scope.namespace, "get", len(keys), found)
        self.table.counters.count(fetched.results)
        r = fetched.results
        return pb.FetchReply(statuses=bytes(r.statuses),
                             failures=[pb.DescriptorFailure(index=i, code=code, reason=reason)
                                       for i, (code, reason) in sorted(r.failures.items())])

    @unary
    async def BulkDrain(self, request: pb.BulkDrainRequest, context: grpc.aio.ServicerContext) -> pb.BulkDrainReply:
        session = self.table.get(request.session_id, context.peer(), current_caller().tenant)
        lanes = self.bulk.segment(session.session_id)
        left = context.time_remaining()  # answered before the caller's deadline, so it learns the count
        wait_s = DRAIN_MOST_S if left is None else min(DRAIN_MOST_S, left - DRAIN_MARGIN_S)
        return pb.BulkDrainReply(writing=await lanes.drain(wait_s))

    @unary
    async def Stats(self, request: pb.TransferStatsRequest,
                    context: grpc.aio.ServicerContext) -> pb.TransferStatsResponse:
        return pb.TransferStatsResponse(copy_loop="native" if blockcopy.NATIVE else "python",
                                        copy_threads=self.copier.threads, **self.figures())

    def figures(self) -> dict[str, int]:
        """What is open now and the counters since start, by their Stats names (read on the event loop:
        Stats and the metrics scrape both read them here)."""
        c = self.table.counters
        return {"sessions": len(self.table.sessions), "regions": self.table.mapped_regions(),
                "mapped_bytes": self.table.mapped_bytes(), "read_batches": c.read_batches,
                "write_batches": c.write_batches, "descriptors_done": c.descriptors_done,
                "descriptors_missing": c.descriptors_missing, "descriptors_failed": c.descriptors_failed,
                "bytes_moved": c.bytes_moved, "refresh_failures": c.refresh_failures,
                "descriptors_in_flight": self.table.load.descriptors_in_flight,
                "rings": sum(1 for s in self.table.sessions.values() if s.ring is not None),
                "ring_requests": c.ring_requests, "bulk_sessions": len(self.bulk.segments),
                "bulk_fetches": self.bulk.fetches, "bulk_staged": self.bulk.staged,
                "bulk_lanes": sum(len(lanes.lanes) for lanes in self.bulk.segments.values())}

    # -- batches -------------------------------------------------------------

    def _checked_all(self, session: Session, request: pb.SubmitManyRequest) -> list[Callable[[], Transfer]]:
        """Check every batch of a SubmitMany (on a worker thread); one bad batch refuses them all."""
        starts = []
        for i, batch in enumerate(request.batches):
            try:
                starts.append(self._checked(session, batch))
            except KVStoreError as exc:
                raise type(exc)(f"batch {i}: {exc.message}; no batch was started", hint=exc.hint) from None
        return starts

    def _checked(self, session: Session, request: pb.SubmitRequest, *, inline: bool = False
                 ) -> Callable[[], Transfer]:
        """Check a batch as a whole and return what starts it (`inline`: see `Copier.copy`).

        Raises:
            PermissionDenied: a write from a token without the "write" right.
            InvalidArgument: a bad descriptor count, op or (writes) chain. A bad
                descriptor does not raise: it fails alone once the batch runs.
        """
        n = _count(request)
        if not 1 <= n <= self.settings.max_descriptors:
            raise InvalidArgument(f"a batch holds 1 to {self.settings.max_descriptors} descriptors; got {n}")
        layout = self.layouts[session.geometry]
        if request.op == pb.TRANSFER_OP_READ:
            groups = _groups(request)
            return lambda: self._start_read(session, layout, groups, n, request.prefix_only, inline)
        if request.op == pb.TRANSFER_OP_WRITE:
            require(WRITE)  # the interceptor checked "read", what every Transfer call needs
            groups = _groups(request)
            plan = self._write_plan(layout, n, request)
            return lambda: self._start_write(session, layout, groups, n, plan)
        raise InvalidArgument("op must be TRANSFER_OP_READ or TRANSFER_OP_WRITE")

    def _start_read(self, session: Session, layout: Layout, groups: list[DescriptorGroup], n: int,
                    prefix_only: bool, inline: bool = False) -> Transfer:
        transfer = session.new_transfer(frozenset(g.region_id for g in groups), n)
        batch = read_batch(self.table, session, groups, layout.block_bytes, transfer.results, prefix_only)
        transfer.task = asyncio.create_task(
            run_read(self.tier, session, transfer, batch, self.settings.chunk_descriptors, self.copier,
                     hit_stats=self.hits, inline=inline))
        return transfer

    def _write_plan(self, layout: Layout, n: int, request: pb.SubmitRequest) -> validate.PutPlan:
        # The chain's shape is the batch's, checked whole before anything runs.
        # Block sizes are checked per group (resolve_spans), so one shared
        # block-sized stand-in lets put_plan check the counts without copying.
        stand_in = bytes(layout.block_bytes)
        return validate.put_plan(layout, parent_hash=request.parent_hash, token_ids=request.token_ids,
                                 extra_keys=list(request.extra_keys), blocks=[stand_in] * n,
                                 limit=self.settings.max_descriptors)

    def _start_write(self, session: Session, layout: Layout, groups: list[DescriptorGroup], n: int,
                     plan: validate.PutPlan) -> Transfer:
        transfer = session.new_transfer(frozenset(g.region_id for g in groups), n, writes=True)
        checked = resolve_spans(self.table, session, groups, Op.WRITE, layout.block_bytes, transfer.results)
        spans = checked.cut(0, len(checked))
        transfer.task = asyncio.create_task(
            run_write(self.tier, session, transfer, plan, spans, self.tier.settings.max_batch_blocks))
        return transfer


def _map_here(shm_name: str, map_it: Callable[[], T]) -> tuple[T | None, str]:
    """What `map_it` mapped, or None and why the client's memfd cannot be seen from here.

    Not seeing it is no error: the client is on another host (or in another pid
    namespace, or another user's) and streams instead. Any other OS failure is
    the request's fault: INVALID_ARGUMENT.
    """
    try:
        return map_it(), ""
    except (FileNotFoundError, PermissionError) as exc:
        return None, f"cannot map {shm_name} here: {exc.strerror or exc}"
    except KVStoreError:
        raise
    except OSError as exc:
        raise InvalidArgument(f"cannot map {shm_name}: {exc}") from None
