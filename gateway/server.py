"""The kvstore server process: one grpc.aio server with the KVStore, SwaPool and
Transfer services, the standard health service and server reflection on one port.

Interceptors, outermost first: auth (gateway.auth: the caller from its token,
the method's right), then undecodable requests (gateway.undecodable: every
method answers bytes it cannot decode with INVALID_ARGUMENT, never UNKNOWN).
The port speaks TLS (mutual with `tls.client_ca_file`) when `tls.cert_file` is
set; a bind beyond loopback without tokens and TLS is refused unless
`auth.insecure`, and so is the plain-HTTP metrics endpoint beyond loopback unless
`metrics.insecure` (docs/SECURITY.md)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from gateway import put_request
from gateway.admin_servicer import AdminParts, add_admin_service, open_admin
from gateway.auth import (
    DEFAULT_TENANT,
    METHOD_RIGHTS,
    OPEN,
    AuthInterceptor,
    check_bind,
    check_metrics_bind,
    is_loopback,
    open_caller,
)
from gateway.events import EventsCollector, check_events_bind, start_events
from gateway.fleet_servicer import METHODS as FLEET_METHODS
from gateway.fleet_servicer import add_fleet_service
from gateway.grpc_log import quiet_cancelled_replies
from gateway.grpc_server import new_server
from gateway.hit_stats import HitStats
from gateway.kvstore_servicer import KVStoreServicer
from gateway.metrics import MetricsEndpoint, MetricsInterceptor, ServerMetrics, start_endpoint
from gateway.metrics_tenants import TenantsFileCollector
from gateway.replies import add_service
from gateway.request_log import RequestLog
from gateway.startup_heap import freeze_startup_heap
from gateway.swa_servicer import SwaPoolServicer
from gateway.tenants import TenantRegistry, TokenTable
from gateway.trace_recorder import NO_TRACE, CallTrace, TraceCollector, open_recorder, trace_line
from gateway.transfer_servicer import TransferServicer
from gateway.undecodable import UndecodableRequests
from gateway.validate import Layout
from kvstore import geometry
from kvstore.clock import Clock, SystemClock
from kvstore.config import Settings, TlsSettings
from kvstore.counted import counted
from kvstore.errors import ConfigError
from kvstore.native import blockcopy
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc, swa_pb2, swa_pb2_grpc, transfer_pb2, transfer_pb2_grpc
from tiers import allocator
from tiers.lmdb_tier import LmdbBlockTier
from tiers.swa_cache import SwaCache
from tiers.swa_pool import open_pool

if TYPE_CHECKING:
    from gateway.fleet_repair import FleetRepairer
    from kvstore.fleet.membership import Registration

#: How long a fleet node keeps serving after it left the membership, before it refuses new calls.
LEAVE_DRAIN_S = 1.0

log = logging.getLogger("kvstore.server")
SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name
SWA_SERVICE_NAME = swa_pb2.DESCRIPTOR.services_by_name["SwaPool"].full_name


@dataclass
class RunningServer:
    """A started server: its port, its gRPC server and the tier it owns."""

    port: int
    server: grpc.aio.Server
    tier: LmdbBlockTier
    health: health_aio.HealthServicer
    #: The tenants' tokens this server checks: the tenants file (`tenants.refresh()` re-reads it now), or
    #: etcd's table in a fleet (gateway.shared_tables).
    tenants: TokenTable
    #: Its Prometheus series, and the HTTP endpoint serving them (None: [metrics] port = 0).
    metrics: ServerMetrics
    metrics_endpoint: MetricsEndpoint | None
    #: Called after the gRPC server stops, last first: each service's clean-up.
    closers: list[Callable[[], Any]] = field(default_factory=list)
    #: Its registration in the fleet's etcd (None: [fleet] etcd unset, a single node).
    fleet: Registration | None = None
    #: Its re-replication (None: a single node; docs/FLEET.md F18).
    repair: FleetRepairer | None = None
    #: What `kvstore serve` says of its KV cache events (docs/EVENTS.md).
    events_line: str = ""
    #: Its own access trace (`[trace]`; NO_TRACE while off).
    trace: CallTrace = NO_TRACE
    stopped: bool = False

    @property
    def target(self) -> str:
        """Where clients on this host reach it."""
        return f"127.0.0.1:{self.port}"

    async def stop(self, grace_s: float) -> None:
        """Stop taking calls, let in-flight ones finish for `grace_s`, then close the tier.

        Every Put acknowledged before this returns was committed (fsync) before
        its answer went out, so nothing acknowledged is lost.
        """
        if self.stopped:
            return
        self.stopped = True
        if self.repair is not None:  # no copies started while leaving
            await self.repair.stop()
        if self.fleet is not None:  # leave the fleet first, so clients route elsewhere while calls drain
            await self.fleet.stop()
            # Keep answering a moment after leaving: a client's view learns of the leave through etcd's
            # watch, and a call it placed just before must find the node serving, not refusing (F43).
            await asyncio.sleep(min(LEAVE_DRAIN_S, grace_s))
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        await _close(self.closers)
        self.tier.close()


async def start(settings: Settings, *, clock: Clock | None = None) -> RunningServer:
    """Open the store, the SWA pool and the transfer sessions, and serve on `settings.server.host:port`.

    Raises:
        ConfigError: a bind beyond loopback without tokens and TLS (and not `auth.insecure`), the
            metrics endpoint beyond loopback (and not `metrics.insecure` nor `auth.insecure`),
            an unreadable tenants file or certificate.
        OSError: the address cannot be bound (everything opened so far is closed).
    """
    host = settings.server.host
    tenants = await _open_tenants(settings, clock)
    try:
        check_bind(host, auth=tenants.enabled, tls=settings.tls.enabled, insecure=settings.auth.insecure)
        check_metrics_bind(settings.metrics.host, settings.metrics.port,
                           insecure=settings.metrics.insecure or settings.auth.insecure)
        check_events_bind(settings.events, insecure=settings.auth.insecure)
        credentials = _server_credentials(settings.tls) if settings.tls.enabled else None
    except BaseException:
        await tenants.stop()
        raise
    quiet_cancelled_replies()  # a client's cancel is normal: one debug line, not grpc's ERROR and traceback
    metrics = ServerMetrics(tenant_labels_cap=settings.metrics.tenant_labels)
    metrics.known_tenants = lambda: tenants.tenants  # per-tenant series for every tenant with a token
    #: The fleet's tables in etcd by name, for their metrics (the policies' joins in _assemble).
    shared: dict[str, Any] = {}
    if isinstance(tenants, TenantRegistry):
        metrics.registry.register(TenantsFileCollector(tenants.status))
    else:
        _watch_shared_tables(metrics, tenants, shared)
    # Outermost first: metrics see every call, those auth refuses too (counted and logged).
    # The Fleet service checks the fleet's token itself (gateway.fleet_servicer, docs/FLEET.md F20).
    rights = {**METHOD_RIGHTS, **dict.fromkeys(FLEET_METHODS, OPEN)}
    interceptors = [MetricsInterceptor(metrics, RequestLog()), AuthInterceptor(tenants, open_caller(host), rights),
                    UndecodableRequests()]
    tier = LmdbBlockTier(settings.store, clock=clock)
    closers: list[Callable[[], Any]] = [tenants.stop]
    try:
        events_line = start_events(settings.events, tier)  # before the first write the events must cover (E1)
        metrics.registry.register(EventsCollector(tier))
        trace = await _start_trace(settings, tier, closers, clock or SystemClock())
        metrics.registry.register(TraceCollector(trace))
        opened: dict[str, Any] = {}
        server, health = await _assemble(settings, tier, closers, clock or SystemClock(), interceptors, metrics,
                                         shared, trace=trace, opened=opened)
        token = None
        if settings.fleet.enabled:  # the run index and the Fleet service, before the first Put (F16, F20)
            token = add_fleet_service(server, settings, tier, auth_on=lambda: tenants.enabled,
                                      audit=opened["admin"].audit,  # copied pins' grants audited (R31)
                                      closers=closers,  # its planning threads joined before the store closes
                                      retention_of=opened["admin"].policies.retention_of_key)  # F19: the tenant's
        address = f"{host}:{settings.server.port}"
        try:
            port = (server.add_secure_port(address, credentials) if credentials is not None
                    else server.add_insecure_port(address))
        except RuntimeError as exc:  # newer grpcio raises instead of returning 0
            raise OSError(f"cannot listen on {address}: {exc}") from None
        if port == 0:
            raise OSError(f"cannot listen on {address}")
        await server.start()
        repair = None
        try:
            fleet = await _join_fleet(settings, port)  # after the bind: the record names a port that answers
            if fleet is not None:
                from gateway.fleet_repair import start_repair  # a single node never loads aetcd
                repair = await start_repair(settings, tier, fleet, token)
                repair.copies = opened["admin"].policies.replication_of_key  # each tenant's replication (F51)
                repair.retention_of = opened["admin"].policies.retention_of_key  # each tenant's retention (F19)
                from gateway.metrics_fleet import FleetNodeCollector

                metrics.registry.register(FleetNodeCollector(fleet, repair))  # kvstore_fleet_* (docs/METRICS.md)
            # Inside this try: a metrics port in use must not leave the gRPC server running and the node
            # registered in etcd until its lease ends.
            endpoint = start_endpoint(settings.metrics, metrics.registry)
        except BaseException:
            if repair is not None:
                await repair.stop()
            if "fleet" in locals() and fleet is not None:
                await fleet.stop()
            await server.stop(0)
            raise
        tenants.start(settings.auth.reload_s)
        if endpoint is not None:
            closers.append(endpoint.close)
    except BaseException:
        await _close(closers)
        tier.close()
        raise
    return RunningServer(port=port, server=server, tier=tier, health=health, tenants=tenants, metrics=metrics,
                         metrics_endpoint=endpoint, closers=closers, fleet=fleet, repair=repair,
                         events_line=events_line, trace=trace)


async def _start_trace(settings: Settings, tier: LmdbBlockTier, closers: list[Callable[[], Any]],
                       clock: Clock) -> CallTrace:
    """The server's access trace, writing when `[trace] enabled` (gateway/trace_recorder.py), else NO_TRACE."""
    from tiers.datadir import node_id

    recorder = open_recorder(settings.trace, data_dir=settings.store.data_dir,
                             block_tokens=settings.store.block_tokens, node=node_id(settings.store.data_dir),
                             clock=clock, geometries={g.fingerprint: g.name for g in geometry.REGISTRY.values()})
    if recorder is None:
        return NO_TRACE
    await recorder.start()
    closers.append(recorder.close)
    return recorder


