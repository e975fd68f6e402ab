"""The kvstore server process: one grpc.aio server with the KVStore, SwaPool and
Transfer services, the standard health service and server reflection on one port.

Every method of every service answers a request it cannot decode with
INVALID_ARGUMENT (gateway.undecodable), never UNKNOWN."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from gateway.kvstore_servicer import KVStoreServicer
from gateway.swa_servicer import SwaPoolServicer
from gateway.transfer_servicer import TransferServicer
from gateway.undecodable import UndecodableRequests
from gateway.validate import Layout
from kvstore import geometry
from kvstore.clock import Clock, SystemClock
from kvstore.config import Settings
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc, swa_pb2, swa_pb2_grpc, transfer_pb2, transfer_pb2_grpc
from tiers import blockcopy
from tiers.lmdb_tier import LmdbBlockTier
from tiers.swa_cache import SwaCache
from tiers.swa_pool import open_pool

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
    #: Called after the gRPC server stops, last first: each service's clean-up.
    closers: list[Callable[[], Any]] = field(default_factory=list)
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
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        await _close(self.closers)
        self.tier.close()


async def start(settings: Settings, *, clock: Clock | None = None) -> RunningServer:
    """Open the store, the SWA pool and the transfer sessions, and serve on `settings.server.host:port`.

    Raises:
        OSError: the address cannot be bound (everything opened so far is closed).
    """
    tier = LmdbBlockTier(settings.store, clock=clock)
    closers: list[Callable[[], Any]] = []
    try:
        server, health = await _assemble(settings, tier, closers, clock or SystemClock())
        address = f"{settings.server.host}:{settings.server.port}"
        try:
            port = server.add_insecure_port(address)
        except RuntimeError as exc:  # newer grpcio raises instead of returning 0
            raise OSError(f"cannot listen on {address}: {exc}") from None
        if port == 0:
            raise OSError(f"cannot listen on {address}")
        await server.start()
    except BaseException:
        await _close(closers)
        tier.close()
        raise
    return RunningServer(port=port, server=server, tier=tier, health=health, closers=closers)


async def _assemble(settings: Settings, tier: LmdbBlockTier, closers: list[Callable[[], Any]],
                    clock: Clock) -> tuple[grpc.aio.Server, health_aio.HealthServicer]:
    """The gRPC server with every service on it; each service's clean-up goes to `closers`."""
    layouts = {g.name: Layout.of(g, settings.store.block_tokens) for g in geometry.REGISTRY.values()}
    limit = settings.server.max_message_bytes
    server = grpc.aio.server(interceptors=[UndecodableRequests()], options=[
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.so_reuseport", 0),
    ])
    swa = SwaCache(open_pool(settings.swa, clock=clock), ttl_s=settings.swa.ttl_s)
    closers.append(swa.close)
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(KVStoreServicer(tier, layouts, limit, swa), server)
    swa_pb2_grpc.add_SwaPoolServicer_to_server(SwaPoolServicer(swa, layouts, settings.swa.max_batch_snapshots), server)
    transfer = TransferServicer(tier, layouts, settings.transfer, max_message_bytes=limit)
    closers.append(transfer.close)
    transfer_pb2_grpc.add_TransferServicer_to_server(transfer, server)
    services = [SERVICE_NAME, SWA_SERVICE_NAME, transfer_pb2.DESCRIPTOR.services_by_name["Transfer"].full_name]
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
    running = await start(settings)
    print(f"kvstore listening on {settings.server.host}:{running.port}", flush=True)
    print(f"kvstore data in {settings.store.data_dir.resolve()} "
          f"(capacity {settings.store.capacity_bytes / 2**30:.1f} GiB, "
          f"retention {settings.store.retention_hours:g} h, {settings.store.block_tokens}-token blocks)",
          flush=True)
    print(f"kvstore SWA pool: {settings.swa.backend} (snapshots live {settings.swa.ttl_s:g} s)", flush=True)
    if blockcopy.NATIVE:
        print(f"kvstore transfer copies: native, {settings.transfer.copy_threads} threads", flush=True)
    else:
        print("kvstore transfer copies: Python loop, 1 thread (tiers._blockcopy was not built: reinstall with "
              "a C compiler for parallel copies)", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("kvstore shutting down", file=sys.stderr, flush=True)
    await running.stop(settings.server.grace_s)
    print("kvstore stopped", file=sys.stderr, flush=True)
