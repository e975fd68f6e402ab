"""The SwaPool gRPC service: wire messages in, checked snapshots to the SWA cache, wire messages out."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from gateway import validate
from gateway.auth import current_caller
from gateway.hit_stats import HitStats
from gateway.status import unary
from gateway.validate import Layout
from kvstore.api_tokens import ADMIN
from kvstore.errors import InvalidArgument
from kvstore.prefix import BlockScope
from kvstore.swa_snapshot import checksum, snapshot_bytes, snapshot_shape
from kvstore.v1 import swa_pb2 as pb
from kvstore.v1 import swa_pb2_grpc as pb_grpc
from tiers.swa_cache import Found, SnapshotItem, SwaCache


def check_keys(keys: list[bytes], *, limit: int, field: str = "keys") -> list[bytes]:
    """A non-empty batch of 32-byte snapshot keys, at most `limit` long."""
    return validate.hashes(keys, limit=limit, field=field)


def check_snapshot(index: int, snap: pb.SwaSnapshot, data: bytes, layout: Layout) -> None:
    """Raise InvalidArgument unless `snap` (whose `data` the caller read once) has a
    position T, the size of a snapshot at T, and a matching checksum."""
    geometry = layout.geometry
    if snap.position < 1:
        raise InvalidArgument(f"snapshots[{index}].position is {snap.position}: send T, the prompt length "
                              "the snapshot was taken at (at least 1)")
    expected = snapshot_bytes(geometry, snap.position)
    if len(data) != expected:
        shape = snapshot_shape(geometry)
        t = snap.position
        tail = (f" + the raw tail of {len(shape.ratio2_layers)} ratio-2 layers ({shape.tail_bytes} B, T is odd)"
                if t % 2 else " (T is even: no tail)")
        raise InvalidArgument(
            f"snapshots[{index}] is {len(data)} bytes; a {geometry.name} SWA snapshot at T = {t} is {expected} "
            f"bytes: {shape.layers} layers x {shape.window_positions(t)} window rows of {shape.row_bytes} B"
            f"{tail} (kvstore.swa_snapshot.snapshot_bytes)")
    if checksum(data) != snap.checksum:
        raise InvalidArgument(f"snapshots[{index}] checksum {snap.checksum:#x} does not match its data "
                              "(xxh3-64): corrupted in transit or computed over other bytes")


def _get_reply(found: Sequence[Found | None]) -> pb.SwaGetResponse:
    reply = pb.SwaGetResponse()
    for f in found:
        # Filled in place: a result built apart is copied again into the reply.
        result = reply.results.add()
        if f is None:
            result.status = pb.SWA_STATUS_MISSING
        else:
            result.status, result.data, result.checksum = pb.SWA_STATUS_FOUND, f.data, f.checksum
            result.position = f.position
    return reply


class SwaPoolServicer(pb_grpc.SwaPoolServicer):
    """Serves SWA snapshots of the registered geometries from one SWA cache.

    Args:
        cache: the checked, counted cache over the configured pool backend.
        layouts: served geometries by name, the default first.
        max_batch_snapshots: most snapshots in one call.
        hits: the hit counters per tenant over time, shared with the KVStore service (None: not counted).
    """

    def __init__(self, cache: SwaCache, layouts: dict[str, Layout], max_batch_snapshots: int,
                 hits: HitStats | None = None) -> None:
        self.cache = cache
        self.layouts = layouts
        self.max_batch = max_batch_snapshots
        self.hits = hits

    def _scope(self, geometry: str, namespace: str) -> tuple[Layout, BlockScope]:
        return validate.scope(self.layouts, geometry, namespace)

    @unary
    async def Put(self, request: pb.SwaPutRequest, context: grpc.aio.ServicerContext) -> pb.SwaPutResponse:
        layout, scope = self._scope(request.geometry, request.namespace)
        # Checksumming every snapshot is O(request size): a thread keeps other calls served meanwhile.
        items = await asyncio.to_thread(self._checked_items, request, layout, scope)
        ttl_s = request.ttl_ms / 1000.0 if request.ttl_ms else None
        stored = await self.cache.put_many(scope.fingerprint, items, ttl_s)
        applied_s = min(ttl_s, self.cache.ttl_s) if ttl_s else self.cache.ttl_s
        return pb.SwaPutResponse(stored=len(items) if stored else 0, failed=0 if stored else len(items),
                                 ttl_ms=int(applied_s * 1000))

    def _checked_items(self, request: pb.SwaPutRequest, layout: Layout,
                       scope: BlockScope) -> list[SnapshotItem]:
        """Every snapshot of a Put with its storage key, each checked first."""
        snaps = list(request.snapshots)
        if not snaps:
            raise InvalidArgument("snapshots is empty: a Put stores at least one snapshot")
        check_keys([s.key for s in snaps], limit=self.max_batch, field="snapshots.key")
        # Each read of a bytes field copies it out of the message: read each once.
        datas = [s.data for s in snaps]
        for i, (snap, data) in enumerate(zip(snaps, datas, strict=True)):
            check_snapshot(i, snap, data, layout)
        return [SnapshotItem(key=scope.key(s.key), position=s.position, data=d, checksum=s.checksum)
                for s, d in zip(snaps, datas, strict=True)]

    @unary
    async def Get(self, request: pb.SwaGetRequest, context: grpc.aio.ServicerContext) -> pb.SwaGetResponse:
        layout, scope = self._scope(request.geometry, request.namespace)
        keys = check_keys(list(request.keys), limit=self.max_batch)
        found = await self.cache.get_many(layout.geometry, [scope.key(k) for k in keys])
        if self.hits is not None:
            self.hits.record(scope.namespace, "swa", len(keys), sum(f is not None for f in found))
        # Copying the snapshots into the reply is O(reply size): off the event loop.
        return await asyncio.to_thread(_get_reply, found)

    @unary
    async def Delete(self, request: pb.SwaDeleteRequest, context: grpc.aio.ServicerContext) -> pb.SwaDeleteResponse:
        _, scope = self._scope(request.geometry, request.namespace)
        keys = check_keys(list(request.keys), limit=self.max_batch)
        return pb.SwaDeleteResponse(deleted=await self.cache.delete_many([scope.key(k) for k in keys]))

    @unary
    async def Stats(self, request: pb.SwaStatsRequest, context: grpc.aio.ServicerContext) -> pb.SwaStatsResponse:
        s = await self.cache.stats()
        c, u = s.counters, s.usage
        if ADMIN not in current_caller().rights:
            # The pool's counters span every tenant: a tenant gets the pool's settings only
            # (the client sizes its batches by max_batch_snapshots), never others' traffic.
            return pb.SwaStatsResponse(backend=s.backend, backend_up=u is not None, ttl_s=s.ttl_s,
                                       max_batch_snapshots=self.max_batch)
        return pb.SwaStatsResponse(
            backend=s.backend, backend_up=u is not None, ttl_s=s.ttl_s, puts=c.puts, snapshots_put=c.snapshots_put,
            bytes_put=c.bytes_put, failed_puts=c.failed_puts, gets=c.gets, snapshots_asked=c.snapshots_asked,
            hits=c.hits, corrupt=c.corrupt, backend_errors=c.backend_errors,
            expirations=u.expirations if u else 0, evictions=u.evictions if u else 0, items=u.items if u else 0,
            bytes_used=u.bytes_used if u else 0, cap_bytes=u.cap_bytes if u else 0,
            max_batch_snapshots=self.max_batch)