async def _open_tenants(settings: Settings, clock: Clock | None) -> TokenTable:
    """The tenants' tokens: the tenants file, or etcd's table in a fleet (docs/FLEET.md, "Shared tables").

    Raises:
        ConfigError: the tenants file is damaged (or, in a fleet, lies beside etcd's table).
        Unavailable: in a fleet, etcd does not answer: the node does not start (F14).
    """
    if settings.fleet.enabled:
        from gateway.shared_tables import open_fleet_tenants  # a single node never loads aetcd

        return await open_fleet_tenants(settings)
    return TenantRegistry(settings.auth.tenants_path(settings.store.data_dir), required=settings.auth.required,
                          clock=clock)


async def _open_admin(settings: Settings, clock: Clock) -> AdminParts:
    """Policies and the audit log: the data dir's files, or etcd's shared tables in a fleet."""
    if settings.fleet.enabled:
        from gateway.shared_tables import open_fleet_admin

        return await open_fleet_admin(settings, clock=clock)
    return open_admin(settings, clock=clock)


def _watch_shared_tables(metrics: ServerMetrics, tenants: TokenTable, shared: dict[str, Any]) -> None:
    """Serve how the fleet's shared tables in `shared` follow etcd (the policies' joins once it is open)."""
    from gateway.shared_tables import EtcdTenants, SharedTablesCollector

    if isinstance(tenants, EtcdTenants):
        shared["tenants"] = tenants.table
    metrics.registry.register(SharedTablesCollector(lambda: dict(shared)))


