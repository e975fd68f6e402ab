"""The SwaPool gRPC service: wire messages in, checked snapshots to the SWA cache, wire messages out."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import grpc

from gateway import validate
from gateway.auth import current_caller
from gateway.hit_stats import HitStats
from gateway.policies import PolicyTable
from gateway.quotas import RequestRate
from gateway.status import unary
from gateway.swa_reports import REPORT_ID_BYTES, SeenReports
from gateway.trace_recorder import NO_TRACE, CallTrace
from gateway.validate import Layout
from kvstore.api_tokens import ADMIN, WRITE
from kvstore.clock import SystemClock
from kvstore.errors import FailedPrecondition, InvalidArgument, Unavailable
from kvstore.prefix import HASH_BYTES, BlockScope, namespace_id
from kvstore.swa_snapshot import HEADER_BYTES, checksum, snapshot_bytes, snapshot_shape
from kvstore.v1 import swa_pb2 as pb
from kvstore.v1 import swa_pb2_grpc as pb_grpc
from tiers.swa_cache import Found, SnapshotItem, SwaCache
from tiers.swa_memory import MemoryPool
from tiers.swa_shm_server import ShmGrant, host_id

#: Most direct get calls one ReportDirect may carry (the client reports sooner).
MAX_REPORTED_GETS = 4096
#: Bounds on the direct calls one ReportDirect carries for the trace (kvstore.client.swa_report cuts to them):
#: calls, keys in all, and keys of one call (its count says how many more it had).
MAX_REPORTED_CALLS = 1024
MAX_REPORTED_KEYS = 4096
MAX_CALL_KEYS = 64


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


def check_calls(calls: Sequence[pb.SwaDirectCall]) -> None:
    """Raise InvalidArgument unless the reported direct calls are within the bounds and each is whole: a time,
    32-byte keys, no more keys than snapshots and no more found than snapshots."""
    if len(calls) > MAX_REPORTED_CALLS:
        raise InvalidArgument(f"calls has {len(calls)} entries; report at most {MAX_REPORTED_CALLS} per call")
    keys = 0
    for i, c in enumerate(calls):
        n = len(c.keys)
        keys += n
        if not math.isfinite(c.time_s) or c.time_s <= 0:
            raise InvalidArgument(f"calls[{i}].time_s is {c.time_s}: send the call's time (Unix seconds)")
        if n > MAX_CALL_KEYS or n > c.snapshots or c.found > c.snapshots:
            raise InvalidArgument(f"calls[{i}] has {n} keys, {c.snapshots} snapshots, {c.found} found: "
                                  f"keys <= {MAX_CALL_KEYS}, keys <= snapshots and found <= snapshots")
        if any(len(k) != HASH_BYTES for k in c.keys):
            raise InvalidArgument(f"calls[{i}].keys: each snapshot key is {HASH_BYTES} bytes")
    if keys > MAX_REPORTED_KEYS:
        raise InvalidArgument(f"calls carry {keys} keys; report at most {MAX_REPORTED_KEYS} per call")


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
        policies: the tenants' policies (their SWA TTL and byte quota bound the direct path); None: the defaults.
    """

    #: Told of each Put and Get (`[trace]`, gateway/trace_recorder.py).
    trace: CallTrace = NO_TRACE

    def __init__(self, cache: SwaCache, layouts: dict[str, Layout], max_batch_snapshots: int,
                 hits: HitStats | None = None, policies: PolicyTable | None = None) -> None:
        self.cache = cache
        self.layouts = layouts
        self.max_batch = max_batch_snapshots
        self.hits = hits
        self.policies = policies
        #: Report ids counted lately: a report sent again is counted once.
        self.seen_reports = SeenReports()
        # The shared-memory path's requests bypass the interceptors: its own buckets, sized by the same policies.
        self._rate = RequestRate(policies, SystemClock()) if policies is not None else None

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
        self.trace.swa_put(scope, [s.key for s in request.snapshots], stored=len(items) if stored else 0)
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
        self.trace.swa_get(scope, keys, found=sum(f is not None for f in found))
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

    # -- the direct path (docs/SWA_POOL.md "Direct path") --------------------

    @unary
    async def OpenDirect(self, request: pb.SwaOpenDirectRequest,
                         context: grpc.aio.ServicerContext) -> pb.SwaOpenDirectResponse:
        # The tenant is the token's: an empty namespace is the caller's own, never a request field.
        layout, scope = self._scope(request.geometry, "")
        caller = current_caller()
        ttl_s, quota = self.cache.ttl_s, 0
        if self.policies is not None:
            policy = self.policies.policy(scope.namespace)
            ttl_s, quota = min(policy.swa_ttl_s, ttl_s), policy.swa_quota_bytes
        # A byte quota is kept by the gateway's ledger, which a direct SET would bypass: such a
        # tenant reads directly and writes through the gateway.
        writable = WRITE in caller.rights and not quota
        if isinstance(self.cache.pool, MemoryPool):
            return self._open_shm(self.cache.pool, layout, scope, writable=writable, ttl_s=ttl_s)
        try:
            grant = await self.cache.open_direct(scope.namespace, writable=writable)
        except (FailedPrecondition, Unavailable) as exc:
            return pb.SwaOpenDirectResponse(offered=False, reason=exc.message)
        user = grant.user
        largest = snapshot_bytes(layout.geometry, snapshot_shape(layout.geometry).window | 1)
        return pb.SwaOpenDirectResponse(
            offered=True, redis_url=grant.redis_url, username=user.username, password=user.password,
            tenant=scope.namespace, cluster_nodes=grant.cluster_nodes, key_prefix=grant.key_prefix,
            ttl_ms=max(int(ttl_s * 1000), 1), writable=user.writable, max_record_bytes=HEADER_BYTES + largest,
            expires_in_ms=int(grant.expires_in_s * 1000), renew_after_ms=int(grant.renew_in_s * 1000),
            trace_calls=self.trace.enabled)  # the shared-memory path's calls the server traces itself

    def _open_shm(self, pool: MemoryPool, layout: Layout, scope: BlockScope, *, writable: bool,
                  ttl_s: float) -> pb.SwaOpenDirectResponse:
        """A ticket for the shared-memory path of the embedded pool (tiers.swa_shm_server)."""
        if not pool.shm_enabled:
            return pb.SwaOpenDirectResponse(offered=False, reason="swa.direct is false: no shared-memory path")
        server = pool.shm_server(self)
        lifetime_s = pool.session_lifetime_s
        grant = ShmGrant(tenant=scope.namespace, tenant_id=namespace_id(scope.namespace),
                         fingerprint=scope.fingerprint, geometry=layout.geometry, writable=writable, ttl_s=ttl_s,
                         max_batch=self.max_batch, expires_s=pool.clock.monotonic() + lifetime_s)
        largest = snapshot_bytes(layout.geometry, snapshot_shape(layout.geometry).window | 1)
        return pb.SwaOpenDirectResponse(
            offered=True, tenant=scope.namespace, shm_socket=server.name, shm_ticket=server.grant(grant),
            shm_host=host_id(), ttl_ms=max(int(ttl_s * 1000), 1), writable=writable,
            max_record_bytes=HEADER_BYTES + largest, expires_in_ms=int(lifetime_s * 1000),
            renew_after_ms=int(lifetime_s * 500))

    # -- tiers.swa_shm_server.ShmHooks: the shared-memory path's quotas, counters and trace (its threads call them) --

    def admit(self, tenant: str) -> None:
        """Spend one request of `tenant`'s rate (ResourceExhausted when over it)."""
        if self._rate is not None:
            self._rate.take(tenant)

    def got(self, grant: ShmGrant, keys: Sequence[bytes], found: int, corrupt: int) -> None:
        """Count and trace one shared-memory get as a gateway Get is counted and traced."""
        if self.hits is not None:
            self.hits.record(grant.tenant, "swa", len(keys), found)
        self.cache.count_direct(gets=1, snapshots_asked=len(keys), hits=found, corrupt=corrupt)
        if self.trace.enabled:
            self.trace.swa_get(BlockScope(grant.fingerprint, grant.tenant), keys, found=found, via="shm")

    def put(self, grant: ShmGrant, keys: Sequence[bytes], stored: int, nbytes: int) -> None:
        """Count and trace one shared-memory put as a gateway Put is counted and traced."""
        self.cache.count_direct(puts=1, snapshots_put=stored, bytes_put=nbytes)
        if self.trace.enabled:
            self.trace.swa_put(BlockScope(grant.fingerprint, grant.tenant), keys, stored=stored, via="shm")

    @unary
    async def ReportDirect(self, request: pb.SwaReportDirectRequest,
                           context: grpc.aio.ServicerContext) -> pb.SwaReportDirectResponse:
        # The tenant is the caller's (never a request field); the geometry names the calls' records.
        _, scope = self._scope(request.geometry, "")
        gets = list(request.gets)
        if len(gets) > MAX_REPORTED_GETS:
            raise InvalidArgument(f"gets has {len(gets)} entries; report at most {MAX_REPORTED_GETS} per call")
        for i, g in enumerate(gets):
            if g.asked > self.max_batch or g.found + g.corrupt > g.asked:
                raise InvalidArgument(f"gets[{i}] asked {g.asked}, found {g.found}, corrupt {g.corrupt}: "
                                      f"found + corrupt <= asked <= {self.max_batch} (max_batch_snapshots)")
        check_calls(request.calls)
        if request.report_id and len(request.report_id) != REPORT_ID_BYTES:
            raise InvalidArgument(f"report_id is {len(request.report_id)} bytes; it must be {REPORT_ID_BYTES} "
                                  "random bytes, or empty")
        if request.report_id and not self.seen_reports.first(scope.namespace, request.report_id):
            return pb.SwaReportDirectResponse()  # counted when it first came (the client lost that answer)
        if self.hits is not None:
            for g in gets:
                self.hits.record(scope.namespace, "swa", g.asked, g.found)
        self.cache.count_direct(gets=len(gets), snapshots_asked=sum(g.asked for g in gets),
                                hits=sum(g.found for g in gets), corrupt=sum(g.corrupt for g in gets),
                                puts=request.puts, snapshots_put=request.snapshots_put, bytes_put=request.bytes_put)
        if self.trace.enabled:
            self._trace_direct(scope, request)
        return pb.SwaReportDirectResponse()

    def _trace_direct(self, scope: BlockScope, request: pb.SwaReportDirectRequest) -> None:
        """One trace record per reported direct call (via "redis-direct", at the client's time)."""
        for c in request.calls:
            keys = list(c.keys)
            if c.put:
                self.trace.swa_put(scope, keys, stored=c.found, via="redis-direct", t=c.time_s, snapshots=c.snapshots)
            else:
                self.trace.swa_get(scope, keys, found=c.found, via="redis-direct", t=c.time_s, snapshots=c.snapshots)
        if request.calls_dropped:
            self.trace.count_dropped(request.calls_dropped)
