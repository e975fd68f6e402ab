"""`kvstore gateway`: the KVStore API for clients that cannot route themselves, over a fleet's nodes.

A gateway holds no blocks and no state that outlives it (docs/FLEET.md, "Gateway"):
it follows the fleet's membership in etcd, checks callers' tokens against the
fleet's tenants in etcd (as a node does), and routes every Lookup, Put and Get
with the fleet client's own code (`gateway.fleet_store`), calling the nodes with
the caller's own token. Admin and the SWA pool are forwarded to the nodes, each
call as it came (`gateway.gateway_forward`, docs/FLEET.md F52), and Stats are
every node's merged (F53). Start two behind one address; kill one: nothing is
lost. What it does not serve (transfer sessions, a tenant's export and import)
answers FAILED_PRECONDITION naming where to go.

Examples:
  kvstore gateway --config /etc/kvstore/kvstore.toml              # [fleet] etcd = "10.0.0.5:2379,..."
  kvstore gateway --config kvstore.toml --host 0.0.0.0 --port 50051
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from gateway.auth import (
    METHOD_RIGHTS,
    AuthInterceptor,
    check_bind,
    check_metrics_bind,
    open_caller,
)
from gateway.fleet_store import FleetStore
from gateway.gateway_forward import Forwarder
from gateway.gateway_forward import close as close_forwarder
from gateway.grpc_log import quiet_cancelled_replies
from gateway.grpc_server import new_server
from gateway.hit_stats import HitStats
from gateway.kvstore_servicer import KVStoreServicer
from gateway.metrics import MetricsEndpoint, MetricsInterceptor, ServerMetrics, start_endpoint
from gateway.metrics_gateway import GatewayCollector
from gateway.replies import add_service
from gateway.request_log import RequestLog
from gateway.tenants import TokenTable
from gateway.undecodable import UndecodableRequests
from gateway.validate import Layout
from kvstore import geometry
from kvstore.client.connection import TlsOptions
from kvstore.clock import SystemClock
from kvstore.config import Settings
from kvstore.errors import ConfigError
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc, transfer_pb2

#: Services a gateway cannot serve, and where their calls go instead (F40); Admin and SwaPool are forwarded (F52).
ELSEWHERE: dict[str, str] = {
    transfer_pb2.DESCRIPTOR.services_by_name["Transfer"].full_name:
        "transfer sessions read a node's LMDB map (MappedReads)",
}
SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's flags; everything else comes from the TOML ([fleet] etcd is required)."""
    parser.add_argument("--host", help="address to bind (server.host; default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="TCP port (server.port; default 50051; 0 picks a free one)")
    parser.add_argument("--config", type=Path, help="TOML config file: [fleet] etcd and cluster (required), "
                        "[store] block_tokens as the nodes', [auth], [tls]")
    parser.add_argument("--tls-cert", help="gateway certificate chain, PEM (tls.cert_file; turns TLS on)")
    parser.add_argument("--tls-key", help="gateway private key, PEM (tls.key_file)")
    parser.add_argument("--insecure", action="store_true",
                        help="allow a bind beyond loopback without tokens and TLS (auth.insecure)")


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT.

    Raises:
        ConfigError: no [fleet] etcd, a bind the auth rules refuse, a block size unlike the fleet's.
        Unavailable: etcd does not answer, or the fleet has no node yet.
    """
    from kvstore.config import load_settings

    settings = load_settings(args.config, overrides={
        "server": {"port": args.port, "host": args.host},
        "auth": {"insecure": True if args.insecure else None},
        "tls": {"cert_file": args.tls_cert, "key_file": args.tls_key},
    })
    if not settings.fleet.enabled:
        raise ConfigError("kvstore gateway needs a fleet: set [fleet] etcd (and cluster) in --config",
                          hint='e.g. [fleet] etcd = "10.0.0.5:2379" cluster = "default"')
    from kvstore.cli import check_port_free

    check_port_free(settings.server.host, settings.server.port)
    asyncio.run(serve_gateway(settings))
    return 0


@dataclass
class RunningGateway:
    """A started gateway: its port, server, store and token table."""

    port: int
    server: grpc.aio.Server
    store: FleetStore
    health: health_aio.HealthServicer
    tenants: TokenTable
    closers: list[Callable[[], Any]] = field(default_factory=list)
    #: The Prometheus endpoint ([metrics] port; None: off).
    metrics_endpoint: MetricsEndpoint | None = None

    async def stop(self, grace_s: float) -> None:
        """Stop taking calls, let in-flight ones finish for `grace_s`, then close (nothing here is stored)."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        await asyncio.to_thread(self.store.close)
        await self.tenants.stop()
        for close in reversed(self.closers):
            result = close()
            if asyncio.iscoroutine(result):
                await result


async def start_gateway(settings: Settings) -> RunningGateway:
    """Open the fleet's tenants and membership, and serve the KVStore API on `settings.server`.

    Raises:
        ConfigError, Unavailable, OSError: as `run` says; everything opened so far is closed.
    """
    from gateway.shared_tables import open_fleet_tenants

    host = settings.server.host
    tenants: TokenTable = await open_fleet_tenants(settings)
    try:
        check_bind(host, auth=tenants.enabled, tls=settings.tls.enabled, insecure=settings.auth.insecure)
        check_metrics_bind(settings.metrics.host, settings.metrics.port,
                           insecure=settings.metrics.insecure or settings.auth.insecure)
        from gateway.server import _server_credentials

        credentials = _server_credentials(settings.tls) if settings.tls.enabled else None
        tls = _node_tls(settings)
        store = await asyncio.to_thread(FleetStore, settings.store, settings.fleet, tls=tls)
    except BaseException:
        await tenants.stop()
        raise
    endpoint: MetricsEndpoint | None = None
    try:
        quiet_cancelled_replies()
        limit = settings.server.max_message_bytes
        # The router's per-call series, as a node's (outermost: calls auth refuses are counted too).
        metrics = ServerMetrics(tenant_labels_cap=settings.metrics.tenant_labels)
        server = new_server([MetricsInterceptor(metrics, RequestLog()),
                             AuthInterceptor(tenants, open_caller(host), METHOD_RIGHTS), UndecodableRequests()], limit)
        layouts = {g.name: Layout.of(g, settings.store.block_tokens) for g in geometry.REGISTRY.values()}
        servicer = KVStoreServicer(store, layouts, limit, None,
                                   hits=HitStats(None, SystemClock(), block_tokens=settings.store.block_tokens))
        add_service(kvstore_pb2_grpc.add_KVStoreServicer_to_server, servicer, server, presized={"Get"})
        forwarder = Forwarder(store.view, tls)  # Admin and the SWA pool, on the nodes (F52)
        server.add_generic_rpc_handlers((forwarder, _Elsewhere(str(store.address))))
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        address = f"{host}:{settings.server.port}"
        try:
            port = (server.add_secure_port(address, credentials) if credentials is not None
                    else server.add_insecure_port(address))
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {address}: {exc}") from None
        if port == 0:
            raise OSError(f"cannot listen on {address}")
        metrics.registry.register(GatewayCollector(store, forwarder))
        endpoint = start_endpoint(settings.metrics, metrics.registry)  # before the start: a port in use stops it
        await server.start()
        tenants.start(settings.auth.reload_s)
    except BaseException:
        if endpoint is not None:
            await endpoint.close()
        await asyncio.to_thread(store.close)
        await tenants.stop()
        raise
    closers: list[Callable[[], Any]] = [lambda: close_forwarder(forwarder)]
    if endpoint is not None:
        closers.append(endpoint.close)
    return RunningGateway(port=port, server=server, store=store, health=health, tenants=tenants, closers=closers,
                          metrics_endpoint=endpoint)


def _node_tls(settings: Settings) -> TlsOptions | None:
    """How the gateway dials nodes: as nodes dial each other (F20): TLS when it speaks TLS, checked against
    `[fleet] ca_file` (default its own certificate) and, under mutual TLS, showing its own certificate."""
    tls = settings.tls
    if not tls.enabled:
        return None
    mutual = bool(tls.client_ca_file)
    return TlsOptions(ca_file=settings.fleet.ca_file or tls.cert_file, cert_file=tls.cert_file if mutual else "",
                      key_file=tls.key_file if mutual else "")


class _Elsewhere(grpc.GenericRpcHandler):
    """Answers every method of `ELSEWHERE`'s services FAILED_PRECONDITION, naming where to go (F40)."""

    def __init__(self, fleet: str) -> None:
        self.fleet = fleet
        self.methods: dict[str, tuple[str, Any]] = {}
        for module in (transfer_pb2,):
            for service in module.DESCRIPTOR.services_by_name.values():
                for method in service.methods:
                    self.methods[f"/{service.full_name}/{method.name}"] = (service.full_name, method)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        found = self.methods.get(handler_call_details.method)
        if found is None:
            return None
        name, method = found
        # A session's data goes straight between the worker and the nodes (item 5): a fleet client opens one per
        # node it reads from (F49), so the gateway sends it there rather than adding a hop to every block (F40).
        message = (f"{name} is not served by a gateway: {ELSEWHERE[name]}; open the session with the fleet "
                   f"address kvstore.Client('etcd://{self.fleet.removeprefix('etcd://')}') (it fetches each run "
                   "straight from its nodes), or call a node of the fleet directly (kvstore fleet status lists them)")

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)

        async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)
            yield  # pragma: no cover  (a generator: the kind a streaming reply needs)

        if method.server_streaming:
            return (grpc.stream_stream_rpc_method_handler(refuse_stream) if method.client_streaming
                    else grpc.unary_stream_rpc_method_handler(refuse_stream))
        return (grpc.stream_unary_rpc_method_handler(refuse) if method.client_streaming
                else grpc.unary_unary_rpc_method_handler(refuse))


async def serve_gateway(settings: Settings) -> None:
    """Run until SIGTERM or SIGINT, then stop cleanly; one line at start says where and which fleet."""
    running = await start_gateway(settings)
    store = running.store
    auth = "tokens (the fleet's tenants in etcd)" if running.tenants.enabled else "off"
    print(f"kvstore gateway listening on {settings.server.host}:{running.port} for fleet etcd://{store.address} "
          f"({len(store.view.nodes)} nodes live, runs of {store.run_blocks} blocks, replication "
          f"{store.replication}); auth {auth}; TLS {'on' if settings.tls.enabled else 'off'}; metrics "
          f"{running.metrics_endpoint.url if running.metrics_endpoint else 'off'}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("kvstore gateway shutting down", file=sys.stderr, flush=True)
    await running.stop(settings.server.grace_s)
    print("kvstore gateway stopped", file=sys.stderr, flush=True)