async def _join_fleet(settings: Settings, port: int) -> Registration | None:
    """Register this node in etcd when `[fleet] etcd` is set (docs/FLEET.md); None for a single node.

    Raises:
        Unavailable: etcd does not answer: the node does not start (F14).
    """
    if not settings.fleet.enabled:
        return None
    from kvstore.fleet.membership import advertised_address, register_node  # a single node never loads aetcd
    from kvstore.fleet.swa_pool import pool_name
    from tiers.datadir import node_id

    return await register_node(settings.fleet, node_id=node_id(settings.store.data_dir),
                               address=advertised_address(settings.fleet, settings.server.host, port),
                               capacity_bytes=settings.store.capacity_bytes,
                               block_tokens=settings.store.block_tokens, swa_pool=pool_name(settings.swa),
                               data_dir=str(settings.store.data_dir.resolve()))


def _server_credentials(tls: TlsSettings) -> grpc.ServerCredentials:
    """TLS credentials from the PEM files `tls` names; a client certificate is demanded with a client CA.

    Raises:
        ConfigError: a file cannot be read.
    """
    def read(name: str, path: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise ConfigError(f"cannot read tls.{name} {path}: {exc.strerror or exc}") from None

    client_ca = read("client_ca_file", tls.client_ca_file) if tls.client_ca_file else None
    return grpc.ssl_server_credentials([(read("key_file", tls.key_file), read("cert_file", tls.cert_file))],
                                       root_certificates=client_ca, require_client_auth=client_ca is not None)


async def _assemble(settings: Settings, tier: LmdbBlockTier, closers: list[Callable[[], Any]],
                    clock: Clock, interceptors: list[grpc.aio.ServerInterceptor], metrics: ServerMetrics,
                    shared: dict[str, Any] | None = None, *, trace: CallTrace = NO_TRACE,
                    opened: dict[str, Any] | None = None) -> tuple[grpc.aio.Server, health_aio.HealthServicer]:
    """The gRPC server with every service on it; each service's clean-up goes to `closers`, the admin parts
    to `opened["admin"]`."""
    layouts = {g.name: Layout.of(g, settings.store.block_tokens) for g in geometry.REGISTRY.values()}
    limit = settings.server.max_message_bytes
    # Tenants' policies and the audit log; the quota interceptor goes innermost (it reads the
    # caller auth set and decoded requests).
    admin = await _open_admin(settings, clock)
    closers.append(admin.close)
    if opened is not None:
        opened["admin"] = admin
    table = getattr(admin.policies, "table", None)  # etcd's, in a fleet
    if shared is not None and table is not None:
        shared["policies"] = table
    server = new_server([*interceptors, admin.quotas], limit)
    swa = SwaCache(open_pool(settings.swa, clock=clock), ttl_s=settings.swa.ttl_s)
    closers.append(swa.close)
    hits = HitStats(settings.store.data_dir / "stats", clock, block_tokens=settings.store.block_tokens)
    closers.append(hits.close)
    kvstore = KVStoreServicer(tier, layouts, limit, swa, hits=hits, audit=admin.audit, policies=admin.policies)
    pin_audit = asyncio.create_task(kvstore.run_pin_audit())  # R29: expired pins audited
    closers.append(pin_audit.cancel)
    kvstore.trace = trace
    add_service(kvstore_pb2_grpc.add_KVStoreServicer_to_server, kvstore, server, presized={"Get"},
                decoders={"Put": put_request.decode, "PutStream": put_request.decode})  # blocks not copied
    swa_service = SwaPoolServicer(swa, layouts, settings.swa.max_batch_snapshots, hits=hits, policies=admin.policies)
    swa_service.trace = trace
    swa_pb2_grpc.add_SwaPoolServicer_to_server(swa_service, server)
    # The ring's requests bypass the interceptors: the servicer charges them to the tenant's request rate itself.
    transfer = TransferServicer(tier, layouts, settings.transfer, max_message_bytes=limit, hits=hits,
                                rate=admin.quotas.rate)
    closers.append(transfer.close)
    if kvstore.router is None:  # a node: puts over the TCP transport go through its PutStream stages
        transfer.tcp.puts.replies = kvstore.put_replies
        transfer.tcp.puts.plan = kvstore.plan_put  # each frame planned on its connection's thread
    add_service(transfer_pb2_grpc.add_TransferServicer_to_server, transfer, server, presized={"Fetch"})
    metrics.watch(tier, swa=swa, transfer=transfer, resume=kvstore.resume, hits=hits)
    services = [SERVICE_NAME, SWA_SERVICE_NAME, transfer_pb2.DESCRIPTOR.services_by_name["Transfer"].full_name]
    services.append(add_admin_service(server, admin, tier, layouts))
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for name in services:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    return server, health


async def _close(closers: list[Callable[[], Any]]) -> None:
    """Run clean-ups, last registered first; a clean-up may be a coroutine function."""
    for close in reversed(closers):
        result = close()
        if inspect.isawaitable(result):
            await result


async def serve(settings: Settings) -> None:
    """Run until SIGTERM or SIGINT, then shut down cleanly."""
    allocator.keep_freed_memory()  # a Put's buffers are reused, not faulted in again each batch (tiers/allocator.py)
    running = await start(settings)
    frozen = freeze_startup_heap()  # full collections under load walk only what start-up did not make
    print(f"kvstore listening on {settings.server.host}:{running.port}", flush=True)
    print(f"kvstore data in {settings.store.data_dir.resolve()} "
          f"(capacity {settings.store.capacity_bytes / 2**30:.1f} GiB, "
          f"retention {settings.store.retention_hours:g} h, {settings.store.block_tokens}-token blocks)",
          flush=True)
    print(f"kvstore SWA pool: {settings.swa.backend} (snapshots live {settings.swa.ttl_s:g} s)", flush=True)
    print(f"kvstore auth: {_auth_line(settings, running.tenants)}", flush=True)
    endpoint = running.metrics_endpoint
    print(f"kvstore metrics: {endpoint.url if endpoint else 'off ([metrics] port = 0)'}", flush=True)
    print(f"kvstore fleet: {_fleet_line(settings, running.fleet)}", flush=True)
    print(f"kvstore events: {running.events_line}", flush=True)
    print(f"kvstore trace: {trace_line(settings.trace, running.trace)}", flush=True)
    print(f"kvstore heap: {frozen:,} start-up objects frozen (gateway/startup_heap.py)", flush=True)
    if blockcopy.NATIVE:
        print(f"kvstore transfer copies: native, {counted(settings.transfer.copy_threads, 'thread')}", flush=True)
    else:
        print("kvstore transfer copies: Python loop, 1 thread (kvstore.native._blockcopy was not built: reinstall with "
              "a C compiler for parallel copies)", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("kvstore shutting down", file=sys.stderr, flush=True)
    await running.stop(settings.server.grace_s)
    if running.trace.enabled:
        t = running.trace.stats
        print(f"kvstore trace: {t.written_records:,} records written ({t.written_bytes:,} bytes), "
              f"{t.dropped_records:,} dropped", file=sys.stderr, flush=True)
    print("kvstore stopped", file=sys.stderr, flush=True)


def _fleet_line(settings: Settings, fleet: Registration | None) -> str:
    """What `kvstore serve` says of its fleet at start."""
    if fleet is None:
        return "off: a single node ([fleet] etcd unset)"
    return (f"node {fleet.record.node_id} of {settings.fleet.cluster!r} at {fleet.record.address}, "
            f"registered in etcd {settings.fleet.etcd} (lease {fleet.ttl_s} s)")


def _auth_line(settings: Settings, tenants: TokenTable) -> str:
    """What `kvstore serve` says of tokens and TLS at start."""
    if tenants.enabled:
        auth = f"tokens ({counted(len(tenants.tenants), 'tenant')} with active tokens, {tenants.describe()})"
    elif is_loopback(settings.server.host):
        auth = f"off: loopback only, one tenant {DEFAULT_TENANT!r} without a token"
    else:
        auth = f"OFF (--insecure): every caller is tenant {DEFAULT_TENANT!r}"
    tls = settings.tls
    return f"{auth}; TLS {'mutual' if tls.client_ca_file else 'on' if tls.enabled else 'off'}"
