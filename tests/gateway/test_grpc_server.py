"""gateway/grpc_server.py: the server answers every method through generic handlers, none registered (grpc.aio's
accept loop pays per registered method on every call)."""

from __future__ import annotations

import asyncio
from unittest import mock

import grpc
from grpc.aio._server import Server
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.grpc_server import new_server


def test_generated_services_are_served_without_registered_methods() -> None:
    async def run() -> None:
        with mock.patch.object(Server, "add_registered_method_handlers", autospec=True) as registered:
            server = new_server([], 1 << 20)
            servicer = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(servicer, server)  # generated: registers both ways
            await servicer.set("kvstore.v1.KVStore", health_pb2.HealthCheckResponse.SERVING)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    reply = await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service="kvstore.v1.KVStore"), timeout=30)
            finally:
                await server.stop(0)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING  # found through the generic handler
        assert registered.call_count == 0  # no accept-loop slot per method

    asyncio.run(run())


def test_a_second_server_cannot_share_the_port() -> None:
    async def run() -> None:
        first = new_server([], 1 << 20)
        port = first.add_insecure_port("127.0.0.1:0")
        await first.start()
        try:
            second = new_server([], 1 << 20)
            try:
                bound = second.add_insecure_port(f"127.0.0.1:{port}")
            except RuntimeError:
                bound = 0
            assert bound == 0  # SO_REUSEPORT off: the bind fails instead of splitting the calls
        finally:
            await first.stop(0)

    asyncio.run(run())
